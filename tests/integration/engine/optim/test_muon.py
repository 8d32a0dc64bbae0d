"""Muon (``torch.optim.Muon``) for the hidden matrices and AdamW for the rest, the standard recipe, in
stages 1-3, with and without CPU optimizer offload, against DDP with the same two optimizers: gloo, 2 and
3 ranks (3: uneven cuts), 20 steps of two backward passes each, each optimizer's gradients clipped,
every weight within 1e-5 of DDP's after every step (``optim/matrix.py``).

torch's Newton-Schulz iterations run in bf16, so a last-bit difference in a gradient (any other order
of summing it: ZeRO-2's sum of reduced micro-batches, a division before or after the sum) becomes
~1e-4 of update. The parity runs therefore orthogonalize in fp32 (the same iteration, in both the
engine and the reference), which tests the sharding, the gathering and the stepping; and where the
gradients are bitwise DDP's (stage 1, 2 ranks) torch's own bf16 iteration gives bitwise DDP's weights."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.optim.matrix import _TORCH_ITERATION

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")

VOCAB, DIM, SEQ = 48, 24, 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM, bias=False), nn.GELU(),
                                                  nn.Linear(2 * DIM, DIM, bias=False)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon for the blocks' matrices; AdamW for the embedding, the norms and the head."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
    return hidden, rest


def _optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    hidden, rest = _split(model)
    return (torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, eps=1e-3))


def _loss(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


CONFIGS = {
    1: {"stage": 1, "reduce_bucket_size": 700},
    2: {"stage": 2, "reduce_bucket_size": 700},
    3: {"stage": 3, "stage3_wrap_classes": ["Sequential"], "stage3_param_persistence_threshold": 0},
}


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon's paper, in fp32."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def backward_both(engine: ZeroEngine, model: nn.Module, ddp: DistributedDataParallel, loss, step: int) -> None:
    """One window of two backward passes, each halved, in the engine and in DDP (its first without sync);
    ``loss(model, step, micro)``."""
    for micro in range(2):
        engine.backward(loss(model, step, micro) / 2, boundary=micro == 1)
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            (loss(ddp, step, micro) / 2).backward()


def _body(stage: int, offload: bool, exact_bf16: bool = False) -> float:
    import torch.optim._muon as muon_module

    real = muon_module._zeropower_via_newtonschulz
    if not exact_bf16:
        muon_module._zeropower_via_newtonschulz = _newton_schulz_fp32  # the engine's and DDP's optimizer alike
    try:
        return _train(stage, offload, tolerance=0.0 if exact_bf16 else 1e-5)
    finally:
        muon_module._zeropower_via_newtonschulz = real


def _train(stage: int, offload: bool, tolerance: float) -> float:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    engine = ZeroEngine(model, ZeroConfig(**CONFIGS[stage], offload_optimizer=offload))
    muon, adam = _optimizers(model)
    engine.attach_optimizer(muon)
    engine.attach_optimizer(adam)
    ddp = DistributedDataParallel(ref)
    ref_muon, ref_adam = _optimizers(ref)
    worst = 0.0
    for step in range(20):
        backward_both(engine, model, ddp, _loss, step)
        for ours, theirs, bound in ((muon, ref_muon, 0.5), (adam, ref_adam, 1.0)):
            norm = engine.clip_grad_norm_(bound, optimizer=ours)
            ref_norm = torch.nn.utils.clip_grad_norm_([p for g in theirs.param_groups for p in g["params"]], bound)
            assert abs(float(norm) - float(ref_norm)) <= 1e-5 * max(1.0, float(ref_norm)), (step, norm, ref_norm)
            engine.step(ours)
            theirs.step()
        engine.zero_grad(muon)
        engine.zero_grad(adam)
        ref_muon.zero_grad()
        ref_adam.zero_grad()
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            diff = (full[name] - p.detach()).abs().max().item()
            assert diff <= tolerance, f"step {step}: {name} differs from DDP by {diff}"
            worst = max(worst, diff)
    engine.close()
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload"])
def test_muon_with_adamw_matches_ddp(dist_pool, world_size, stage, offload):
    dist_pool(world_size).run(_body, stage, offload)


def test_muon_in_stage_1_is_bitwise_ddp_with_torchs_own_iteration(dist_pool):
    """2 ranks, stage 1: the gradients are DDP's bit for bit, so are the weights, bf16 iteration and all."""
    dist_pool(2).run(_body, 1, False, True)


