"""``release_module`` (the strategy's teardown) hands back what a callback or hook wrote into the
parameters after the last step, element by element, and the masters everywhere else; the master shards
take the written values too. Working weights in bf16, or INT8 on the wire, differ from the masters, so
the rule is "what the module holds differs from what the engine last published", never "from the
masters"."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import RichModel, make_batch, param_groups

CASES = {
    "stage2-fp32": ({"stage": 2}, torch.float32),
    "stage2-bf16": ({"stage": 2, "reduce_bucket_size": 300}, torch.bfloat16),
    "stage1-int8": ({"stage": 1, "quantized_weights": True, "quantized_weights_exact_numel": 0}, torch.float32),
    "stage3-persistent-bf16": ({"stage": 3}, torch.bfloat16),
}


def _body(case: str) -> None:
    options, dtype = CASES[case]
    torch.manual_seed(0)
    model = RichModel()
    engine = ZeroEngine(model, ZeroConfig(**options), param_dtype=dtype)
    engine.attach_optimizer(torch.optim.AdamW(param_groups(model)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = model.loss(make_batch(0, 0, dist.get_rank(), uniform=True))
    engine.backward(loss)
    engine.step()
    masters = engine.full_state_dict()
    name, weight = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        weight[0].fill_(0.5)  # a hook's write after the last step (exact in bf16)
    engine.release_module()
    expected = masters[name].clone()
    expected[0] = 0.5
    after = dict(model.named_parameters())
    assert after[name].dtype == torch.float32
    assert torch.equal(after[name].detach().cpu(), expected), f"{name}: the write was lost or others changed"
    for n, value in masters.items():
        if n != name and n in after:
            assert torch.equal(after[n].detach().cpu().float(), value), f"{n} is not its master"
    assert torch.equal(engine.full_state_dict()[name], expected), "the masters did not take the write"


@pytest.mark.parametrize("case", sorted(CASES))
def test_release_keeps_what_was_written_after_the_last_step(dist_pool, case):
    dist_pool(2).run(_body, case)
