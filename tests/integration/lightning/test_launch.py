"""Real launches through Lightning's subprocess launcher (2 processes on CPU): a successful fit exits 0,
and an error on one rank ends every rank within seconds (no rank waits in a collective)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.launch_env import launch_env

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier


SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import lightning as L
    import lightning_zeroq  # noqa: F401
    from tests.models import RichModel, TokenDataset

    FAIL_AT, STAMP = int(sys.argv[1]), sys.argv[2]

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = RichModel()

        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == FAIL_AT:
                open(STAMP, "w").write(str(time.time()))
                raise ValueError("deliberate failure on rank 1")
            tokens, targets = batch
            return self.model.loss((tokens, targets, False))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zeroq_stage_3", max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(M(), torch.utils.data.DataLoader(TokenDataset(64), batch_size=2))
""")


def _launch(tmp_path: Path, fail_at: int) -> tuple[int, float, str]:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    stamp = tmp_path / "failed_at"
    env = launch_env()
    proc = subprocess.run([sys.executable, str(script), str(fail_at), str(stamp)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    ended = time.time()
    failed = float(stamp.read_text()) if stamp.exists() else ended
    return proc.returncode, ended - failed, proc.stdout + proc.stderr


def test_a_successful_fit_exits_zero(tmp_path):
    code, _, output = _launch(tmp_path, fail_at=-1)
    assert code == 0, output[-3000:]
    assert "terminate called" not in output


def test_an_error_on_one_rank_ends_every_rank_within_seconds(tmp_path):
    # A rank left waiting in a collective would wait for the 30-minute default timeout: the launch's own limit
    # (240 s) fails the test then. How soon it ends depends on the machine's load: reported, not judged.
    code, seconds_after_failure, output = _launch(tmp_path, fail_at=2)
    assert code != 0 and "deliberate failure on rank 1" in output, output[-3000:]
    print(f"every rank gone {seconds_after_failure:.1f} s after rank 1 failed")


def test_the_launcher_pickles_without_its_observer_and_children():
    # torch.save(trainer) on rank 0 of devices=N: what the launcher watches belongs to this process alone
    import functools
    import pickle

    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_zeroq.lightning.launcher import ZeroQLauncher, _Observer
    from lightning_zeroq.lightning.strategy import _swap_roots

    launcher = ZeroQLauncher(LightningEnvironment(), 2, 1, functools.partial(_swap_roots, None))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    launcher.procs = [child]
    launcher._observer = _Observer(0, launcher.procs, [])
    copy = pickle.loads(pickle.dumps(launcher))
    assert copy._observer is None and copy.procs == [] and copy.num_processes == 2
    assert launcher._observer is not None and launcher.procs == [child]  # the original keeps them
