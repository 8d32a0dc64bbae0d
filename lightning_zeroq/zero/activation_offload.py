"""Activation offload (``ZeroConfig.activation_offloading_policy``): what a module's forward saves for its
backward waits in pinned host memory instead of on the device, and comes back ahead of the backward.

Each named module's ``forward`` is wrapped, on the instance, outside whatever else wraps it (activation
checkpointing, ``activation_checkpoint.py``), in torch's ``saved_tensors_hooks``. A module that does not
recompute hands every tensor autograd saves in its forward to the pack hook; one that also recomputes
(named in ``activation_checkpointing_policy`` too) hands it only its checkpoint inputs (torch's
non-reentrant checkpoint saves them through the hooks around it, and the rest inside its own), so they are
what goes to the host (DeepSpeed's ``cpu_checkpointing``).

Forward. A module's call is one *group*. The pack hook keeps what must stay: parameters and anything
sharing storage with one (the gathered working buffer of a stage-3 unit is regathered for the backward,
never copied), module buffers, tensors off the device, tensor subclasses, storages under ``min_bytes``.
Every other storage is recorded once (several saved views of one storage share it) and held until the
call returns; then the storages the call returns are dropped from the group (they stay on the device as its
outputs), and the rest are copied whole, offsets and strides kept, into host buffers on a side stream
(``d2h``) that first waits for the compute stream. Each device storage is then handed to the allocator with
``record_stream``: its memory is free for reuse once its copy is done, without the compute stream waiting
for it. ``BLOCKS_IN_FLIGHT`` bounds the groups whose copies may still run: at the start of a group, the
compute stream waits for the copies of older ones (the device never holds more than that many blocks'
saved tensors beyond the one computing).

Backward. The pack hook returns a small handle (``_Saved``); its unpack brings its storage back if it is
not on the device yet. The order is learned from the forward: every call of a named module, and of the last
repeated block (``unit_plan.repeated_blocks``) where that keeps its activations, is an entry, and a gradient
hook on each call's outputs says when that call's backward begins. Then the groups next in backward order
(earlier in the forward) are brought back on a second side stream (``h2d``), up to ``BLOCKS_IN_FLIGHT`` of them
ahead and not begun yet, each into memory
allocated on the compute stream (after ``h2d`` waited for it), so the copies overlap the backward of the
blocks before them; an unpack waits for its storage's copy on the compute stream. When the last handle of a
storage goes (autograd frees a node's saved tensors once it has run), the device memory goes with it and the
host buffer returns to the pool.

Host buffers (``HostPool``): pinned (``swap.buffers.pinned_empty``: exactly their bytes) on a GPU, in size
classes at most 1/8 above the bytes asked, reused step after step; a buffer is written again only after the
copy that read it back is done (its event). Before it grows, the pool asks the engine's host accounting
(``memory/host.py``, ``HostBudget.activations``), which stops with one line where the host cannot hold it; at
the start of each step's forward it gives back the buffers the last step did not use.

On a CPU device the same path runs with the host as the device: copies are synchronous, nothing is pinned.

``torch.compile``: the wrapper is a frame dynamo skips (``torch._dynamo.disable(recursive=False)``) and its
hooks are ``EagerHook``s: the hooks are set around the compiled code, never traced, and what the compiled
function saves for its backward goes through them as an eager module's would (torch 2.11 and 2.13 inline only
hooks that are FX graphs). Inside a backward (a checkpoint's recomputation of an enclosing module), without
gradients, or inside saved-tensor hooks set outside it (a ``torch.utils.checkpoint`` around the module), the
wrapper only calls the forward.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_zeroq.swap.buffers import PAGE, pinned_empty
from lightning_zeroq.zero import activation_checkpoint
from lightning_zeroq.zero.hooks import EagerHook
from lightning_zeroq.zero.policies import ActivationOffloading
from lightning_zeroq.zero.unit_plan import repeated_blocks

BLOCKS_IN_FLIGHT = 1
"""Groups whose copies may run beside the compute: in the forward, those copied to the host behind the one
computing; in the backward, those brought back ahead of the one whose backward runs."""


def select(module: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules of ``module`` that ``names`` (class names, or modules' qualified names) name, the outermost
    where they nest, in module order (``activation_checkpoint.select``). A ``ValueError`` naming what names no
    module; and one where a module is inside another that recomputes without offloading (its activations are
    recomputed, not kept)."""
    recomputing: dict[int, str] = {}

    def inside(m: nn.Module, name: str) -> None:  # what encloses the modules below: recomputed, not offloaded
        outer = recomputing.get(id(m)) or (
            (name or type(m).__name__) if getattr(m, "_zeroq_recomputed", False) else None
        )
        if outer is not None:
            recomputing.update((id(child), outer) for child in m.children())

    chosen = activation_checkpoint.select(module, names, "activation_offloading_policy", inside)
    names_of = {id(m): n for n, m in module.named_modules()}
    for m in chosen:
        if id(m) in recomputing:
            raise ValueError(
                f"ZeroConfig.activation_offloading_policy names {names_of[id(m)]!r}, inside {recomputing[id(m)]!r}, "
                "which activation_checkpointing_policy recomputes: its activations are recomputed, not kept, so there "
                f"is nothing to offload; name {recomputing[id(m)]!r} in both to keep its checkpoint inputs on the host."
            )
    return chosen


