"""Stage 3's frozen parameters (``zero/frozen.py``): sharded with their block's unit, 1/N of the bytes at rest
on each rank, step by step the training DDP does, the base bitwise untouched, in every storage dtype."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from lightning_zeroq import gathered_parameters
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.zero.engine import ZeroEngine
from tests.models import VOCAB, FrozenTowerModel, LoraModel, frozen_bytes_at_rest, make_batch

pytestmark = pytest.mark.launch

OFFLOAD = {
    "none": {},
    # A frozen block with nothing to train, the embedding and the head in parts of their own (threshold 500).
    "own_parts": {"stage3_param_persistence_threshold": 500},
    "own_parts_offload": {"stage3_param_persistence_threshold": 500, "offload_optimizer": True,
                          "offload_parameters": True, "reshard_after_forward": False},
    "params_optimizer_cpu": {"offload_optimizer": True, "offload_parameters": True},
    # Hybrid sharding: frozen parts sharded inside groups of 2, the broadcast over all ranks (4 ranks below).
    "hybrid": {"shard_group_size": 2},
    "optimizer_cpu_async": {"offload_optimizer": True, "offload_parameters": True, "offload_async_step": True},
}
STEPS = [2, 1, 3]


def _block_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters() if not p.requires_grad)


def _ddp_loss(ddp: DistributedDataParallel, batch) -> torch.Tensor:
    tokens, targets, _ = batch
    return torch.nn.functional.cross_entropy(ddp(tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))


class CalledLoraModel(LoraModel):
    """Its blocks called otherwise than ``block(h)``: by keyword (``block(h=h)``, as Hugging Face's layers may be
    given ``hidden_states=...``), or under activation checkpointing, reentrant (Hugging Face's layers with
    ``use_reentrant=True``: the recomputation's backward is a nested one) or not, with the
    embedding's output made to require a gradient as ``enable_input_require_grads`` does. The frozen part must
    stay gathered until no node of the backward reads it."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call = call

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            if self.call == "keyword":
                h = block(h=h)
            else:
                h = checkpoint(block, h.requires_grad_() if block is self.blocks[0] else h,
                               use_reentrant=self.call == "reentrant")
        return self.head(h)


def _device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _to(batch, dev: torch.device):
    tokens, targets, flag = batch
    return tokens.to(dev), targets.to(dev), flag


def _parity(offload: str, managed: bool, clip: float, device: str = "cpu", call: str = "positional") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = _device(device)
    torch.manual_seed(7 + rank)  # different per rank: the engine starts from rank 0's, as DDP does
    model = (FrozenTowerModel() if offload.startswith("own_parts") else
             LoraModel() if call == "positional" else CalledLoraModel(call)).to(dev)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref, device_ids=[dev.index] if dev.type == "cuda" else None)
    base_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    # DDP broadcasts rank 0's module at construction: the base every rank starts from.
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    engine = ZeroEngine(model, ZeroConfig(stage=3, managed_gradient_accumulation=managed, **OFFLOAD[offload]))
    engine.attach_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3))
    frozen = engine.parts.frozen
    own = offload.startswith("own_parts")  # the tower block, the embedding and the head: parts of their own
    assert frozen is not None and len(frozen.units) == len(model.blocks) + (2 if own else 0)
    assert sum(u.index not in frozen.owner for u in frozen.units) == (3 if own else 0)
    held, whole = frozen_bytes_at_rest(model, engine)
    root = whole - _block_bytes(model)  # the embedding and head: no unit to ride with, whole on every rank
    if own:  # all but the final norm and the biases below the threshold: sharded
        root = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if not p.requires_grad and p.numel() <= 500 and not n.startswith("blocks"))
    on_device = engine.memory_report()["frozen_shards"]
    if "offload_parameters" in OFFLOAD[offload] and dev.type == "cuda":  # every stored shard pinned on the host
        assert on_device == 0 and all(u.master.is_pinned() for u in frozen.units), on_device
    worst = 0.0
    for step, n in enumerate(STEPS):
        for micro in range(n):
            batch = _to(make_batch(step, micro, rank), dev)
            last = micro == n - 1
            engine.backward(model.loss(batch) / n, boundary=last if managed else None)
            if last:
                (_ddp_loss(ddp, batch) / n).backward()  # DDP's hooks reduce in this backward
            else:
                with ddp.no_sync():
                    (_ddp_loss(ddp, batch) / n).backward()
        if clip:
            engine.clip_grad_norm_(clip)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            diff = (full[name] - p.detach().cpu()).abs().max().item()
            worst = max(worst, diff)
            assert diff < 1e-6, f"step {step}: {name} differs from DDP by {diff}"
    for name, before in base_before.items():
        assert torch.equal(full[name], before.cpu()), f"the frozen {name} changed"
    if "offload_parameters" in OFFLOAD[offload] and dev.type == "cuda":  # and none came back to rest there
        assert engine.memory_report()["frozen_shards"] == 0
        assert all(u.flat.untyped_storage().nbytes() == 0 for u in frozen.units)
    return {"worst": worst, "held": held, "whole": whole, "root": root, "world": world, "on_device": on_device}


