"""The engine's sharded view (``zero/state_dict.ShardedView``), the one door checkpoints use: every
rank's parts tile each parameter and its per-element optimizer state exactly once, read what the full
state holds, and a load through the view's batches lands in the masters and optimizer state."""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.integration.checkpoint.test_engine import _engine, _train


def _tiles_body(name: str, tmp: str) -> dict:
    from lightning_zeroq.zero.state_dict import Part, ShardedView

    engine = _engine(name, tmp)
    _train(engine, range(2))
    full, optimizer = engine.full_state_dict(), engine.full_optimizer_state()
    view = ShardedView(engine.parts, engine.optimizer)
    walk = view.walk()
    seen: dict = {}
    for pv in view.params:  # unit by unit: the walk's order
        if pv.part is None:
            continue
        walk.ensure(pv.part.order)
        part = pv.part
        assert part.shape == pv.shape == full[pv.name].shape and part.dtype == torch.float32
        expected = full[pv.name].reshape(-1)[part.offset:part.offset + part.numel]
        seen[pv.name] = (part.offset, part.numel, torch.equal(part.read().cpu(), expected))
        state = pv.state() if pv.group is not None else {}
        for key, value in state.items():
            if isinstance(value, Part):
                whole = optimizer[pv.name][key].reshape(-1)[part.offset:part.offset + part.numel]
                assert torch.equal(value.read().cpu(), whole), (pv.name, key)
            else:  # scalar state: only the rank holding the first element has it
                assert part.offset == 0 and torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer[pv.name][key]))
    walk.close()
    # A load through the view: every part written with its value + 1, every state with 0s and step 7.
    before = engine.full_state_dict()
    for batch in view.load(optimizer=True):
        for pv in batch:
            assert pv.part is not None
            pv.part.write(pv.part.read() + 1)
            if pv.group is not None:
                for key in sorted(view.per_element_keys()):
                    part = pv.state_part(key)
                    part.write(torch.zeros_like(part.buffer()))
                pv.write_scalar("step", torch.tensor(7.0))
    after, state = engine.full_state_dict(), engine.full_optimizer_state()
    moved = {n: torch.equal(after[n], before[n] + 1) for n in seen}
    zeroed = all(float(v.abs().max()) == 0 for e in state.values() for k, v in e.items() if k != "step")
    steps = {float(e["step"]) for e in state.values()}
    # The working weights were republished from the masters (stages 1 and 2 keep them whole).
    published = engine.config.stage == 3 or all(torch.equal(p.detach().float(), after[n])
                                                for n, p in engine.parts.module.named_parameters() if n in seen)
    return {"seen": seen, "moved": moved, "zeroed": zeroed, "steps": steps, "published": published,
            "numel": {n: v.numel() for n, v in full.items()},
            "managed": sorted(pv.name for pv in view.params if pv.shape.numel() > 0)}


@pytest.mark.parametrize("name,world", [("s3", 3), ("s2_half", 2), ("s2_nvme", 2)])
def test_every_rank_part_tiles_each_parameter_once_and_loads_through_the_view(dist_pool, name, world):
    with tempfile.TemporaryDirectory() as tmp:
        results = dist_pool(world).run(_tiles_body, name, tmp)
    ranges: dict = {}
    for result in results:
        for pname, (offset, numel, same) in result["seen"].items():
            assert same, (pname, offset)
            ranges.setdefault(pname, []).append((offset, numel))
        assert all(result["moved"].values()), result["moved"]
        assert result["zeroed"] and result["steps"] == {7.0} and result["published"], result
    numel = results[0]["numel"]
    assert ranges and set(ranges) == set(results[0]["managed"]), (sorted(ranges), results[0]["managed"])
    for pname, parts in ranges.items():
        covered = 0
        for offset, count in sorted(parts):
            assert offset == covered, (pname, parts)
            covered += count
        assert covered == numel[pname], (pname, parts)