def install(
    module: nn.Module,
    policy: ActivationOffloading,
    device: torch.device,
    buffers: Callable[[], Iterable[Tensor]],
    reserve: Callable[[int], None],
) -> Optional["ActivationOffload"]:
    """Offload the activations of the modules ``policy`` names (``select``); None where it names none.
    ``buffers()``: the units' working buffers, never offloaded (beside the module's parameters and buffers);
    ``reserve(nbytes)``: called before the host pool grows to ``nbytes`` (``HostBudget.activations``)."""
    modules = select(module, policy.modules)
    if not modules:
        return None
    return ActivationOffload(module, modules, policy.min_bytes, device, buffers, reserve)


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to its pool class: whole pages, at most 1/8 more (8 classes per power of two)."""
    step = max(PAGE, 1 << max(0, nbytes.bit_length() - 4))
    return -(-max(nbytes, 1) // step) * step


class _Buffer:
    __slots__ = ("bytes", "read")

    def __init__(self, data: Tensor) -> None:
        self.bytes = data
        self.read: Optional[Any] = None
        """The event after the last copy that read it back to the device (a new copy into it waits for it)."""


class HostPool:
    """Host buffers for offloaded storages, by size class, kept from one step to the next. ``reserve(total)``
    is called before the pool holds ``total`` bytes; ``trim()`` gives back what the last cycle did not use."""

    def __init__(self, pin: bool, reserve: Callable[[int], None]) -> None:
        self.pin, self.reserve = pin, reserve
        self.held = 0
        """Bytes of every buffer the pool made (free and in use)."""
        self._free: dict[int, list[_Buffer]] = {}
        self._count: dict[int, int] = {}
        """Buffers made per class."""
        self._using: dict[int, int] = {}
        self._most: dict[int, int] = {}
        """Per class, the most buffers in use at once since the last ``trim``."""
        self._lock = threading.RLock()  # handles die on autograd's threads too, and in a collection inside ``take``

    def take(self, nbytes: int) -> _Buffer:
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
            else:
                self.reserve(self.held + size)
                buf = _Buffer(pinned_empty(size, torch.uint8, self.pin))
                self.held += size
                self._count[size] = self._count.get(size, 0) + 1
            using = self._using[size] = self._using.get(size, 0) + 1
            self._most[size] = max(self._most.get(size, 0), using)
        return buf

    def give(self, buf: _Buffer, read: Optional[Any]) -> None:
        size = buf.bytes.numel()
        buf.read = read
        with self._lock:
            self._using[size] -= 1
            self._free.setdefault(size, []).append(buf)

    def trim(self) -> None:
        """Give back the free buffers of each class beyond the most the last cycle used at once."""
        with self._lock:
            for size, free in self._free.items():
                extra = min(len(free), self._count[size] - self._most.get(size, 0))
                if extra > 0:
                    del free[:extra]
                    self._count[size] -= extra
                    self.held -= extra * size
            self._most = dict(self._using)

    def close(self) -> None:
        with self._lock:
            for size, free in self._free.items():
                self._count[size] -= len(free)
                self.held -= len(free) * size
            self._free = {}


class _Stored:
    """One device storage a group offloaded: its bytes on the host, and on the device again once brought back."""

    __slots__ = ("nbytes", "device", "host", "users", "group", "__weakref__")

    def __init__(self, storage: Tensor, group: "_Group") -> None:
        self.nbytes = storage.numel()
        self.device: Optional[Tensor] = storage
        """The storage's bytes on the device (uint8): the original until copied out, then None until brought back."""
        self.host: Optional[_Buffer] = None
        self.users = 0
        """Live handles (``_Saved``) over it."""
        self.group = group


