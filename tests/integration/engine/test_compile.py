"""``torch.compile`` (inductor on CPU, gloo, 2 ranks) with every stage: the whole model and per block,
with gradient accumulation and clipping, against compiled DDP at 1e-5; stage 3 with units that are
really freed, with non-reentrant activation checkpointing, INT8 weights and offload; and Lightning's
own compiled-model test with ``strategy=ZeroQStrategy(stage=...)``.

Stage 3 runs its module hooks outside the graphs (as FSDP2 does): dynamo breaks the graph where a
unit's forward begins and ends, and traces the unit's forward with its parameters gathered."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.unit import FreedParameter, UnitState

D, STEPS, MICRO, CLIP = 16, 3, 2, 0.05
FREED = {"stage3_wrap_classes": ["Block"], "stage3_param_persistence_threshold": 0}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self, ac: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, D), nn.Linear(D, 4)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.ac else block(h)
        return self.head(h)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _compiled(model: nn.Module, mode: str):
    """What the forward calls: the whole model compiled, each block compiled in place, or (torchtitan's
    form) each block replaced by its compiled module, in one graph (``fullgraph``)."""
    if mode == "whole":
        return torch.compile(model)
    if mode == "block":
        for block in model.blocks:
            block.compile()
    if mode == "fullgraph":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    return model


def _train(forward, backward, clip, step) -> list[float]:
    losses = []
    for s in range(STEPS):
        for micro in range(MICRO):
            x, y = _batch(s, micro)
            loss = F.mse_loss(forward(x), y) / MICRO
            backward(loss, micro == MICRO - 1)
            losses.append(float(loss.detach()))
        clip()
        step()
    return losses


def _ddp_run(mode: str, ac: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net(ac)
    if mode != "whole":
        _compiled(model, mode)  # blocks compiled in place before DDP wraps the model
    ddp = DistributedDataParallel(model)
    forward = torch.compile(ddp) if mode == "whole" else ddp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        opt.step()
        opt.zero_grad()

    losses = _train(forward, lambda loss, last: loss.backward(),
                    lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), step)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zeroq_run(stage: int, mode: str, ac: bool, **config) -> tuple[list[float], dict[str, torch.Tensor], ZeroEngine]:
    torch.manual_seed(0)
    model = Net(ac)
    forward = _compiled(model, mode)
    # fullgraph: the units are the compiled modules (found as the repeated blocks), their hooks outside the graph.
    freed = {"stage3_param_persistence_threshold": 0} if mode == "fullgraph" else FREED
    engine = ZeroEngine(model, ZeroConfig(stage=stage, **(freed if stage == 3 else {}), **config))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = _train(forward, lambda loss, last: engine.backward(loss, boundary=last),
                    lambda: engine.clip_grad_norm_(CLIP), engine.step)
    return losses, engine.full_state_dict(), engine


def _assert_close(got, want, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=0, atol=atol)
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _parity_body(mode: str, ac: bool) -> list[int]:
    """Compiled DDP, then compiled stages 1, 2 and 3 (each compiling afresh); the graphs each compiled."""
    torch._dynamo.reset()
    before = _graphs()
    want = _ddp_run(mode, ac)
    graphs = [_graphs() - before]
    for stage in (1, 2, 3):
        torch._dynamo.reset()
        before = _graphs()
        *got, engine = _zeroq_run(stage, mode, ac)
        graphs.append(_graphs() - before)
        _assert_close(got, want, atol=1e-5)
        if stage == 3:  # the units were really freed between uses
            transient = [u for u in engine.parts.units if not u.persistent]
            assert len(transient) >= 2 and all(u.state is UnitState.SHARDED for u in transient)
            assert isinstance(engine.parts.module.blocks[0].a.weight, FreedParameter)
    return graphs


@pytest.mark.parametrize("mode", ["whole", "block", "fullgraph"])
def test_compiled_stages_match_compiled_ddp(dist_pool, mode):
    for graphs in dist_pool(2).run(_parity_body, mode, False):
        assert all(g > 0 for g in graphs), graphs  # every arm ran compiled code (not a silent fallback to eager)


def test_compiled_stages_match_compiled_ddp_with_activation_checkpointing(dist_pool):
    # Each block compiled and checkpointed (non-reentrant): stage 3 gathers a unit recomputed in the backward.
    for graphs in dist_pool(2).run(_parity_body, "block", True):
        assert all(g > 0 for g in graphs), graphs


def _int8_offload_body(mode: str) -> None:
    config = {"quantized_weights": True, "quantized_weights_group_size": 16, "offload_optimizer": True,
              "offload_parameters": True, "stage3_prefetch": True}
    want = _zeroq_run(3, "eager", False, **config)[:2]
    torch._dynamo.reset()
    got = _zeroq_run(3, mode, False, **config)[:2]
    _assert_close(got, want, atol=1e-5)


def test_compiled_stage3_with_int8_weights_offload_and_prefetch_matches_eager(dist_pool):
    # INT8 weights are not DDP's numbers: the reference is the same configuration run eagerly.
    dist_pool(2).run(_int8_offload_body, "whole")


def _async_body(mode: str) -> list[int]:
    """Compiled models with asynchronous host steps (their forward pre-hooks run outside the graphs)
    against the same offload run eagerly and synchronously, stages 2 and 3 (parameters offloaded too)."""
    graphs = []
    for stage, extra in ((2, {}), (3, {"offload_parameters": True})):
        config = {"offload_optimizer": True, **extra}
        want = _zeroq_run(stage, "eager", False, **config)[:2]
        torch._dynamo.reset()
        before = _graphs()
        *got, engine = _zeroq_run(stage, mode, False, offload_async_step=True, **config)
        graphs.append(_graphs() - before)
        assert engine.parts.async_step.steps > 0
        _assert_close(got, want, atol=1e-5)
    return graphs


@pytest.mark.usefixtures("host_kernel")  # tests/conftest.py: the asynchronous step needs the host kernel
@pytest.mark.parametrize("mode", ["whole", "block"])
def test_compiled_models_with_async_host_steps_match_eager(dist_pool, mode):
    for graphs in dist_pool(2).run(_async_body, mode):
        assert all(g > 0 for g in graphs), graphs


def _guard_body() -> None:
    *_, engine = _zeroq_run(3, "block", False)
    weight = engine.parts.module.blocks[0].a.weight
    assert isinstance(weight, FreedParameter)  # compiled steps left the unit freed
    with pytest.raises(RuntimeError, match="blocks.0.a.weight is sharded right now"):
        weight.sum()  # eager access outside forward and backward: the guard stays
    read = torch.compile(lambda: weight.sum() * 1, backend="eager")  # dynamo alone: the guard is in its tracing
    with pytest.raises(RuntimeError, match="blocks.0.a.weight is sharded right now"):
        read()  # a compiled read outside forward: the same one-line error, from inside dynamo
    with engine.gathered_parameters(engine.parts.module.blocks[0]):
        full = weight.detach().clone()
        assert torch.equal(read(), full.sum())  # gathered: dynamo traces it as a plain parameter
    assert isinstance(weight, FreedParameter)


def test_freed_parameter_guard_outside_forward_with_compiled_model(dist_pool):
    dist_pool(2).run(_guard_body)


def _held_after_forward_body() -> list[int]:
    torch.manual_seed(0)
    model = Net()
    _compiled(model, "block")
    engine = ZeroEngine(model, ZeroConfig(stage=3, **FREED))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    transient = [u for u in engine.parts.units if not u.persistent]
    held = []
    for s in range(3):
        x, y = _batch(s, 0)
        loss = F.mse_loss(model(x), y)
        held.append(sum(u.state is not UnitState.SHARDED for u in transient))  # at the loss, the activations' peak
        engine.backward(loss)
        engine.step()
    return held


def test_stage3_holds_no_unit_at_the_loss_with_prefetch(dist_pool):
    # Before: from the second step on, the last unit's prefetch gathered the next step's first unit at
    # the end of every forward and held it through the loss and the backward, which then freed it unused.
    for held in dist_pool(2).run(_held_after_forward_body):
        assert held == [0, 0, 0], held


def _recompute_gathers_body() -> list[int]:
    from lightning_zeroq.zero.gather import Gatherer

    counts = []
    for ac in (False, True):
        torch.manual_seed(0)
        model = Net(ac)
        engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_wrap_classes=["Linear"],
                                              stage3_param_persistence_threshold=0))
        engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        gathers = [0]
        original = engine.parts.gatherer.gather

        def counting(unit, prefetch=False):
            gathers[0] += unit.state is UnitState.SHARDED
            original(unit, prefetch)

        engine.parts.gatherer.gather = counting
        for s in range(3):
            x, y = _batch(s, 0)
            engine.backward(F.mse_loss(model(x), y))
            engine.step()
        counts.append(gathers[0])
    return counts


def test_checkpointed_units_are_gathered_once_for_recomputation_and_backward(dist_pool):
    # Units inside a checkpointed block are recomputed in the backward: each is gathered once there
    # (before: the recomputation freed it and its backward gathered it again, one gather per unit more).
    for plain, checkpointed in dist_pool(2).run(_recompute_gathers_body):
        assert checkpointed == plain, (plain, checkpointed)


# Lightning's tests/tests_pytorch/utilities/test_compile.py::test_trainer_compiled_model_ddp (2.6.5), with
# strategy=ZeroQStrategy(stage=...) where it fits DDP, on the gloo pool instead of a mocked single process.
def _lightning_compiled_body() -> list[float]:
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.compile import to_uncompiled

    from lightning_zeroq import ZeroQStrategy

    kwargs = {"accelerator": "cpu", "devices": 2, "fast_dev_run": True, "logger": False, "enable_checkpointing": False,
              "enable_model_summary": False, "enable_progress_bar": False}
    freed = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0}

    def strategy(stage: int) -> ZeroQStrategy:
        return ZeroQStrategy(stage=stage, **(freed if stage == 3 else {}))

    torch.manual_seed(0)
    model = BoringModel()
    compiled_model = torch.compile(model)
    assert model._compiler_ctx is compiled_model._compiler_ctx  # shared reference
    moved = []
    for stage in (1, 2, 3):  # can train with the compiled model
        before = model.layer.weight.detach().clone()
        trainer = L.Trainer(strategy=strategy(stage), **kwargs)
        trainer.fit(compiled_model)
        assert trainer.model._compiler_ctx["compiler"] == "dynamo"
        after = model.layer.weight.detach()  # handed back as a plain parameter after fit
        assert type(model.layer.weight) is torch.nn.Parameter and torch.isfinite(after).all()
        moved.append(float((after - before).abs().max()))

    # the compiled model can be uncompiled
    to_uncompiled_model = to_uncompiled(compiled_model)
    assert model._compiler_ctx is None and compiled_model._compiler_ctx is None
    assert to_uncompiled_model._compiler_ctx is None
    with pytest.raises(ValueError, match="required to be a compiled LightningModule"):
        to_uncompiled(to_uncompiled_model)

    # the uncompiled model can be fitted
    trainer = L.Trainer(strategy=strategy(3), **kwargs)
    trainer.fit(model)
    assert trainer.model._compiler_ctx is None

    # an exception is raised
    trainer = L.Trainer(strategy=strategy(3), **kwargs)
    with pytest.raises(TypeError, match="must be a `Light"):
        trainer.fit(object())
    return moved


def test_lightning_trainer_compiled_model_every_stage(dist_pool):
    # Before: stage 3 failed inside dynamo ("layer.weight is sharded right now (_is_view)").
    for rank_moved in zip(*dist_pool(2).run(_lightning_compiled_body)):
        assert rank_moved[0] == rank_moved[1] and rank_moved[0] > 0  # every stage trained, alike on both ranks


def _compiled_regions_per_forward(forward, x) -> int:
    from torch.profiler import profile

    with profile() as prof:
        forward(x)
    return sum(1 for e in prof.events() if e.name == "CompiledFunction")


@pytest.mark.parametrize("options", [{}, {"quantized_weights": True},
                                     {"offload_optimizer": True, "offload_parameters": True},
                                     {"quantized_weights": True, "offload_optimizer": True, "offload_parameters": True}],
                         ids=["full_width", "int8", "offload", "int8_offload"])
def test_whole_model_compile_runs_every_stage3_block_compiled(options):
    # ``torch.compile(model)`` of a model that calls its blocks in a loop, stage 3: the graph breaks at the
    # first unit's hook (outside the graph, as FSDP2's), the loop runs eagerly, and every block's forward
    # runs compiled, one graph for all of them, with INT8 weights and parameter offload too (nothing of
    # theirs inside a block); more blocks than dynamo's recompile limit (8), so a guard that failed per
    # block would leave the later blocks eager.
    from lightning_zeroq.cli.gpt import GPTConfig, GPTModel

    layers = 10
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(n_layer=layers, n_embd=32, n_head=2, block_size=16))
        forward = torch.compile(model)
        engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_wrap_classes=["Block"],
                                              stage3_param_persistence_threshold=0, **options))
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        x = torch.randint(0, 256, (2, 16))
        for _ in range(2):
            engine.backward(forward(x).float().pow(2).mean())
            engine.step()
        counters = torch._dynamo.utils.counters
        assert _compiled_regions_per_forward(forward, x) == layers
        assert counters["stats"]["unique_graphs"] == 1  # the blocks' graph, shared by every block
        assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
        assert all(u.state is UnitState.SHARDED for u in engine.parts.units if not u.persistent)
        engine.close()
    finally:
        torch._dynamo.reset()


def _whole_lightning_module_body() -> tuple:
    import lightning as L
    from torch.profiler import profile

    from lightning_zeroq import ZeroQStrategy
    from lightning_zeroq.cli.gpt import GPTConfig, GPTModel

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPTModel(GPTConfig(n_layer=10, n_embd=32, n_head=2, block_size=16))

        def training_step(self, batch, i):
            logits = self.model(batch[0])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[0].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)

    class Regions(L.Callback):  # the compiled regions of the third training step, forward and backward
        def on_train_batch_start(self, trainer, pl_module, batch, i):
            if i == 2:
                self.profile = profile()
                self.profile.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
            if i == 2:
                self.profile.__exit__(None, None, None)
                names = [e.name for e in self.profile.events()]
                self.counts = (names.count("CompiledFunction"), names.count("CompiledFunctionBackward"))

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        torch.manual_seed(0)
        regions = Regions()
        trainer = L.Trainer(strategy=ZeroQStrategy(stage=3, stage3_wrap_classes=["Block"],
                                                   stage3_param_persistence_threshold=0),
                            accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                            enable_model_summary=False, enable_progress_bar=False, callbacks=[regions])
        trainer.fit(torch.compile(Module()))
        counters = torch._dynamo.utils.counters
        return (regions.counts, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                sorted({"WeakHook.__call__" in reason for reason in counters["graph_break"]}),
                sum(counters["recompiles"].values()))
    finally:
        torch._dynamo.reset()


def test_whole_lightning_module_compile_runs_every_stage3_block_compiled(dist_pool):
    # trainer.fit(torch.compile(module)) with stage 3, ten blocks: each block's forward and backward is a
    # compiled region (one graph for all ten), the loss after the model another (the second graph); the
    # two graph breaks are stage 3's hooks (outside the graphs, as FSDP2's), in the training step's frame
    # and in the model's; nothing recompiles (a guard failing per block would leave blocks past dynamo's
    # recompile limit of 8 eager).
    (regions, graphs, breaks, at_hooks, recompiles), = dist_pool(1).run(_whole_lightning_module_body)
    assert regions == (11, 11)
    assert (graphs, breaks, recompiles) == (2, 2, 0)
    assert at_hooks == [True]  # every break is at a stage-3 hook (``hooks.WeakHook``, compiler-disabled)


def test_code_compiled_before_stage3_took_the_parameters_recompiles_for_them():
    # [Note: code compiled before stage 3 sees its parameters change]: a function compiled while the
    # parameters were plain runs after stage 3 took them over (a compiled model run before fit, an earlier
    # fit at another stage). On torch 2.9-2.11 dynamo skipped the guards under the unchanged modules and
    # ran the old graph on the freed placeholders (the inductor's stride assertion); the engine turns that
    # fast path off, as torch 2.13 does by default, and renews the modules' parameter dictionaries.
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
        step = torch.compile(lambda m, x: m(x).pow(2).sum())
        x = torch.randn(4, 32)
        step(model, x).backward()  # compiled with plain parameters and no hooks
        expected = float(model(x).pow(2).sum())
        dicts = [m._parameters for m in model]
        engine = ZeroEngine(model, ZeroConfig(stage=3, stage3_wrap_classes=["Linear"],
                                              stage3_param_persistence_threshold=0))
        engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        loss = step(model, x)
        assert float(loss) == pytest.approx(expected, rel=1e-6)
        engine.backward(loss)
        engine.step()
        assert not getattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", False)
        assert all(m._parameters is not d for m, d in zip(model, dicts) if d)
        engine.close()
    finally:
        torch._dynamo.reset()