@pytest.mark.parametrize("world_size", [1, 2, 3])  # 1: the parts stay gathered (``FrozenCodec.resident``)
@pytest.mark.parametrize("offload", [o for o in OFFLOAD if o != "hybrid"])
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_lora_matches_ddp_and_holds_its_share_of_the_base(dist_pool, world_size, offload, managed) -> None:
    if world_size == 1 and not managed:
        pytest.skip("one rank: the managed runs cover it")
    for r in dist_pool(world_size).run(_parity, offload, managed, 0.5):
        blocks = r["whole"] - r["root"]
        share = r["held"] - r["root"]
        # Each rank's shard of each block's frozen part: 1/N of it, padded to whole ALIGN groups.
        assert blocks / world_size <= share <= blocks / world_size + 3 * 64 * 4 * world_size, r
        assert r["worst"] < 1e-6, r


EXACT = 128
"""``quantized_weights_exact_numel`` in the INT8 storage test: biases and norms stay exact (fp32), weights not."""


@pytest.mark.parametrize("call, world_size, offload", [
    ("keyword", 2, "none"), ("keyword", 3, "optimizer_cpu_async"), ("reentrant", 2, "none"),
    ("reentrant", 3, "params_optimizer_cpu"), ("nonreentrant", 3, "none")])
def test_blocks_called_otherwise_match_ddp(dist_pool, call, world_size, offload) -> None:
    for r in dist_pool(world_size).run(_parity, offload, True, 0.5, call=call):
        assert r["worst"] < 1e-6, r


def test_hybrid_groups_shard_the_base_inside_each_group(dist_pool) -> None:
    for r in dist_pool(4).run(_parity, "hybrid", True, 0.5):
        blocks = r["whole"] - r["root"]
        assert blocks / 2 <= r["held"] - r["root"] <= blocks / 2 + 3 * 64 * 4 * 2, r  # a half per rank, not a quarter
        assert r["worst"] < 1e-6, r


def _memory(world_size_expected: int, storage) -> dict:
    torch.manual_seed(0)
    model = LoraModel(dim=64, blocks=4)
    engine = ZeroEngine(model, ZeroConfig(stage=3, frozen_dtype=storage, quantized_weights_exact_numel=EXACT))
    held, whole = frozen_bytes_at_rest(model, engine)
    root = whole - _block_bytes(model)
    exact = sum(p.numel() for b in model.blocks for p in b.parameters() if not p.requires_grad and p.numel() <= EXACT)
    return {"share": held - root, "blocks": whole - root, "stored": engine.parts.frozen.stored_bytes, "exact": exact}


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_bytes_at_rest_are_one_nth(dist_pool, world_size) -> None:
    for r in dist_pool(world_size).run(_memory, world_size, None):
        assert r["share"] == r["stored"], r  # nothing but the stored shards holds a block's base
        assert r["blocks"] / world_size <= r["share"] <= r["blocks"] / world_size * 1.02, r


@pytest.mark.parametrize("storage, per_element", [("bf16", 2), ("int8", 1 + 4 / 64)])
def test_smaller_storage_holds_fewer_bytes(dist_pool, storage, per_element) -> None:
    for r in dist_pool(2).run(_memory, 2, storage):
        numel = r["blocks"] / 4  # fp32 base
        exact = r["exact"] * 4 if storage == "int8" else 0  # INT8: small tensors also travel exactly, in fp32
        assert r["share"] == r["stored"], r
        assert numel / 2 * per_element <= r["stored"] <= (numel * per_element + exact) / 2 * 1.02, r


def _storage_numerics(storage: str, device: str = "cpu") -> float:
    """The module a frozen part gathers under ``storage``: within the dtype's rounding of the fp32 base."""
    torch.manual_seed(3)
    model = LoraModel().to(_device(device))
    exact = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = ZeroEngine(model, ZeroConfig(stage=3, frozen_dtype=storage, quantized_weights_exact_numel=EXACT))
    worst = 0.0
    with gathered_parameters(model):
        for name, p in model.named_parameters():
            if name in exact and name.startswith("blocks"):
                ref = exact[name]
                p = p.detach()
                if storage == "bf16" or ref.numel() <= EXACT:  # rounded once to bf16; INT8's small ones exact
                    assert torch.equal(p, ref.to(torch.bfloat16).float() if storage == "bf16" else ref), name
                worst = max(worst, ((p - ref).abs().max() / ref.abs().max()).item())
                assert p.dtype == torch.float32
    return worst