class _Saved:
    """What the pack hook gives autograd: the storage it came from and how the tensor views it."""

    __slots__ = ("stored", "dtype", "offset", "size", "stride", "owner")

    def __init__(self, stored: _Stored, t: Tensor, owner: "ActivationOffload") -> None:
        self.stored, self.dtype, self.offset = stored, t.dtype, t.storage_offset()
        self.size, self.stride, self.owner = t.size(), t.stride(), owner
        stored.users += 1

    def __del__(self) -> None:
        try:
            self.owner._let_go(self.stored)
        except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone
            pass


class _Group:
    """One call of an offloaded module: the storages it offloaded and where they are."""

    __slots__ = ("stored", "by_storage", "copied", "ready", "state", "entry")

    FORWARD, ON_HOST, COMING, BEGUN = range(4)

    def __init__(self) -> None:
        self.stored: list[_Stored] = []
        self.by_storage: dict[int, _Stored] = {}
        self.copied: Optional[Any] = None
        """The event after its copies to the host (CUDA)."""
        self.ready: Optional[Any] = None
        """The event after its copies back to the device (CUDA)."""
        self.state = _Group.FORWARD
        self.entry: Optional[_Entry] = None


class _Entry:
    """A call of a named module or repeated block in the forward: its place in the learned order."""

    __slots__ = ("index", "sequence", "group")

    def __init__(self, index: int, sequence: int, group: Optional[_Group]) -> None:
        self.index, self.sequence, self.group = index, sequence, group


_RAISED = object()
"""What ``leave`` is given for a call that raised: nothing is copied (the graph goes with the error)."""


class _Forward:
    """The offloading ``forward`` of one module: ``inner`` (what ``forward`` was) between the offload's
    ``enter`` and ``leave``. Its call is a frame dynamo skips, not its callees: a compiled module's forward is
    compiled; ``enter``, ``leave`` and the hooks are skipped with theirs."""

    __slots__ = ("owner", "inner")

    def __init__(self, owner: "ActivationOffload", inner: Callable[..., Any]) -> None:
        self.owner, self.inner = weakref.ref(owner), inner

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        offload = self.owner()
        group = offload.enter() if offload is not None else None
        if offload is None or group is None:
            return self.inner(*args, **kwargs)
        try:
            output = self.inner(*args, **kwargs)
        except BaseException:
            offload.leave(group, _RAISED)
            raise
        return offload.leave(group, output)

    __call__ = torch._dynamo.disable(_call, recursive=False)

    def __reduce__(self) -> tuple:
        """Pickled (or deep-copied) as the forward it wraps: what unpickles is a plain module, with no engine behind
        it (as ``hooks.WeakHook``)."""
        return (_unwrapped, (self.inner,))


def _unwrapped(inner: Callable[..., Any]) -> Callable[..., Any]:
    return inner


