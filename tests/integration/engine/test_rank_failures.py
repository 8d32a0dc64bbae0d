"""A failure on one rank (a bad path, a full disk, a failing collective) ends every rank with an error
instead of a hang or a silent switch to another path."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import RichModel, param_groups
from tests.integration.engine.test_accumulation import TRANSIENT


def _one_bad_path_body(tmp: str) -> str:
    import os

    rank = dist.get_rank()
    path = tmp if rank == 0 else os.path.join(tmp, "missing", "dir")  # only rank 1's path is wrong
    model = RichModel()
    try:
        ZeroEngine(model, ZeroConfig(stage=3, offload_parameters=True, offload_params_device="nvme", nvme_path=path,
                                     **TRANSIENT))
    except (RuntimeError, ValueError) as err:
        return str(err)
    return "no error"


def test_a_failure_on_one_rank_before_a_collective_ends_every_rank(dist_pool, tmp_path):
    # Before: rank 1 raised and rank 0 walked into the first broadcast and waited for the collective
    # timeout (30 minutes by default; the pool's is 60 s, after which rank 0 would raise gloo's timeout,
    # not the agreed message below). No wall-clock bound: the verdict must not depend on the machine's load.
    messages = dist_pool(2).run(_one_bad_path_body, str(tmp_path))
    assert "missing" in messages[1]  # rank 1: its own error, naming its path
    assert "rank(s) [1] failed while building the ZeRO engine" in messages[0] and "missing" in messages[0]


def _one_full_disk_body(tmp: str) -> str:
    from lightning_zeroq.swap import swapper

    original = swapper.free_bytes
    if dist.get_rank() == 1:
        swapper.free_bytes = lambda path: 1024  # rank 1's disk is "full"
    try:
        model = RichModel()
        engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_optimizer_device="nvme",
                                              nvme_path=tmp))
        engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    except RuntimeError as err:
        return str(err)
    finally:
        swapper.free_bytes = original
    return "no error"


def test_a_full_disk_on_one_rank_stops_every_rank_at_attach(dist_pool, tmp_path):
    messages = dist_pool(2).run(_one_full_disk_body, str(tmp_path))
    assert "rank(s) [1] failed while attaching the optimizer" in messages[0], messages
    assert "free" in messages[1].lower() or "space" in messages[1].lower(), messages[1]


def _timeout_body() -> str:
    """A collective that fails (here: a rank that never joins) must raise, not switch the engine to a
    fallback path for the rest of the run."""
    from datetime import timedelta

    from lightning_zeroq.zero import comm

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    out = torch.empty(4)
    if dist.get_rank() == 0:
        try:
            comm.reduce_scatter(out[:2], torch.ones(4), group)  # rank 1 never comes
        except RuntimeError as err:
            message = str(err)
        else:
            message = "no error"
    else:
        message = "skipped"
    dist.barrier()
    comm.reduce_scatter(out[:2], torch.ones(4), group=None)  # the flat collective is still used afterwards
    return message


def test_a_failing_collective_raises_instead_of_switching_paths(dist_pool):
    # Before: comm.reduce_scatter caught any gloo RuntimeError (a timeout, say) and silently switched
    # every later reduce-scatter to the all-reduce fallback.
    from lightning_zeroq.zero.comm import has_flat_collectives

    assert has_flat_collectives("nccl", (2, 4)) and has_flat_collectives("gloo", (2, 13))
    assert not has_flat_collectives("gloo", (2, 7))
    messages = dist_pool(2).run(_timeout_body)
    assert messages[1] == "skipped" and messages[0] != "no error", messages


def _agree_body() -> dict:
    """``ranks.agree`` on the default group (``None``) and ``LOCAL`` while a process group is up."""
    from lightning_zeroq.ranks import LOCAL, agree, exchange, rank_and_size

    rank = dist.get_rank()
    out: dict = {"size": rank_and_size(None), "local": (rank_and_size(LOCAL), exchange(rank, LOCAL))}
    out["payloads"] = agree([], None, RuntimeError, payload=rank)
    for quick in (False, True):
        own = OSError(f"rank {rank}: disk full") if rank == 1 else None
        try:
            agree([str(own)] if own else [], None, lambda errors: RuntimeError(f"failed: {errors}"), own=own,
                  quick=quick)
        except Exception as error:
            out[f"quick={quick}"] = f"{type(error).__name__}: {error}"
    return out


def test_ranks_agree_fails_every_rank_alike_and_local_is_this_process_alone(dist_pool):
    said = dist_pool(2).run(_agree_body)
    assert [s["size"] for s in said] == [(0, 2), (1, 2)]
    assert [s["local"] for s in said] == [((0, 1), [0]), ((0, 1), [1])]  # no collective: each its own
    assert [s["payloads"] for s in said] == [[0, 1], [0, 1]]
    for quick in (False, True):
        assert said[0][f"quick={quick}"] == "RuntimeError: failed: [[], ['rank 1: disk full']]", said
        assert said[1][f"quick={quick}"] == "OSError: rank 1: disk full", said