class Matrices(nn.Module):
    """Only bias-free linear layers: one Muon optimizer takes every parameter (a checkpoint holds one)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Tanh(), nn.Linear(2 * DIM, DIM, bias=False),
                                    nn.Tanh(), nn.Linear(DIM, DIM, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _matrices_engine(stage: int, seed: int, offload: bool = False) -> tuple[nn.Module, ZeroEngine]:
    torch.manual_seed(seed)
    model = Matrices()
    config = {**CONFIGS[stage], "stage3_wrap_classes": ["Linear"]} if stage == 3 else CONFIGS[stage]
    engine = ZeroEngine(model, ZeroConfig(**config, offload_optimizer=offload))
    engine.attach_optimizer(torch.optim.Muon(model.parameters(), lr=0.02, momentum=0.9, weight_decay=0.05))
    return model, engine


def _matrices_steps(model: nn.Module, engine: ZeroEngine, steps) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)  # the same batch on every rank and world size
        x = torch.randn(8, DIM, generator=g)
        engine.backward(model(x).pow(2).mean(), boundary=True)
        engine.step()
        engine.zero_grad()


def _save_body(path: str, offload: bool = False) -> None:
    from lightning_zeroq.checkpoint.engine_io import save_engine

    model, engine = _matrices_engine(2, seed=0, offload=offload)
    _matrices_steps(model, engine, range(3))
    save_engine(engine, Path(path))
    optimizer = engine.full_optimizer_state()  # collective
    if dist.get_rank() == 0:
        torch.save(optimizer, Path(path).parent / "optimizer_at_save.pt")
    _matrices_steps(model, engine, range(3, 6))  # where the run goes on from the checkpoint
    torch.save(engine.full_state_dict(), Path(path) / f"after_rank{dist.get_rank()}.pt")
    engine.close()


def _load_body(path: str, offload: bool = False) -> float:
    from lightning_zeroq.checkpoint.engine_io import load_engine

    model, engine = _matrices_engine(3, seed=1, offload=offload)
    load_engine(engine, Path(path))
    _matrices_steps(model, engine, range(3, 6))
    expected = torch.load(Path(path) / "after_rank0.pt")
    got = engine.full_state_dict()
    engine.close()
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.parametrize("saved_offloaded,loaded_offloaded", [(False, False), (True, False), (False, True)],
                         ids=["device", "saved-from-the-host", "loaded-to-the-host"])
def test_muon_state_saves_and_resumes_at_another_world_size_and_stage(dist_pool, tmp_path, saved_offloaded,
                                                                       loaded_offloaded):
    """Saved by stage 2 on 2 ranks, loaded by stage 3 on 3, the optimizer on the device or the host on
    either side: the momentum buffers reshard with the weights, and 3 more steps match the run that went
    on (fp32 iteration: the world sizes sum alike)."""
    import torch.optim._muon as muon_module

    for pool, body, offload in ((dist_pool(2), _save_body, saved_offloaded),
                                (dist_pool(3), _load_body, loaded_offloaded)):
        worst = pool.run(_patched, body, str(tmp_path / "ckpt"), offload)
    assert max(worst) <= 1e-6, worst
    assert muon_module._zeropower_via_newtonschulz is not _newton_schulz_fp32


def test_zeroq_convert_keeps_muons_momentum(dist_pool, tmp_path):
    """``zeroq-convert --optimizer`` of a checkpoint with Muon's state: every matrix's momentum buffer,
    whole, bitwise what the engine's full optimizer state holds."""
    from lightning_zeroq.cli.convert import main

    dist_pool(2).run(_patched, _save_body, str(tmp_path / "ckpt"))
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "full.ckpt"), "--optimizer"]) == 0
    converted = torch.load(tmp_path / "full.ckpt", weights_only=True)["optimizer_states"][0]
    expected = torch.load(tmp_path / "optimizer_at_save.pt", weights_only=True)
    names = [name for name, _ in Matrices().named_parameters()]  # the optimizer's parameter order
    assert len(converted["state"]) == len(expected) == len(names) == 3
    for index, name in enumerate(names):
        buf = converted["state"][index]["momentum_buffer"]
        assert buf.dim() == 2 and torch.equal(buf, expected[name]["momentum_buffer"]), name
    assert converted["param_groups"][0]["ns_steps"] == 5 and converted["param_groups"][0]["momentum"] == 0.9


