"""``zero/activation_offload.py`` without processes: what the pack hook keeps and what it sends to the host
(parameters, views of them and the units' working buffers never; views of one storage once), that what comes
back is the tensor that left (values, dtype, offset, strides, bitwise), the host pool's reuse and size classes,
its host accounting, and which modules a policy names."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zeroq.zero.activation_offload import HostPool, _size_class, install, select
from lightning_zeroq.zero.policies import ActivationOffloading


class Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class Net(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def _offload(model: nn.Module, names=("Block",), min_bytes: int = 0, buffers=(), reserved=None):
    grown = reserved if reserved is not None else []
    return install(model, ActivationOffloading(tuple(names), min_bytes), torch.device("cpu"), lambda: list(buffers),
                   grown.append)


def test_parameters_their_views_and_working_buffers_stay_and_the_rest_comes_back_identical():
    torch.manual_seed(0)
    model = Net()
    flat = torch.zeros(1000)  # stands for a unit's working buffer: a view of it is never offloaded
    offload = _offload(model, buffers=[flat])
    assert offload is not None
    kept, went, back = [], [], []
    offload._entry(None)  # a forward's first entry: the kept storages are read
    group = offload.enter()
    weight = model.blocks[0].up.weight
    x = torch.randn(4, 16, 64)
    t = x.transpose(0, 1)[1:]  # a view: offset and strides to keep
    candidates = [weight, weight.t(), flat[10:20], torch.ones(3, device="meta"), t, x, x.exp()]
    handles = [offload._pack(group, c) for c in candidates]
    offload.leave(group, torch.zeros(1))
    for c, h in zip(candidates, handles):
        (kept if h is c else went).append(c)
    assert kept[:4] == candidates[:4]  # the parameter, its view, the working buffer's view, a tensor off the device
    assert len(went) == 3 and len(group.stored) == 2  # t and x share x's storage: one host copy
    assert all(s.device is None and s.host is not None for s in group.stored)  # on the host only now
    for c, h in zip(candidates[4:], handles[4:]):
        restored = offload._unpack(h)
        back.append(restored)
        assert restored.dtype == c.dtype and restored.shape == c.shape and restored.stride() == c.stride()
        assert restored.storage_offset() == c.storage_offset() and torch.equal(restored, c)
    assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()  # one storage again
    held = offload.pool.held
    del handles, h, back, restored
    gc.collect()
    assert all(s.users == 0 and s.host is None and s.device is None for s in group.stored)  # all given back
    assert offload.pool.held == held  # kept for the next step
    offload.close()


def test_small_storages_and_the_calls_outputs_stay_on_the_device():
    model = Net(1)
    offload = _offload(model, min_bytes=4096)
    offload._entry(None)
    group = offload.enter()
    small, large = torch.randn(16), torch.randn(2048)
    out = torch.randn(2048)
    handles = [offload._pack(group, small), offload._pack(group, large), offload._pack(group, out)]
    offload.leave(group, (out,))
    assert handles[0] is small
    assert [s.device is None for s in group.stored] == [True, False]  # the output stays where it is
    assert torch.equal(offload._unpack(handles[2]), out) and torch.equal(offload._unpack(handles[1]), large)
    offload.close()


@pytest.mark.parametrize("recompute", [False, True])
def test_training_with_offload_is_bitwise_the_same_and_the_pool_is_reused(recompute):
    from lightning_zeroq.zero import activation_checkpoint

    def run(offloaded: bool) -> tuple[list, list, int, int]:
        torch.manual_seed(0)
        model = Net()
        if recompute:
            activation_checkpoint.apply(model, ["Block"])
        offload = _offload(model) if offloaded else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, sizes = [], []
        for step in range(3):
            x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            sizes.append(offload.pool.held if offload else 0)
        if offload is not None:
            offload.close()
            assert type(model.blocks[0]).forward is Block.forward and "forward" not in model.blocks[0].__dict__ \
                or recompute  # its own forward again (under checkpointing: the checkpoint's)
        return losses, [p.detach().clone() for p in model.parameters()], sizes[0], sizes[-1]

    plain, ours = run(False), run(True)
    assert plain[0] == ours[0] and all(torch.equal(a, b) for a, b in zip(plain[1], ours[1]))
    assert ours[2] > 0 and ours[3] == ours[2]  # the first step's buffers serve the later steps


def test_size_classes_waste_at_most_an_eighth_or_a_page_and_the_pool_gives_back_what_a_step_did_not_use():
    for n in (1, 4095, 4097, 10**6, 3 * 2**20 + 1, 2**30 + 7):
        c = _size_class(n)
        assert c >= n and c % 4096 == 0 and c - n < max(n / 8, 4096)
    reserved: list[int] = []
    pool = HostPool(False, reserved.append)
    a, b = pool.take(5000), pool.take(5000)
    pool.give(a, None)
    pool.give(b, None)
    assert reserved == [_size_class(5000), 2 * _size_class(5000)] and pool.held == 2 * _size_class(5000)
    pool.trim()  # the cycle used two at once: both kept
    c = pool.take(5000)
    assert pool.held == 2 * _size_class(5000) and len(reserved) == 2
    pool.give(c, None)
    pool.trim()  # this cycle used one: one goes
    assert pool.held == _size_class(5000)


def test_host_pool_growth_is_checked_against_the_hosts_room():
    from lightning_zeroq.zero.memory.host import HostBudget, HostMemoryError
    from lightning_zeroq.zero.policies import Offload, OnDevice

    budget = HostBudget(Offload(OnDevice(), OnDevice(), host_budget="1MiB"), 1)
    budget.activations(512 << 10)
    assert budget.need.parts["offloaded activations"] == 512 << 10
    with pytest.raises(HostMemoryError, match=r"offloading activations .* needs 1\.5 MiB .*offload the activations "
                                              r"of fewer blocks") as info:
        budget.activations(2 << 20)
    assert "\n" not in str(info.value)


def test_select_names_classes_and_qualified_names_outermost_first():
    model = Net()
    assert select(model, ["Block"]) == list(model.blocks)
    assert select(model, ["blocks.0", "blocks.2"]) == [model.blocks[0], model.blocks[2]]
    assert select(model, ["Block", "Linear"]) == [model.embed, *model.blocks]  # a block's linears go with it
    with pytest.raises(ValueError, match=r"names \['Blok'\], which no module of the model is .*Block.*'blocks.0'"):
        select(model, ["Blok"])
    from lightning_zeroq.zero import activation_checkpoint

    activation_checkpoint.apply(model, ["Block"])
    with pytest.raises(ValueError, match=r"names 'blocks.1.up', inside 'blocks.1', which activation_checkpointing_policy "
                                         r"recomputes.*name 'blocks.1' in both"):
        select(model, ["blocks.1.up"])


def _blocks_net(blocks: int) -> Net:
    torch.manual_seed(0)
    return Net(blocks)


def test_each_group_comes_back_as_the_backward_of_the_block_after_it_begins():
    """Blocks 0, 2 and 4 of 6 offloaded (the plan's spread): with one group in flight, group 4 is brought back
    when block 5's backward begins (the last block, which keeps its activations), group 2 when block 4's does,
    group 0 when block 2's does; none waits for its own backward to begin."""
    model = _blocks_net(6)
    offload = _offload(model, names=("blocks.0", "blocks.2", "blocks.4"))
    block_of = [0, 2, 4, 5]  # the entries, in forward order: the offloaded blocks and the last block
    log: list[tuple[str, int]] = []
    bring, begin = offload._bring, offload._begin

    def logged_bring(group):
        if group.state == group.ON_HOST:
            log.append(("bring", block_of[group.entry.index]))
        bring(group)

    def logged_begin(entry):
        log.append(("begin", block_of[entry.index]))
        begin(entry)

    offload._bring, offload._begin = logged_bring, logged_begin
    for step in range(2):
        log.clear()
        model(torch.randn(4, 8)).sum().backward()
        assert [i for kind, i in log if kind == "begin"] == [5, 4, 2, 0], log
        assert log.index(("bring", 4)) == log.index(("begin", 5)) + 1
        assert log.index(("bring", 2)) == log.index(("begin", 4)) + 1
        assert log.index(("bring", 0)) == log.index(("begin", 2)) + 1
    offload.close()


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event.name))


