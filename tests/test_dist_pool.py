"""Tests of the persistent gloo worker pool (tests/dist_pool.py) and the ``dist_pool`` fixture."""

import os

import pytest
import torch
import torch.distributed as dist

# ---- bodies run inside the workers (module-level so workers can import them) ----


def _whoami(x, *, y):
    return dict(rank=dist.get_rank(), world=dist.get_world_size(), x=x, y=y, pid=os.getpid(),
                threads=torch.get_num_threads(),
                env={k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")})


def _all_reduce():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 is stuck here until the pool kills it
    return "unreachable"


def _die_on_rank0():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def _hang():
    dist.barrier() if dist.get_rank() == 0 else dist.recv(torch.zeros(1), src=0)


def _pollute_state():
    torch.set_default_dtype(torch.float64)
    os.environ["DIST_POOL_POLLUTION"] = "1"
    torch.set_num_threads(2)


def _read_state():
    return torch.get_default_dtype(), os.environ.get("DIST_POOL_POLLUTION"), torch.get_num_threads()


def _destroy_pg():
    dist.destroy_process_group()


def _train_ddp():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(dist.get_rank())  # different init per rank: DDP must broadcast rank 0's weights
    model = Tiny()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp", max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return dict(weights=[p.detach().clone() for p in model.parameters()], global_rank=trainer.global_rank,
                world_size=trainer.world_size,
                external=trainer.strategy.cluster_environment.creates_processes_externally,
                pg_alive=dist.is_initialized(), steps=trainer.global_step, pid=os.getpid())


# ---- tests ----


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_args_env(dist_pool, world_size):
    results = dist_pool(world_size).run(_whoami, 5, y="why")
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert (r["world"], r["x"], r["y"], r["threads"]) == (world_size, 5, "why", 1)
        assert r["env"] == dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    assert len({r["pid"] for r in results}) == world_size and os.getpid() not in {r["pid"] for r in results}
    assert dist_pool(world_size).run(_all_reduce) == [world_size * (world_size + 1) / 2] * world_size
    assert [r["pid"] for r in dist_pool(world_size).run(_whoami, 0, y=0)] == [r["pid"] for r in results]  # reused


def test_failure_reports_traceback_and_pool_recovers(dist_pool):
    with pytest.raises(RuntimeError) as info:
        dist_pool(2).run(_fail_on_rank1)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "ValueError: deliberate failure on rank 1" in msg and "_fail_on_rank1" in msg
    assert "rank 0: no answer" in msg
    assert [r["rank"] for r in dist_pool(2).run(_whoami, 1, y=2)] == [0, 1]


def test_dead_worker_and_timeout_recover(dist_pool):
    pool = dist_pool(2)
    with pytest.raises(RuntimeError, match=r"rank 0 raised:\nworker died \(exitcode 3\)"):
        pool.run(_die_on_rank0)
    assert pool.run(_all_reduce) == [3.0, 3.0]
    old, pool.timeout = pool.timeout, 1.0
    try:
        with pytest.raises(RuntimeError, match="rank 0: no answer.*\n.*rank 1: no answer"):
            pool.run(_hang)
    finally:
        pool.timeout = old
    assert pool.run(_all_reduce) == [3.0, 3.0]


def test_state_reset_between_runs(dist_pool):
    pool = dist_pool(2)
    pool.run(_pollute_state)
    assert pool.run(_read_state) == [(torch.float32, None, 1)] * 2


def test_destroyed_process_group_is_recreated(dist_pool):
    pool = dist_pool(2)
    pids = [r["pid"] for r in pool.run(_whoami, 0, y=0)]
    pool.run(_destroy_pg)
    assert pool.run(_all_reduce) == [3.0, 3.0]
    assert [r["pid"] for r in pool.run(_whoami, 0, y=0)] == pids  # recreated in place, no restart


def test_rejects_non_importable_functions(dist_pool):
    def local_fn():
        pass

    with pytest.raises(ValueError, match="module-level"):
        dist_pool(2).run(local_fn)


def test_lightning_trainer_in_pool(dist_pool):
    pool = dist_pool(2)
    first = pool.run(_train_ddp)
    second = pool.run(_train_ddp)  # Trainer teardown must leave our process group usable
    for results in (first, second):
        assert [(r["global_rank"], r["world_size"], r["external"], r["pg_alive"], r["steps"]) for r in results] == [
            (0, 2, True, True, 2), (1, 2, True, True, 2)]
        for a, b in zip(results[0]["weights"], results[1]["weights"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]
    for a, b in zip(first[0]["weights"], second[0]["weights"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same seeds -> same result: no leaked state


@pytest.mark.gpu
def test_gpu_marker_skips_without_cuda():
    assert torch.cuda.is_available()  # only runs when conftest did not skip it