@pytest.mark.parametrize("storage, bound", [("bf16", 2 ** -8), ("int8", 1 / 127)])
def test_frozen_storage_rounds_as_documented(dist_pool, storage, bound) -> None:
    for worst in dist_pool(2).run(_storage_numerics, storage):
        assert 0 < worst <= bound, worst


def test_frozen_dtype_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"frozen_dtype='int4'.*one of"):
        ZeroConfig(stage=3, frozen_dtype="int4")


PLANNED = {"none": {}, "int8": {"frozen_dtype": "int8", "quantized_weights_exact_numel": EXACT},
           "offload": {"offload_parameters": True, "offload_optimizer": True}}


def _planned_and_held(name: str) -> tuple[dict, dict, dict, dict]:
    """The plan of a LoRA model (built on meta) beside what the engine holds and counts for it."""
    from lightning_zeroq.planning.estimate import estimate_config, trace_activations

    config = ZeroConfig(stage=3, **PLANNED[name])
    with torch.device("meta"):
        meta = LoraModel(dim=64, blocks=4)
    tokens = torch.zeros(2, 6, dtype=torch.long, device="meta")
    activations = trace_activations(meta, lambda m: m(tokens).float().sum(), list(meta.blocks))
    need = estimate_config(meta, config, activations, name=name, world_size=dist.get_world_size(), rank=dist.get_rank(),
                           param_dtype=torch.float32)
    torch.manual_seed(0)
    model = LoraModel(dim=64, blocks=4)
    engine = ZeroEngine(model, config)
    held = engine.memory_report()
    held["gathered_units"] = 2 * held.pop("largest_transient_unit")
    kinds = ("frozen_shards", "frozen_whole", "gathered_units")
    return ({k: need.device[k] for k in kinds}, {k: held[k] for k in kinds}, dict(need.host),
            dict(engine.parts.host_memory.need.parts))


@pytest.mark.parametrize("name", list(PLANNED))
def test_the_plan_counts_the_frozen_parts_as_the_engine_holds_them(dist_pool, name) -> None:
    for planned, held, planned_host, counted in dist_pool(2).run(_planned_and_held, name):
        if name == "offload":  # on the CPU the "host" is the device: compare what the engine counts for the host
            assert planned_host["frozen shards"] == counted["frozen shards"] > 0, (planned_host, counted)
            assert planned["frozen_shards"] == 0
        else:
            assert planned == held, (planned, held)
            assert held["frozen_shards"] > 0 and held["frozen_whole"] > 0


def _after_release(storage) -> None:
    """A module handed back (``release_module``, the Trainer's teardown) keeps its frozen base as plain tensors, and
    the fit's engine still reads it (``full_state_dict``) and loads into it, as it does the trainable parameters."""
    torch.manual_seed(5)
    model = LoraModel()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = ZeroEngine(model, ZeroConfig(stage=3, frozen_dtype=storage, quantized_weights_exact_numel=EXACT))
    engine.attach_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    engine.backward(model.loss(make_batch(0, 0, dist.get_rank())))
    engine.step()
    during = engine.full_state_dict()
    engine.release_module()
    held = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    for name, p in held.items():
        assert type(p) is torch.nn.Parameter, (name, type(p))
        assert torch.equal(p, during[name]), f"the module handed back holds another {name}"
        if storage is None:
            assert torch.equal(p, base[name]), name
    after = engine.full_state_dict()
    assert after.keys() == during.keys()
    for name, value in during.items():
        assert torch.equal(after[name], value), f"full_state_dict after release_module: {name} differs"
    for name, p in held.items():  # reading the engine left the module's frozen parameters alone
        assert type(p) is torch.nn.Parameter and torch.equal(p, during[name]), name
    # A checkpoint loaded after fit (``trainer.test(ckpt_path=...)``) goes into the engine and the module alike.
    parts = {id(p) for part in engine.parts.frozen.units for p in part.params}
    sharded = {n: p for n, p in held.items() if id(p) in parts}  # the blocks' (the engine's to load)
    assert sharded and all(n.startswith("blocks.") for n in sharded), sorted(sharded)
    other = {n: v + 1 / 64 if n in sharded else v for n, v in during.items()}  # exact in bf16; INT8 rounds it
    engine.load_full_state_dict(other)
    loaded = engine.full_state_dict()
    for name, p in sharded.items():
        assert type(p) is torch.nn.Parameter and torch.equal(p, loaded[name]), f"the module did not take {name}"
        if storage is None:
            assert torch.equal(p, other[name]), name


@pytest.mark.parametrize("storage", [None, "bf16", "int8"])
def test_frozen_parts_after_release_module(dist_pool, storage) -> None:
    dist_pool(2).run(_after_release, storage)
