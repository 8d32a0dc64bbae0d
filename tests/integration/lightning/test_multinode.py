"""Two "nodes" of 2 processes each on this machine (gloo), launched as on a cluster: ``torchrun --nnodes 2``
twice (node ranks 0 and 1, one rendezvous address) and as SLURM starts tasks (Lightning's
``SLURMEnvironment`` from ``SLURM_*`` variables, one process per task). ``Trainer(num_nodes=2,
devices=2)`` with ``shard_group_size="node"``: each node is one shard group. Every rank's final weights
and the checkpoint all ranks wrote into one directory match a DDP step computed here in one process at
1e-5, and each rank reports the topology Lightning and the engine saw."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

REPO = Path(__file__).resolve().parents[3]
STEPS, ACCUMULATE, BATCH, CLIP, LR = 3, 2, 2, 0.5, 0.01

SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    from pathlib import Path
    import torch
    import lightning as L
    from lightning_zeroq import ZeroQStrategy
    from tests.models import RichModel, TokenDataset

    OUT, STAGE = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = RichModel()

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return self.model.loss((tokens, targets, False))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr={LR}, eps=1e-3)

    L.seed_everything(0)
    module = M()
    stage3 = dict(stage3_wrap_classes=["Sequential", "Linear"], stage3_param_persistence_threshold=0)
    strategy = ZeroQStrategy(stage=STAGE, shard_group_size="node", **(stage3 if STAGE == 3 else {{}}))
    trainer = L.Trainer(accelerator="cpu", num_nodes=2, devices=2, strategy=strategy, max_steps={STEPS},
                        accumulate_grad_batches={ACCUMULATE}, gradient_clip_val={CLIP}, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(TokenDataset(64), batch_size={BATCH}))
    trainer.save_checkpoint(OUT / "shared.ckpt")  # every rank of both nodes writes into one directory
    engine = strategy.engine
    rank = trainer.global_rank
    torch.save(module.model.state_dict(), OUT / f"weights{{rank}}.pt")
    (OUT / f"rank{{rank}}.json").write_text(json.dumps({{
        "environment": type(strategy.cluster_environment).__name__,
        "world_size": trainer.world_size, "global_rank": rank, "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank, "num_nodes": strategy.num_nodes, "num_processes": strategy.num_processes,
        "sampler": strategy.distributed_sampler_kwargs,
        "shard_group": [engine.parts.world_size, engine.parts.rank], "groups": [engine.parts.num_groups, engine.parts.replica_rank],
    }}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "LOCAL_", "GROUP_", "ROLE_"))
           and k not in ("RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1", **extra)
    return env


def _wait(procs: list[subprocess.Popen], timeout: float = 300) -> None:
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(o[-3000:] for o in outputs)


def _torchrun(tmp_path: Path, script: Path, stage: int) -> None:
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
         str(script), str(tmp_path), str(stage)],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    _wait(procs)


def _slurm(tmp_path: Path, script: Path, stage: int) -> None:
    port = str(_free_port())
    procs = []
    for rank in range(4):  # what srun starts for --nodes 2 --ntasks-per-node 2
        env = _env(SLURM_NTASKS="4", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2),
                   SLURM_NODEID=str(rank // 2), SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
                   SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="4242", SLURM_JOB_NAME="zeroq",
                   SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), str(stage)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    _wait(procs)


def _ddp_reference() -> dict[str, torch.Tensor]:
    """What DDP computes for the run above, in one process: each step averages the gradients of the
    4 ranks' micro-batches (the DistributedSampler Lightning gives a training loader: shuffled, seed 0), each loss divided by the
    accumulation, clips the total norm and steps AdamW."""
    import lightning as L
    from torch.utils.data import DistributedSampler

    from tests.models import RichModel, TokenDataset

    L.seed_everything(0)
    model = RichModel()
    data = TokenDataset(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-3)
    order = [list(DistributedSampler(data, num_replicas=4, rank=r, shuffle=True, seed=0)) for r in range(4)]
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            k = (step * ACCUMULATE + micro) * BATCH
            for r in range(4):
                tokens, targets = data[order[r][k : k + BATCH]]
                (model.loss((tokens, targets, False)) / ACCUMULATE / 4).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _check(tmp_path: Path, environment: str) -> None:
    from lightning_zeroq.checkpoint.convert import lightning_checkpoint

    reference = _ddp_reference()
    for rank in range(4):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert info == {
            "environment": environment, "world_size": 4, "global_rank": rank, "node_rank": rank // 2,
            "local_rank": rank % 2, "num_nodes": 2, "num_processes": 2,
            "sampler": {"num_replicas": 4, "rank": rank},
            "shard_group": [2, rank % 2], "groups": [2, rank // 2],  # a node is a shard group
        }, info
        weights = torch.load(tmp_path / f"weights{rank}.pt")
        for name, value in reference.items():
            assert (weights[name] - value).abs().max() < 1e-5, (rank, name)
    saved = lightning_checkpoint(tmp_path / "shared.ckpt")["state_dict"]
    for name, value in reference.items():
        assert (saved[f"model.{name}"] - value).abs().max() < 1e-5, name


@pytest.mark.slow
def test_torchrun_two_nodes_of_two_match_ddp(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    _torchrun(tmp_path, script, 3)
    _check(tmp_path, "TorchElasticEnvironment")


@pytest.mark.slow
def test_slurm_two_nodes_of_two_match_ddp(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    _slurm(tmp_path, script, 2)
    _check(tmp_path, "SLURMEnvironment")