class ActivationOffload:
    """The offload of one engine's named modules (see the module docstring)."""

    def __init__(
        self,
        root: nn.Module,
        modules: Sequence[nn.Module],
        min_bytes: int,
        device: torch.device,
        buffers: Callable[[], Iterable[Tensor]],
        reserve: Callable[[int], None],
    ) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # the saved tensors' device has its index: compared below
            device = torch.device("cuda", torch.cuda.current_device())
        self.root, self.modules, self.min_bytes, self.device = root, list(modules), min_bytes, device
        self._buffers = buffers
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.pool = HostPool(self.cuda, reserve)
        self.closed = False
        self._kept: set[int] = set()
        self._sequence: list[_Entry] = []
        self._number = 0
        """Which forward the entries belong to (a hook of an earlier one is ignored)."""
        self._backward_seen = True
        self._copying: list[_Group] = []
        """Groups whose copies to the host may still run (CUDA)."""
        self._warned = False
        self._handles = []
        ids = {id(m) for m in self.modules}
        for m in self.modules:
            m.forward = _Forward(self, m.forward)
        # The last repeated block, where it keeps its activations: its backward's start (the first of the blocks')
        # starts bringing back the last offloaded block, which then has the blocks between to arrive. (One hook,
        # one graph break under torch.compile; the offloaded blocks' own hooks move the prefetch on.)
        blocks = repeated_blocks(root)
        tracked = [blocks[-1]] if blocks and id(blocks[-1]) not in ids else []
        for block in tracked:
            self._handles.append(block.register_forward_hook(EagerHook(self._tracked)))
        self._sequence_modules = [*self.modules, *tracked]

    def _forward_with_grad(self) -> bool:
        """A forward that records a graph: gradients on, not in a backward (a recomputation)."""
        return not self.closed and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def offloads(self) -> bool:
        """Whether a call of a named module offloads: a forward with gradients, no other saved-tensor hooks
        outside (a checkpoint around the module: its own hooks keep nothing to offload)."""
        hooks_allowed = torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
        if not self._forward_with_grad() or not hooks_allowed:
            return False  # (not allowed under torch.func's transforms: no hooks can be set)
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "ZeroQ activation offload: a module of activation_offloading_policy ran inside "
                    "saved-tensor hooks set outside it (torch.utils.checkpoint around it): its "
                    "activations are left to them, not offloaded.",
                    stacklevel=4,
                )
            return False
        return True

    # Forward.

    def _entry(self, group: Optional[_Group]) -> _Entry:
        # A new forward after a backward; or, after many forwards without one (evaluation with gradients on),
        # once none of their storages is held any more.
        if self._backward_seen or (
            len(self._sequence) >= 4 * len(self._sequence_modules)
            and not any(s.users for e in self._sequence if e.group is not None for s in e.group.stored)
        ):
            self._backward_seen = False
            self._number += 1
            self._sequence = []
            self.pool.trim()
            self._kept = self._kept_storages()
        entry = _Entry(len(self._sequence), self._number, group)
        self._sequence.append(entry)
        if group is not None:
            group.entry = entry
        return entry

    def _kept_storages(self) -> set[int]:
        kept = set()
        with torch._C.DisableTorchFunctionSubclass():  # a freed stage-3 parameter refuses to be read, not this
            for t in [*self._buffers(), *self.root.parameters(), *self.root.buffers()]:
                kept.add(t.untyped_storage()._cdata)  # a freed stage-3 buffer keeps its storage object (0 bytes)
        return kept

    def _enter(self) -> Optional[_Group]:
        """A named module's call begins: its group, with the hooks set (None: this call does not offload)."""
        if not self.offloads():
            return None
        group = _Group()
        self._entry(group)
        self._bound_copies()
        torch._C._autograd._push_saved_tensors_default_hooks(EagerHook(self._pack, group), EagerHook(self._unpack))
        return group

    def _leave(self, group: _Group, output: Any) -> Any:
        """The call returned ``output`` (``_RAISED``: it raised): the hooks unset, its storages on their way."""
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if output is not _RAISED:
            self._copy_out(group, output)
            assert group.entry is not None
            self._signal_on(output, group.entry)
        return output

    enter = torch._dynamo.disable(_enter, recursive=True)
    leave = torch._dynamo.disable(_leave, recursive=True)

    def _tracked(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_with_grad():
            self._signal_on(output, self._entry(None))

    def _signal_on(self, output: Any, entry: _Entry) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(EagerHook(self._begun, entry))

    def _pack(self, group: _Group, t: Tensor) -> Any:
        if (
            type(t) is not Tensor
            or t.device != self.device
            or t.layout != torch.strided
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
        ):
            return t  # a parameter (or a subclass), off the device, or not plain strided memory
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._kept or storage.nbytes() < max(1, self.min_bytes):
            return t
        stored = group.by_storage.get(key)
        if stored is None:
            whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)  # the storage's bytes
            stored = group.by_storage[key] = _Stored(whole, group)
            group.stored.append(stored)
        return _Saved(stored, t, self)

    def _bound_copies(self) -> None:
        """At most ``BLOCKS_IN_FLIGHT`` groups' copies to the host run beside the compute (CUDA): the compute
        stream waits for older ones (their device memory is free once they are done)."""
        if not self.cuda:
            return
        self._copying = [g for g in self._copying if g.copied is not None and not g.copied.query()]
        while len(self._copying) > BLOCKS_IN_FLIGHT:
            copied = self._copying.pop(0).copied
            assert copied is not None  # the list holds groups whose copies were queued
            torch.cuda.current_stream(self.device).wait_event(copied)

    def _copy_out(self, group: _Group, output: Any) -> None:
        """The call returned: its saved storages, less those it returns, to the host; the device's go."""
        returned = {t.untyped_storage()._cdata for t in tree_flatten(output)[0] if isinstance(t, Tensor)}
        going = []
        for key, stored in group.by_storage.items():
            if key in returned or not stored.users:
                continue  # the call's output (on the device whatever happens), or let go already (a graph
                # freed inside the call)
            stored.host = self.pool.take(stored.nbytes)
            going.append(stored)
        group.by_storage = {}
        if not going:
            group.state = _Group.BEGUN  # nothing to bring back
            return
        if self.cuda:
            assert self.d2h is not None
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                for stored in going:
                    assert stored.host is not None and stored.device is not None
                    if stored.host.read is not None:
                        self.d2h.wait_event(stored.host.read)
                    stored.host.bytes[: stored.nbytes].copy_(stored.device, non_blocking=True)
                    stored.device.record_stream(self.d2h)
                group.copied = torch.cuda.Event()
                group.copied.record(self.d2h)
            self._copying.append(group)
        else:
            for stored in going:
                assert stored.host is not None and stored.device is not None
                stored.host.bytes[: stored.nbytes].copy_(stored.device)
        for stored in going:
            stored.device = None
        group.state = _Group.ON_HOST

    # Backward.

    def _begun(self, entry: _Entry, grad: Tensor) -> None:
        """A gradient reached the outputs of ``entry``'s call: its backward begins."""
        self._begin(entry)

    def _begin(self, entry: _Entry) -> None:
        """``entry``'s backward begins: its group comes back now (if not on its way), the groups next in the
        backward start coming."""
        if entry.sequence != self._number:
            return
        self._backward_seen = True
        group = entry.group
        if group is not None and group.state != _Group.BEGUN:
            self._bring(group)
            group.state = _Group.BEGUN
        self._prefetch(entry.index)

    def _prefetch(self, index: int) -> None:
        ahead = 0
        for entry in reversed(self._sequence[:index]):
            group = entry.group
            if ahead >= BLOCKS_IN_FLIGHT:
                return
            if group is None or group.state == _Group.BEGUN or not any(s.users for s in group.stored):
                continue
            self._bring(group)
            ahead += 1

    def _bring(self, group: _Group) -> None:
        """Bring ``group``'s storages back to the device (CUDA: on ``h2d``, into memory of the compute stream)."""
        if group.state != _Group.ON_HOST:
            return
        group.state = _Group.COMING
        coming = [s for s in group.stored if s.users and s.device is None and s.host is not None]
        if self.cuda:
            assert self.h2d is not None and group.copied is not None
            compute = torch.cuda.current_stream(self.device)
            for stored in coming:
                stored.device = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
            self.h2d.wait_stream(compute)  # the memory above may be what compute work still queued freed
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(group.copied)
                for stored in coming:
                    assert stored.host is not None and stored.device is not None
                    stored.device.copy_(stored.host.bytes[: stored.nbytes], non_blocking=True)
                group.ready = torch.cuda.Event()
                group.ready.record(self.h2d)
        else:
            for stored in coming:
                assert stored.host is not None
                stored.device = stored.host.bytes[: stored.nbytes].clone()

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        stored = saved.stored
        group = stored.group
        if stored.device is None:
            if group.state != _Group.BEGUN and group.entry is not None and group.entry.sequence == self._number:
                self._begin(group.entry)  # no hook on its outputs ran first (none needed a gradient)
            if stored.device is None:
                group.state = _Group.ON_HOST  # brought back already and let go since, or never brought
                self._bring(group)
        if group.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(group.ready)
        assert stored.device is not None
        out = torch.empty(0, dtype=saved.dtype, device=self.device)
        return out.set_(stored.device.untyped_storage(), saved.offset, saved.size, saved.stride)

    def _let_go(self, stored: _Stored) -> None:
        """A handle died: with the last, the storage's device memory and host buffer go."""
        stored.users -= 1
        if stored.users > 0:
            return
        group = stored.group
        if stored.device is not None and group.ready is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(group.ready)  # a copy back nobody waited for
        stored.device = None
        if stored.host is not None:
            self.pool.give(stored.host, group.ready)
            stored.host = None

    def close(self) -> None:
        """Hand every module its own ``forward`` back and the pool's free buffers to the system."""
        if self.closed:
            return
        self.closed = True
        for m in self.modules:
            if isinstance(m.__dict__.get("forward"), _Forward):
                inner = m.__dict__["forward"].inner
                if getattr(inner, "__self__", None) is m and getattr(inner, "__func__", None) is type(m).forward:
                    del m.forward  # the class's own again
                else:
                    m.forward = inner
        for h in self._handles:
            h.remove()
        self._handles = []
        self._sequence = []
        self.pool.close()
