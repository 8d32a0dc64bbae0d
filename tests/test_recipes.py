"""Recipe regression tests: every recipe in ``recipes/`` runs briefly and must reproduce its figures.

Each recipe is composed with Hydra's compose API inside the 2 gloo workers of the session's
``dist_pool`` and trained by ``lightning_zeroq.cli.train`` (the function ``zeroq-train`` runs), as it
is except for ``trainer.max_steps=STEPS`` (and no progress bar). The per-step loss trajectory (averaged
over the ranks) is compared with ``recipes/<name>.expected.json``.

Tolerance: relative 1e-5 per step. On one machine these runs are bitwise reproducible (fp32, fixed
seed, one thread per rank, sums of 2 ranks); measured: two runs give identical losses, and stage 1 and
stage 2 give identical losses. The slack is for other CPUs and torch builds, whose kernels may round
differently. Measured on this recipe over 15 steps: 2 threads per rank instead of 1 moves the loss by
6e-8 relative, another unit size (``zero.reduce_bucket_size``) by 7e-8, while a learning rate changed by
1e-4 relative moves it by 3.5e-5, so 1e-5 has 100x room for rounding and still catches real changes.

Regenerate the figures (all recipes, or the ones named) with ONE command, then commit the JSON files:

    python tests/test_recipes.py --regenerate [RECIPE ...]
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run as a script: make `tests` and `lightning_zeroq` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_zeroq.cli import compose_config, figures_path, recipe_names, to_run_config, train  # noqa: E402

STEPS = 15
WORLD_SIZE = 2
RTOL = 1e-5
REGENERATE = "python tests/test_recipes.py --regenerate"


def run_recipe(name: str, steps: int, run_dir: str) -> list[float]:
    """In each pool worker: compose the recipe, train ``steps`` steps, return the rank-averaged losses."""
    os.environ["OMP_NUM_THREADS"] = "1"  # keeps Lightning from raising the thread count on big machines
    cfg = compose_config([f"recipe={name}", f"trainer.max_steps={steps}", "trainer.enable_progress_bar=false"])
    return train(to_run_config(cfg), Path(run_dir), name).losses


def figures(name: str, losses: list[float]) -> dict[str, Any]:
    import torch

    return {
        "recipe": name,
        "regenerate": f"{REGENERATE} {name}",
        "world_size": WORLD_SIZE,
        "steps": len(losses),
        "torch": torch.__version__,
        "loss": losses,
    }


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_reproduces_its_figures(name: str, dist_pool: Any, tmp_path: Path) -> None:
    path = figures_path(name)
    if not path.is_file():
        pytest.fail(f"recipe {name!r} has no stored figures ({path} is missing); generate them with "
                    f"`{REGENERATE} {name}` and commit the file.")
    expected = json.loads(path.read_text())
    if expected.get("steps") != STEPS or expected.get("world_size") != WORLD_SIZE:
        pytest.fail(f"{path} holds figures for {expected.get('steps')} steps on {expected.get('world_size')} "
                    f"ranks, the test runs {STEPS} on {WORLD_SIZE}; regenerate with `{REGENERATE} {name}`.")
    results = dist_pool(WORLD_SIZE).run(run_recipe, name, STEPS, str(tmp_path))
    assert results[0] == results[1], "ranks disagree on the gathered losses"
    losses = results[0]
    assert len(losses) == STEPS
    assert all(math.isfinite(x) for x in losses)
    mismatches = [
        f"step {i}: got {got:.7f}, stored {want:.7f} (rel {abs(got - want) / abs(want):.1e})"
        for i, (got, want) in enumerate(zip(losses, expected["loss"]))
        if not math.isclose(got, want, rel_tol=RTOL)
    ]
    assert not mismatches, (
        f"recipe {name!r} no longer reproduces {path.name} (rtol {RTOL}):\n  " + "\n  ".join(mismatches)
        + f"\nIf the change is intended, regenerate with `{REGENERATE} {name}` and commit the file."
    )
    assert losses[-1] < losses[0], "the recipe does not learn"


def regenerate(names: list[str]) -> None:
    """Run each recipe on a fresh 2-rank pool exactly as the test does and store its figures."""
    from tests import test_recipes  # the pool needs an importable module, not __main__
    from tests.dist_pool import DistPool

    unknown = sorted(set(names) - set(recipe_names()))
    if unknown:
        raise SystemExit(f"unknown recipe(s) {unknown}; recipes are {recipe_names()}")
    pool = DistPool(WORLD_SIZE)
    try:
        for name in names or recipe_names():
            with tempfile.TemporaryDirectory() as run_dir:
                losses = pool.run(test_recipes.run_recipe, name, STEPS, run_dir)[0]
            figures_path(name).write_text(json.dumps(figures(name, losses), indent=2) + "\n")
            print(f"wrote {figures_path(name)}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    finally:
        pool.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "--regenerate":
        raise SystemExit(f"usage: {REGENERATE} [RECIPE ...]")
    regenerate(args[1:])
