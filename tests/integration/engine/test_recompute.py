"""Activation checkpointing (``activation_checkpointing_policy``): the blocks named recompute their
forward in the backward; training is bitwise the same as without (dropout included), the activations
kept are only the blocks' inputs, names and state dicts are unchanged, and bad values are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zeroq import ZeroConfig, ZeroEngine
from tests.models import DIM, SEQ, VOCAB


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(F.gelu(self.up(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).sum()
    return sum(seen.values())


def _train_body(stage: int, policy) -> tuple[dict, list[str], int]:
    torch.manual_seed(0)
    model = Net()
    options = dict(stage3_wrap_classes=["Block"], stage3_param_persistence_threshold=0) if stage == 3 else \
        dict(reduce_bucket_size=DIM * DIM)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, activation_checkpointing_policy=policy, **options))
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    torch.manual_seed(1 + dist.get_rank())  # dropout's draws, different per rank
    for step in range(4):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        for micro in range(2):  # a window of two backward passes
            engine.backward(F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.roll(micro, 1).reshape(-1)),
                            boundary=micro == 1)
        engine.clip_grad_norm_(0.5)
        engine.step()
        engine.zero_grad()
    state = engine.full_state_dict()
    saved = _saved_bytes(model, tokens) if stage < 3 else 0  # stage 3 frees its units outside a step's forward
    names = [n for n, _ in model.named_parameters()]
    engine.close()
    return state, names, saved


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointed_blocks_train_bitwise_as_without(dist_pool, stage):
    pool = dist_pool(2)
    plain = pool.run(_train_body, stage, None)
    ours = pool.run(_train_body, stage, [Block])
    for (state, names, saved), (ref_state, ref_names, ref_saved) in zip(ours, plain):
        assert names == ref_names and state.keys() == ref_state.keys()  # no wrapper in any name
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), stage
        if stage < 3:
            assert saved < ref_saved / 2, (saved, ref_saved)  # the blocks keep their inputs only


def test_bad_policies_are_refused_with_the_fix():
    for bad in ("Block", [], [3], [None], {"Block": 1}):
        with pytest.raises(ValueError, match=r"activation_checkpointing_policy=.* must be a list of module classes"):
            ZeroConfig(activation_checkpointing_policy=bad)
    assert ZeroConfig(activation_checkpointing_policy={Block, "Block"}).activation_checkpointing_policy == ["Block"]
    with pytest.raises(ValueError, match=r"names \['Blok'\], which no module of the model is .*Block"):
        ZeroEngine(Net(), ZeroConfig(activation_checkpointing_policy=["Blok"]))


def test_the_hydra_override_names_the_block_class_of_zeroq_trains_gpt():
    from lightning_zeroq.cli.gpt import Block as GPTBlock
    from lightning_zeroq.cli.train import compose_config, to_run_config

    config = to_run_config(compose_config(["zero.activation_checkpointing_policy=[Block]"]))
    assert config.zero.activation_checkpointing_policy == [GPTBlock.__name__]
    assert to_run_config(compose_config([])).zero.activation_checkpointing_policy is None


def test_blocks_are_named_one_by_one_by_their_qualified_names():
    model = Net()
    engine = ZeroEngine(model, ZeroConfig(activation_checkpointing_policy=["blocks.1"]))
    assert [getattr(b, "_zeroq_recomputed", False) for b in model.blocks] == [False, True, False]
    engine.close()
    with pytest.raises(ValueError, match=r"names \['blocks.7'\], which no module .* or modules by their qualified "
                                         r"names, e.g. \['blocks.0'\]"):
        ZeroEngine(Net(), ZeroConfig(activation_checkpointing_policy=["blocks.7"]))
