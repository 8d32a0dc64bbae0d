"""Recipe regression tests: every recipe in ``recipes/`` runs briefly and must reproduce its figures.

Each recipe is composed with Hydra's compose API inside the 2 gloo workers of the session's
``dist_pool`` and trained by ``lightning_zeroq.cli.train.train`` (the function ``zeroq-train`` runs), as it
is except for ``trainer.max_steps=STEPS`` (and no progress bar). The per-step loss trajectory (averaged
over the ranks) is compared with ``recipes/<name>.expected.json``.

Tolerance: relative, per recipe (``RTOL``), the same for every step. On one machine these runs are
bitwise reproducible (fp32, fixed seed, one thread per rank, sums of 2 ranks): two runs give identical
losses. On another x86-64 CPU the same torch wheel runs other kernels: ATen's vectorized kernels are
built for several instruction sets and picked at run time, and MKL and oneDNN pick their own code
paths (on AMD, MKL takes other paths than on Intel). They round differently, so the figures move; with
INT8 weights much more, because a rounding difference that moves a weight across a half-step of its
INT8 grid changes that weight by a whole step (1/127 of its group's largest magnitude), not by an ulp.
(A fresh clone on an AMD EPYC with AVX-512 saw 3.5e-5 on step 14 of both INT8 recipes.)

How far, measured: ``python tests/integration/cli/test_recipes.py --spread`` runs every recipe under each setting of
``SPREAD_SETTINGS`` (ATen's capability ``default``/``avx2``/``avx512``, MKL limited to AVX2 or SSE4.2,
oneDNN limited to AVX2, all three at AVX2, all three at the baseline) and prints the largest relative
deviation from the stored figures over the 15 steps. On an Intel Xeon with AVX-512 (torch 2.13.0+cpu,
MKL 2024.2, oneDNN 3.12) the largest over all settings: fp32 recipes 7.1e-8 to 1.0e-7 (an ulp or two of
a float32 loss; the deviation does not grow over the steps), INT8 recipes 6.4e-5 (stage 2) and 7.6e-5
(stage 3, both at steps 9-14; below 1e-5 until step 8), ATen ``default`` and all-baseline the largest.
Each tolerance is about 4-5x its recipe's measured spread (``RTOL`` below). A real change moves the
figures far more: a learning rate 1% higher moves them by 6.3e-3 (fp32 recipes) and 3.5e-3 (INT8),
more than 10x the largest tolerance, and a change of 1e-4 relative by 3.5e-5 (fp32).

Regenerate the figures (all recipes, or the ones named) with ONE command, then commit the JSON files:

    python tests/integration/cli/test_recipes.py --regenerate [RECIPE ...]

A new recipe also needs its tolerance: run ``--spread`` and add it to ``RTOL`` with the measurement.
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_zeroq.cli.train import compose_config, figures_path, recipe_names, to_run_config, train  # noqa: E402

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

STEPS = 15
WORLD_SIZE = 2
# Relative tolerance per recipe, about 4-5x the largest deviation measured across instruction sets
# (module docstring; measured spread in the comments). fp32: 5e-7 for all (spread 7.1e-8 to 1.0e-7).
_FP32_RTOL = 5e-7
RTOL = {
    "gpt1m_zero1_cpu": _FP32_RTOL,  # 9.6e-8
    "gpt1m_zero1_offload_cpu": _FP32_RTOL,  # 7.1e-8
    "gpt1m_zero1_offload_nvme_cpu": _FP32_RTOL,  # 7.1e-8
    "gpt1m_zero2_cpu": _FP32_RTOL,  # 9.6e-8
    "gpt1m_zero2_offload_cpu": _FP32_RTOL,  # 7.1e-8
    "gpt1m_zero2_offload_half_cpu": _FP32_RTOL,  # 7.1e-8 (Xeon, AVX-512; bitwise gpt1m_zero2_offload_cpu's on CPU)
    "gpt1m_zero2_offload_nvme_cpu": _FP32_RTOL,  # 7.1e-8
    "gpt1m_zero3_cpu": _FP32_RTOL,  # 7.1e-8
    "gpt1m_zero3_offload_cpu": _FP32_RTOL,  # 1.0e-7
    "gpt1m_zero3_offload_nvme_cpu": _FP32_RTOL,  # 1.0e-7
    "gpt1m_zero3_offload_params_nvme_cpu": _FP32_RTOL,  # 1.0e-7
    # fp32 fine-tunes from a base this test pretrains (BASE_RECIPE), the base's spread included
    "gpt1m_lora_zero3_cpu": 8e-7,  # 1.7e-7 (ATen default, all at baseline)
    "gpt1m_lora_zero3_offload_cpu": 8e-7,  # 1.7e-7 (all at baseline)
    "gpt1m_zero2_int8_cpu": 2.5e-4,  # 6.4e-5 (ATen default), 3.5e-5 on an AMD EPYC
    "gpt1m_zero3_int8_cpu": 3e-4,  # 7.6e-5 (all at baseline), 3.5e-5 on an AMD EPYC
}
# The settings --spread runs under (each in a fresh process: these are read when torch loads).
SPREAD_SETTINGS: dict[str, dict[str, str]] = {
    "as is": {},
    "aten=default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten=avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "mkl=avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl=sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "onednn=avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "all avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "all baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                     "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
REGENERATE = "python tests/integration/cli/test_recipes.py --regenerate"


BASE_RECIPE, BASE_STEPS = "gpt1m_zero2_cpu", 30
"""A fine-tuning recipe starts from this recipe's checkpoint after ``BASE_STEPS`` steps (made in the run's directory)."""


def base_checkpoint(run_dir: str) -> str:
    """In each pool worker: pretrain ``BASE_RECIPE`` for ``BASE_STEPS`` steps with its checkpoint on; its path."""
    base_dir = Path(run_dir) / "base"
    overrides = [f"recipe={BASE_RECIPE}", f"trainer.max_steps={BASE_STEPS}", "trainer.enable_progress_bar=false",
                 "trainer.enable_checkpointing=true", "trainer.logger=false"]
    train(to_run_config(compose_config(overrides)), base_dir, "base")
    found = sorted((base_dir / "checkpoints").glob("*.ckpt"))
    assert len(found) == 1, found
    return str(found[0])


def run_recipe(name: str, steps: int, run_dir: str) -> list[float]:
    """In each pool worker: compose the recipe, train ``steps`` steps, return the rank-averaged losses."""
    os.environ["OMP_NUM_THREADS"] = "1"  # keeps Lightning from raising the thread count on big machines
    overrides = [f"recipe={name}", f"trainer.max_steps={steps}", "trainer.enable_progress_bar=false"]
    if compose_config(overrides).finetune.lora_rank:
        overrides.append(f"finetune.base='{base_checkpoint(run_dir)}'")  # quoted: a checkpoint's name holds '='
    zero = compose_config(overrides).zero
    if "nvme" in (zero.offload_optimizer_device, zero.offload_params_device):
        # The recipes swap to <$TMPDIR or /tmp>/zeroq_rank<r>/: two runs on one machine at once (two
        # checkouts' test suites) would overwrite each other's swap files. This run's directory is its own.
        overrides.append(f"zero.nvme_path={run_dir}")
    return train(to_run_config(compose_config(overrides)), Path(run_dir), name).losses


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
    if name not in RTOL:
        pytest.fail(f"recipe {name!r} has no tolerance in RTOL; measure its spread with "
                    "`python tests/integration/cli/test_recipes.py --spread` and add it with the measurement.")
    rtol = RTOL[name]
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
        if not math.isclose(got, want, rel_tol=rtol)
    ]
    assert not mismatches, (
        f"recipe {name!r} no longer reproduces {path.name} (rtol {rtol}):\n  " + "\n  ".join(mismatches)
        + f"\nIf the change is intended, regenerate with `{REGENERATE} {name}` and commit the file."
    )
    assert losses[-1] < losses[0], "the recipe does not learn"


def run_all(names: list[str]) -> dict[str, list[float]]:
    """Run each recipe on a fresh 2-rank pool exactly as the test does; its losses by name."""
    from tests.integration.cli import test_recipes  # the pool needs an importable module, not __main__
    from tests.dist_pool import DistPool

    unknown = sorted(set(names) - set(recipe_names()))
    if unknown:
        raise SystemExit(f"unknown recipe(s) {unknown}; recipes are {recipe_names()}")
    pool = DistPool(WORLD_SIZE)
    try:
        losses = {}
        for name in names or recipe_names():
            with tempfile.TemporaryDirectory() as run_dir:
                losses[name] = pool.run(test_recipes.run_recipe, name, STEPS, run_dir)[0]
        return losses
    finally:
        pool.close()


def regenerate(names: list[str]) -> None:
    """Store the figures of each recipe, run as the test runs it."""
    for name, losses in run_all(names).items():
        figures_path(name).write_text(json.dumps(figures(name, losses), indent=2) + "\n")
        print(f"wrote {figures_path(name)}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")


def spread(names: list[str]) -> None:
    """Run the recipes under every ``SPREAD_SETTINGS`` entry; print the largest deviation from the figures."""
    import subprocess

    names = names or recipe_names()
    stored = {name: json.loads(figures_path(name).read_text())["loss"] for name in names}
    worst = dict.fromkeys(names, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for label, setting in SPREAD_SETTINGS.items():
            out = Path(tmp, "losses.json")
            subprocess.run([sys.executable, __file__, "--losses", str(out), *names], check=True,
                           env={**os.environ, **setting}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, losses in json.loads(out.read_text()).items():
                rel = max(abs(got - want) / abs(want) for got, want in zip(losses, stored[name]))
                worst[name] = max(worst[name], rel)
                print(f"{label:14} {name:40} max relative deviation {rel:.1e}", flush=True)
    for name in names:
        print(f"{name:40} spread {worst[name]:.1e}  rtol {RTOL.get(name, 'missing')}")


if __name__ == "__main__":
    args = sys.argv[1:]
    usage = f"usage: {REGENERATE} [RECIPE ...] | python tests/integration/cli/test_recipes.py --spread [RECIPE ...]"
    if not args:
        raise SystemExit(usage)
    if args[0] == "--regenerate":
        regenerate(args[1:])
    elif args[0] == "--spread":
        spread(args[1:])
    elif args[0] == "--losses" and len(args) >= 2:  # one setting of --spread, in its own process
        Path(args[1]).write_text(json.dumps(run_all(args[2:])))
    else:
        raise SystemExit(usage)
