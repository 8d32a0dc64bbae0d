"""At one rank with full-width gradients the reduction is the identity: a unit's gradients stay as autograd
left them (``unit.ParamGrads``) until the fp32 shard is made from them, checked for NaN and inf in the
same pass (``ops.widen_checked``). The training is bitwise the one the flat copy made, in every stage, with
two backwards in a window, clipping, a frozen parameter, fp32 and bf16 working weights, and a window of
non-finite gradients skipped alike."""

from __future__ import annotations

import pytest
import torch

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.zero.unit import ParamGrads
from tests.integration.engine.test_accumulation import _stage_options
from tests.models import RichModel, make_batch, param_groups


def _train(stage: int, dtype: torch.dtype, identity: bool, two_optimizers: bool = False) -> tuple[dict, list, list]:
    torch.manual_seed(0)
    model = RichModel()
    next(model.parameters()).requires_grad_(False)  # a frozen parameter: no gradient in its slot
    engine = ZeroEngine(model, ZeroConfig(stage=stage, nonfinite_gradients="skip", **_stage_options(stage)),
                        param_dtype=dtype)
    trained = [p for p in model.parameters() if p.requires_grad]
    if two_optimizers:  # every other parameter each: units shared by both, each stepped and zeroed on its own
        optimizers = [torch.optim.AdamW(trained[0::2], lr=1e-2), torch.optim.SGD(trained[1::2], lr=0.1, momentum=0.9)]
    else:
        optimizers = [torch.optim.AdamW(param_groups(model), lr=1e-2)]
    for optimizer in optimizers:
        engine.attach_optimizer(optimizer)
    engine.parts.reducer.wire.identity = identity and engine.parts.reducer.wire.identity
    kinds, stepped = [], []
    for step in range(4):
        for micro in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
                loss = model.loss(make_batch(step, micro, 0, uniform=True))
            engine.backward(loss * float("nan") if step == 2 and micro == 1 else loss, boundary=micro == 1)
            kinds.append(sorted({type(u.pending).__name__ for u in engine.parts.units if u.pending is not None}))
        if not two_optimizers:
            if step == 1:
                engine.clip_grad_norm_(0.05)
            stepped.append(engine.step())
            continue
        for optimizer in optimizers:
            if step == 1:
                engine.clip_grad_norm_(0.05, optimizer=optimizer)
            stepped.append(engine.step(optimizer))
            engine.zero_grad(optimizer)
    return engine.full_state_dict(), kinds, stepped


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_identity_reduction_trains_as_the_flat_copy_bitwise(stage, dtype):
    state, kinds, stepped = _train(stage, dtype, identity=True)
    flat_state, flat_kinds, flat_stepped = _train(stage, dtype, identity=False)
    assert stepped == flat_stepped == [True, True, False, True]  # the NaN window is skipped by both
    assert state.keys() == flat_state.keys()
    assert all(torch.equal(state[k], flat_state[k]) for k in state)
    assert all(kind in ([], ["Tensor"]) for kind in flat_kinds)
    if stage >= 2 or dtype == torch.float32:  # stage 1 in bf16 sums locally in fp32 and reduces from that sum
        assert ["ParamGrads"] in kinds
    else:
        assert all(kind in ([], ["Tensor"]) for kind in kinds)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_optimizers_sharing_units_train_as_the_flat_copy_bitwise(stage):
    state, kinds, stepped = _train(stage, torch.bfloat16, identity=True, two_optimizers=True)
    flat_state, _, flat_stepped = _train(stage, torch.bfloat16, identity=False, two_optimizers=True)
    assert stepped == flat_stepped == [True, True, True, True, False, False, True, True]
    assert all(torch.equal(state[k], flat_state[k]) for k in state)
    assert ["ParamGrads"] in kinds


def test_the_parts_are_the_gradients_autograd_made():
    torch.manual_seed(0)
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(stage=2, **_stage_options(2)), param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(make_batch(0, 0, 0, uniform=True))
    grads = {}
    for p in (p for p in model.parameters() if p.requires_grad):
        p.register_hook(lambda g, p=p: grads.__setitem__(p, g))
    engine.backward(loss, boundary=True)
    parts = [u.pending for u in engine.parts.units]
    assert all(isinstance(part, ParamGrads) for part in parts)
    for unit, part in zip(engine.parts.units, parts):
        for p, g in zip(unit.params, part.grads):
            assert (g is None) if p not in grads else torch.equal(g, grads[p].reshape(-1))
    assert sum(g is not None for part in parts for g in part.grads) == len(grads) > 0
    assert all(p.grad is None for p in model.parameters())  # the engine took them
