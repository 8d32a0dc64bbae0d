"""A checkpoint directory's files, each opened once (``Files``), and the names a load may open
(``check_name``: one plain name inside the directory, never ``../`` or an absolute path)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, Optional


def check_name(name: Any, directory: Path) -> None:
    """A file name a checkpoint's metadata may refer to: one plain name inside ``directory``."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\0" in name
        or os.path.isabs(name)
    ):
        raise ValueError(
            f"{directory / '.metadata'} refers to the data file {name!r}, which is not a file inside "
            f"{directory}; it was not opened (the metadata is damaged or was made to read other files)."
        )


class Files:
    """The files of one checkpoint directory, each opened once, relative to the directory opened once
    (never through a symbolic link inside it): validation and every later read of a load go through
    these handles, so a save that replaces the directory meanwhile cannot mix two checkpoints into one
    load: the reader keeps reading the files it validated, or fails to open one and says why."""

    def __init__(self, directory: Path, dir_fd: Optional[int] = None) -> None:
        """``dir_fd``: the directory already opened (``subdirectory``), owned from here on."""
        self.directory = Path(directory)
        self._dir = (
            dir_fd
            if dir_fd is not None
            else os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        )
        self._fds: dict[str, int] = {}

    def names(self) -> list[str]:
        """The names in the directory (as ``os.listdir`` gives them)."""
        return os.listdir(self._dir)

    def is_link(self, name: str) -> bool:
        """Whether ``name`` in the directory is a symbolic link (False where nothing is there)."""
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def subdirectory(self, name: str) -> "Files":
        """The directory ``name`` (one plain name) inside this one, opened relative to it and never through
        a symbolic link: a link is a ``ValueError``; nothing there, ``FileNotFoundError``; a file,
        ``NotADirectoryError``."""
        if self.is_link(name):
            raise ValueError(
                f"{self.directory / name} is a symbolic link; a checkpoint's directories are read only "
                "from inside it, never through a link."
            )
        flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
        return Files(self.directory / name, os.open(name, flags, dir_fd=self._dir))

    def fd(self, name: str) -> int:
        check_name(name, self.directory)
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), dir_fd=self._dir)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise ValueError(
                        f"{self.directory / name} is a symbolic link; a checkpoint's files are read "
                        "only from inside its directory, never through a link."
                    ) from None
                raise
            self._fds[name] = fd
        return fd

    def is_file(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.fstat(self.fd(name)).st_mode)
        except FileNotFoundError:
            return False

    def size(self, name: str) -> int:
        return os.fstat(self.fd(name)).st_size

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """``length`` bytes at ``offset`` (None: to the end); fewer only at the end of the file."""
        fd = self.fd(name)
        if length is None:
            length = max(os.fstat(fd).st_size - offset, 0)
        parts, got = [], 0
        while got < length:
            part = os.pread(fd, min(length - got, 1 << 30), offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; the bytes read (fewer only at the end of the file)."""
        fd, got = self.fd(name), 0
        while got < len(buffer):
            n = os.preadv(fd, [buffer[got : got + (1 << 30)]], offset + got)
            if n <= 0:
                break
            got += n
        return got

    def replaced(self) -> bool:
        """Whether the directory was removed (or replaced by a save) since it was opened."""
        try:
            return os.fstat(self._dir).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        if getattr(self, "_dir", None) is not None:
            fds.append(self._dir)
            self._dir = None  # type: ignore[assignment]
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()