class _Event:
    count = 0

    def __init__(self) -> None:
        _Event.count += 1
        self.name, self.done = f"e{_Event.count}", False

    def record(self, stream) -> None:
        _LOG.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.done


_LOG: list = []


def test_the_cuda_path_orders_its_copies_with_streams_and_events(monkeypatch):
    """The CUDA path on the CPU, its streams and events emulated: every copy to the host waits for the compute
    stream, each device storage is handed to the copy stream (``record_stream``); at most one group's copies
    run behind the one computing (the compute stream waits for older ones); a copy back waits for the compute
    stream and for the group's copy out, every unpack waits for it on the compute stream, and a host buffer is
    written again only after the copy that read it back."""
    import contextlib

    _LOG.clear()
    compute = _Stream("compute", _LOG)
    current = [compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    copies: list = []
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        copies.append(current[-1].name)
        return real_copy(self, src)

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: _LOG.append(("record_stream", s.name)),
                        raising=False)
    model = _blocks_net(4)
    offload = _offload(model)
    offload.cuda, offload.d2h, offload.h2d = True, _Stream("d2h", _LOG), _Stream("h2d", _LOG)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    for step in range(2):
        _LOG.clear()
        copies.clear()
        out = model(torch.randn(4, 8))
        groups = [e.group for e in offload._sequence]
        outs = [i for i, entry in enumerate(_LOG) if entry == ("wait_stream", "d2h", "compute")]
        assert len(outs) == 4  # one wait for the compute stream per group, before its copies
        # the third group starts after the compute stream waited for the first's copies (one in flight)
        assert ("wait_event", "compute", groups[0].copied.name) in _LOG
        assert ("wait_event", "compute", groups[2].copied.name) not in _LOG
        assert _LOG.count(("record_stream", "d2h")) == sum(len(g.stored) for g in groups)
        if step == 1:  # the buffers step 0 read back are written only after those reads
            assert any(e[0] == "wait_event" and e[1] == "d2h" for e in _LOG)
        _LOG.clear()
        out.sum().backward()
        for g in groups:
            ready = g.ready.name
            brought = _LOG.index(("record", ready, "h2d"))
            assert ("wait_stream", "h2d", "compute") in _LOG[:brought]
            assert ("wait_event", "h2d", g.copied.name) in _LOG[:brought]
            assert ("wait_event", "compute", ready) in _LOG[brought:]
        assert set(copies) == {"d2h", "h2d"}
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    offload.close()


def test_a_model_pickles_and_copies_as_a_plain_one():
    import copy
    import pickle

    model = Net(2)
    offload = _offload(model)
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert all(getattr(b.forward, "__self__", None) is b for b in other.blocks)  # its own forward, no wrapper
        x = torch.randn(4, 8)
        assert torch.equal(other(x), model(x))
    offload.close()
