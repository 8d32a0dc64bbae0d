"""The package's version, its one source: ``pyproject.toml`` reads it from here (``[tool.setuptools.dynamic]``)
without importing the package, so a build needs no torch."""

__version__ = "0.1.0"
