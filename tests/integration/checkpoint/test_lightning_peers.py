"""Checkpoints written by Lightning's own ``FSDPStrategy`` (``state_dict_type="sharded"``: a DCP directory;
``"full"``: one file) and ``DeepSpeedStrategy`` (ZeRO-3, bf16) resume under ZeroQ: the weights and Adam's
moments bitwise those the strategy itself reported (``reference.pt``, from FSDP's ``summon_full_params`` and
``optim_state_dict``, DeepSpeed's ``safe_get_full_*``), the Trainer's loops at the saved step, and the
next 20 steps' losses within 1e-6 relative of DDP resumed from the same state. The fixtures were written
on one GPU by ``tests/data/lightning/make_fixtures.py`` (Lightning wants a GPU for both strategies)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.checkpoint.test_deepspeed import _resume_body

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "lightning"
FILES = {"fsdp_sharded": "fsdp_sharded", "fsdp_full": "fsdp_full.ckpt", "deepspeed_stage3_bf16": "deepspeed_stage3_bf16"}


def test_the_fixtures_are_lightnings_own():
    versions = json.loads((FIXTURES / "VERSIONS.json").read_text())
    assert versions["lightning"].startswith("2.") and versions["deepspeed"].startswith("0.")
    assert all(versions["fixtures"][name] == "written" for name in FILES)
    assert (FIXTURES / "fsdp_sharded" / ".metadata").is_file() and (FIXTURES / "fsdp_sharded" / "meta.pt").is_file()


# (fixture, world size, stage): every fixture at two sizes and stages, none at the one it was written at
RESUMES = [("fsdp_sharded", 2, 3), ("fsdp_sharded", 3, 1), ("fsdp_full", 2, 2), ("fsdp_full", 3, 3),
           ("deepspeed_stage3_bf16", 2, 2), ("deepspeed_stage3_bf16", 1, 3)]


@pytest.mark.parametrize("fixture, world_size, stage", RESUMES)
def test_a_lightning_peer_checkpoint_resumes_exactly(dist_pool, tmp_path, fixture, world_size, stage):
    reference = str(FIXTURES / f"{fixture}.reference.pt")
    if fixture.startswith("fsdp"):  # both FSDP fixtures hold the same state (one run each, same seed)
        full = str(FIXTURES / "fsdp_full.ckpt")
    else:
        import lightning_zeroq.cli.convert as convert

        full = str(tmp_path / "full.ckpt")
        assert convert.main([str(FIXTURES / fixture), full, "--optimizer"]) == 0
    pool = dist_pool(world_size)
    ours = pool.run(_resume_body, str(FIXTURES / FILES[fixture]), reference, "zeroq", stage, 3)
    ddp = pool.run(_resume_body, full, reference, "ddp", 0, 3)
    for (step, worst, losses, started), (_, _, ref, ddp_started) in zip(ours, ddp):
        assert step == 3.0 and worst == 0.0
        assert started == ddp_started == 3  # Lightning's loops resume where the run stopped
        assert len(losses) == len(ref) == 20
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, ref)), (losses, ref)
