"""A stalled rank ends the whole job (2 processes through Lightning's subprocess launcher on CPU, in a Trainer's
fit and in a Fabric loop): with a short collective timeout, every process exits soon after it with an error
naming the stalled rank and where its code is; no process is left behind, whichever rank stalls (rank 0
launched the other)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.launch_env import alive, launch_env

TIMEOUT_S = 3

TRAINER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch
    import lightning as L
    from lightning_zeroq import ZeroQStrategy
    from tests.models import RichModel, TokenDataset

    STALL_RANK, TIMEOUT_S, PIDS = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = RichModel()

        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                with open(PIDS, "a") as f:
                    f.write(f"{os.getpid()}\\n")
            if self.global_rank == STALL_RANK and batch_idx == 2:
                with open(PIDS + ".stall", "w") as f:
                    f.write(str(time.time()))
                time.sleep(600)  # user code that never returns
            tokens, targets = batch
            return self.model.loss((tokens, targets, False))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = ZeroQStrategy(stage=2, timeout=timedelta(seconds=TIMEOUT_S))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(M(), torch.utils.data.DataLoader(TokenDataset(64), batch_size=2))
""")


FABRIC = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch
    import lightning as L
    from lightning_zeroq import ZeroQFabricStrategy
    from tests.models import RichModel, TokenDataset

    STALL_RANK, TIMEOUT_S, PIDS = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    strategy = ZeroQFabricStrategy(stage=2, timeout=timedelta(seconds=TIMEOUT_S))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = RichModel()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(TokenDataset(64), batch_size=2))
    with open(PIDS, "a") as f:
        f.write(f"{os.getpid()}\\n")
    for i, (tokens, targets) in enumerate(loader):
        if fabric.global_rank == STALL_RANK and i == 2:
            with open(PIDS + ".stall", "w") as f:
                f.write(str(time.time()))
            time.sleep(600)  # user code that never returns
        fabric.backward(torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
        optimizer.step()
        optimizer.zero_grad()
""")


# Each front door once, and each of rank 0 and another rank stalling once.
@pytest.mark.parametrize("loop,stall_rank", [("trainer", 1), ("fabric", 0)])
def test_a_stalled_rank_ends_every_process_with_its_name(tmp_path, loop, stall_rank):
    script, pids = tmp_path / "fit.py", tmp_path / "pids"
    script.write_text(TRAINER if loop == "trainer" else FABRIC)
    env = launch_env()
    proc = subprocess.Popen([sys.executable, str(script), str(stall_rank), str(TIMEOUT_S), str(pids)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    stalled_at = float((tmp_path / "pids.stall").read_text())
    ranks = [int(line) for line in pids.read_text().split()]
    assert len(ranks) == 2, output[-3000:]
    deadline = time.time() + 10
    while any(alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.2)
    last_exit = time.time()
    left = [pid for pid in ranks if alive(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"processes {left} outlived the job:\n{output[-3000:]}"
    assert proc.returncode != 0
    named = f"rank {stall_rank} stalled outside any collective, at {script}:"
    # the stalled rank says why it ends, and the rank whose collective timed out raises naming it
    assert f"[rank {stall_rank}] ZeroQ: the job ends: {named}" in output, output[-4000:]
    assert f"RuntimeError: ZeroQ: {named}" in output, output[-4000:]
    # every process ended within the timeout plus a few seconds (a loaded CI machine: generous)
    assert last_exit - stalled_at < TIMEOUT_S + 30, last_exit - stalled_at
