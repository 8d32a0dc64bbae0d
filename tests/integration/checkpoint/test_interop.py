"""FSDP2 <-> ZeroQ through the checkpoint format, on CPU with gloo (FSDP2 on a CPU device mesh).

FSDP2 writes ``{"state_dict": ..., "optimizer_0": ...}`` from ``get_state_dict`` with stock
``dcp.save`` (Lightning's ``ModelParallelStrategy`` layout) at 2 ranks; ZeroQ resumes it at 3 ranks
in stage 3. ZeroQ writes at 3 ranks in stage 2; FSDP2 resumes it at 2 ranks with stock ``dcp.load`` +
``set_state_dict``. Each continuation matches an uninterrupted DDP run after every step (1e-5), and
the optimizer state at the end.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tests.models import SEQ, VOCAB, RichModel, param_groups

GLOBAL, STEPS, SPLIT = 6, 6, 3
TOL = 1e-5


def _loss(model, step: int) -> torch.Tensor:
    """Step ``step``'s global batch of 6 sequences, this rank's share (the same math at any world size)."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    logits = model(tokens[rows], step % 3 == 0)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets[rows].reshape(-1))


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = RichModel()
    return model, torch.optim.AdamW(param_groups(model), lr=1e-2)


def _ddp_reference() -> list[dict]:
    model, _ = _fresh()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    snaps = []
    for step in range(STEPS):
        _loss(ddp, step).backward()
        opt.step()
        opt.zero_grad()
        names = {id(p): n for n, p in model.named_parameters()}
        snaps.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "optimizer": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}})
    return snaps


def _fsdp(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_params(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _fsdp_optimizer(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {name: {k: v.clone() for k, v in s.items()} for name, s in full["state"].items()}


def _fsdp_save(path: str) -> list[dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, _ = _fresh()
    _fsdp(model)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    snaps = []
    for step in range(SPLIT):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        snaps.append({"params": _fsdp_params(model)})
    msd, osd = get_state_dict(model, opt)
    dcp.save({"state_dict": msd, "optimizer_0": osd}, checkpoint_id=path)
    return snaps


def _zeroq_engine(stage_options: dict):
    from lightning_zeroq import ZeroConfig, ZeroEngine

    model, _ = _fresh()
    engine = ZeroEngine(model, ZeroConfig(**stage_options))
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    return engine


def _zeroq_snapshot(engine) -> dict:

    names = {n for n, _ in engine.parts.module.named_parameters()}
    return {"params": {k: v for k, v in engine.full_state_dict().items() if k in names},
            "optimizer": engine.full_optimizer_state()}


def _zeroq_resume(path: str) -> list[dict]:
    from lightning_zeroq.checkpoint.engine_io import load_engine

    engine = _zeroq_engine({"stage": 3, "stage3_wrap_classes": ["Sequential"], "stage3_param_persistence_threshold": 20})
    assert load_engine(engine, path) == {}  # a plain DCP checkpoint: no trainer state
    snaps = []
    for step in range(SPLIT, STEPS):
        engine.backward(_loss(engine.parts.module, step))
        engine.step()
        snaps.append(_zeroq_snapshot(engine))
    return snaps


def _zeroq_save(path: str) -> list[dict]:
    from lightning_zeroq.checkpoint.engine_io import save_engine

    engine = _zeroq_engine({"stage": 2, "reduce_bucket_size": 300})
    snaps = []
    for step in range(SPLIT):
        engine.backward(_loss(engine.parts.module, step))
        engine.step()
        snaps.append(_zeroq_snapshot(engine))
    save_engine(engine, path)
    return snaps


def _fsdp_resume(path: str) -> list[dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, _ = _fresh()
    torch.nn.init.zeros_(model.embed.weight)  # must come from the checkpoint
    _fsdp(model)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    # FSDP2 creates state for every parameter (also the never-used layer, which the checkpoint rightly
    # lacks), so its stock load needs allow_partial_load, ZeroQ or not.
    dcp.load({"state_dict": msd, "optimizer_0": osd}, checkpoint_id=path,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    snaps = []
    for step in range(SPLIT, STEPS):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        snaps.append({"params": _fsdp_params(model), "optimizer": _fsdp_optimizer(model, opt)})
    return snaps


def _compare(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref)
    for step, (snap, want) in enumerate(zip(got, ref)):
        for name, value in want["params"].items():
            diff = (snap["params"][name] - value).abs().max().item()
            assert diff <= TOL, f"step {step}: {name} differs from DDP by {diff}"
        for name, state in want.get("optimizer", {}).items() if "optimizer" in snap else ():
            for key, value in state.items():
                diff = (torch.as_tensor(snap["optimizer"][name][key]).float() - value.float()).abs().max().item()
                assert diff <= TOL, f"step {step}: optimizer {name}.{key} differs from DDP by {diff}"


def _save_then_resume(dist_pool, save, save_ranks: int, resume, resume_ranks: int) -> None:
    """Train and save with ``save`` on ``save_ranks``, resume with ``resume`` on ``resume_ranks``; both
    halves follow an uninterrupted DDP run step by step."""
    reference = dist_pool(2).run(_ddp_reference)[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint")
        before = dist_pool(save_ranks).run(save, path)[0]
        after = dist_pool(resume_ranks).run(resume, path)[0]
    _compare(before, reference[:SPLIT])
    _compare(after, reference[SPLIT:])


def test_fsdp2_checkpoint_resumes_in_zeroq_stage3_at_another_world_size(dist_pool):
    _save_then_resume(dist_pool, _fsdp_save, 2, _zeroq_resume, 3)


def test_zeroq_checkpoint_resumes_in_fsdp2_at_another_world_size(dist_pool):
    _save_then_resume(dist_pool, _zeroq_save, 3, _fsdp_resume, 2)