def _patched(body, *args):
    import torch.optim._muon as muon_module

    real = muon_module._zeropower_via_newtonschulz
    muon_module._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        return body(*args)
    finally:
        muon_module._zeropower_via_newtonschulz = real


def test_torchs_iteration_reads_and_returns_bfloat16() -> None:
    """Why Muon's blended updates travel in bf16 (``MuonRule.wire``): torch's iteration rounds its input
    to bf16 first and returns bf16, so rounding before the journey gives the same bits."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from lightning_zeroq.zero.optim.matrix import _MUON

    matrix = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    for shape in ((24, 40), (40, 24)):
        x = matrix.reshape(shape)
        direct = _zeropower_via_newtonschulz(x, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert direct.dtype == torch.bfloat16
        assert torch.equal(direct, _zeropower_via_newtonschulz(x.bfloat16(), (3.4445, -4.775, 2.0315), 5, 1e-7))
    assert _MUON.wire() == torch.bfloat16


def _offload_pair(stage: int, param_dtype: torch.dtype, extra: Optional[dict] = None, clip: bool = True,
                  micro_batches: int = 2, adamw_first: bool = False) -> int:
    """The same run with the optimizer on the device and on the host (the host kernel's Muon parts,
    bf16 journeys), torch's own bf16 iteration, each optimizer's gradients clipped: bitwise alike.
    ``adamw_first``: AdamW steps (and clips) before Muon. Returns the last step, and with ``clip`` off
    checks that no host gradient was widened to fp32 (each optimizer's kernel read its share as it landed)."""
    torch.manual_seed(0)
    model = Net().to(param_dtype)
    other = copy.deepcopy(model)
    engines, optimizers = [], []
    for net, offload in ((model, False), (other, True)):
        options = dict(offload_optimizer=True, **(extra or {})) if offload else {}
        engine = ZeroEngine(net, ZeroConfig(**CONFIGS[stage], **options), param_dtype=param_dtype)
        hidden, rest = _split(net)  # AdamW fused in both: the host steps torch's fused CPU kernel
        pair = (torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.1),
                torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01, eps=1e-3, fused=True))
        for optimizer in pair:
            engine.attach_optimizer(optimizer)
        engines.append(engine)
        optimizers.append(pair)
    widened, published = [], []
    landing = getattr(engines[1].parts.placement, "landing", None)  # the host placement's (a split's: None)
    if landing is not None:
        fp32 = landing.fp32
        landing.fp32 = lambda unit: (widened.append(unit.index), fp32(unit))[1]
    kernel = getattr(engines[1].parts.placement, "kernel", None)
    if kernel is not None:  # a publish of what one optimizer stepped: from the copy its kernel wrote, or the master
        take = kernel.take_fresh_copy
        kernel.take_fresh_copy = lambda unit, span: (lambda copy: (published.append(copy is not None), copy)[1])(
            take(unit, span))
    order = (1, 0) if adamw_first else (0, 1)
    for step in range(6):
        for engine, net, pair in zip(engines, (model, other), optimizers):
            for micro in range(micro_batches):
                engine.backward(_loss(net, step, micro) / micro_batches, boundary=micro == micro_batches - 1)
            for optimizer, bound in ((pair[i], (0.05, 1.0)[i]) for i in order):
                if clip:
                    engine.clip_grad_norm_(bound, optimizer=optimizer)
                engine.step(optimizer)
                engine.zero_grad(optimizer)
        on_device, on_host = (engine.full_state_dict() for engine in engines)
        for name in on_device:
            assert torch.equal(on_device[name], on_host[name]), f"step {step}: {name} differs"
    if landing is not None and not clip and micro_batches == 1 and param_dtype == torch.bfloat16 and stage > 1:
        assert widened == [], f"units widened on the host: {sorted(set(widened))}"
    if kernel is not None and kernel.kernel.muon and param_dtype == torch.bfloat16 and stage == 2:
        assert published and all(published), published.count(False)  # never the fp32 master across
    for engine in engines:
        engine.close()
    return step


@pytest.mark.parametrize("stage,param_dtype,extra", [
    (1, torch.float32, None),
    (2, torch.bfloat16, None),
    (3, torch.bfloat16, None),
    (3, torch.bfloat16, {"offload_parameters": True}),
    (2, torch.float32, {"offload_optimizer_ratio": 0.5}),
    (2, torch.bfloat16, {"offload_async_step": True}),
    (2, torch.bfloat16, {"offload_speculative_step": True}),
], ids=["stage1", "stage2-bf16", "stage3-bf16", "stage3-parameters", "half-offloaded", "async", "speculative"])
def test_muon_offloaded_is_bitwise_the_device_path(dist_pool, stage, param_dtype, extra):
    assert dist_pool(2).run(_offload_pair, stage, param_dtype, extra) == [5, 5]


@pytest.mark.parametrize("stage,extra", [
    (1, None),
    (2, None),
    (3, None),
    (3, {"offload_parameters": True}),
    (2, {"offload_optimizer_ratio": 0.5}),
    (2, {"offload_async_step": True}),
    (2, {"offload_speculative_step": True}),
], ids=["stage1", "stage2", "stage3", "stage3-parameters", "half-offloaded", "async", "speculative"])
@pytest.mark.parametrize("clip", [False, True])
def test_muon_offloaded_reads_the_bf16_gradients_as_they_landed(dist_pool, stage, extra, clip):
    """One backward per step (or stage 1's local sum): each unit's gradient crosses to the host in bf16 and
    stays so until a reader widens it. Muon reads its part of a unit as it landed, and AdamW, stepping the
    rest of the same unit afterwards, still reads all of it; clipping reads it first."""
    assert dist_pool(2).run(_offload_pair, stage, torch.bfloat16, extra, clip, 1) == [5, 5]


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_adamw_stepping_first_leaves_the_shared_units_gradient_for_muon(dist_pool, stage, clip):
    """AdamW steps its share of each block's unit (the norms) with the host kernel before Muon steps the
    matrices: the unit's gradient stays as it landed, and what it owes stays owed, for Muon."""
    assert dist_pool(2).run(_offload_pair, stage, torch.bfloat16, None, clip, 1, True) == [5, 5]


def test_muon_offloaded_is_bitwise_the_device_path_at_three_ranks(dist_pool):
    """3 ranks: uneven segments, and owners that are not the segments' ranks."""
    assert dist_pool(3).run(_offload_pair, 2, torch.bfloat16) == [5, 5, 5]


def _matrices_pair(stage: int, device: str = "cpu") -> int:
    """A model of matrices only, one Muon over all of it, bf16 weights, one backward per step, clipped: the
    host kernel reads each unit's bf16 gradient as it landed and applies the clipping as it reads (on
    ``"cuda"``: against the optimizer stepping on the GPU)."""
    import torch.optim._muon as muon_module

    assert muon_module._zeropower_via_newtonschulz is _TORCH_ITERATION
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = Matrices().to(device=device, dtype=torch.bfloat16)
        config = {**CONFIGS[stage], "stage3_wrap_classes": ["Linear"]} if stage == 3 else CONFIGS[stage]
        engine = ZeroEngine(model, ZeroConfig(**config, offload_optimizer=offload), param_dtype=torch.bfloat16)
        engine.attach_optimizer(torch.optim.Muon(model.parameters(), lr=0.02, momentum=0.9, weight_decay=0.05))
        for step in range(4):
            x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
            engine.backward(model(x.to(device, torch.bfloat16)).float().pow(2).mean(), boundary=True)
            engine.clip_grad_norm_(0.01)
            engine.step()
            engine.zero_grad()
        results.append({k: v.cpu() for k, v in engine.full_state_dict().items()})
        engine.close()
    on_device, on_host = results
    assert all(torch.equal(on_device[k], on_host[k]) for k in on_device)
    return len(on_device)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_alone_on_the_host_applies_the_clipping_as_it_reads(dist_pool, stage):
    assert dist_pool(2).run(_matrices_pair, stage) == [3, 3]
