"""The unit: a group of parameters flattened into one buffer and sharded across ranks.

Per unit and rank (see ``layout.py`` for the words):

- ``flat``: the full working-dtype buffer; the module's parameters are views into it, so forward and
  backward run on ordinary ``nn.Parameter`` objects. Persistent units keep it; a stage-3 transient
  unit keeps only its *storage object*, resized to 0 bytes between uses (``state`` SHARDED) and back
  to full size by a gather, so the views autograd saved in forward stay valid for backward.
- ``master``: this rank's fp32 shard, the only copy the optimizer updates. Where it lives (device,
  pinned host memory, NVMe) is the optimizer placement's business (``offload/``): the placement
  creates it and, for NVMe, swaps it in and out; everything else reads it through the placement.
  ``segment_masters`` are the views the optimizer steps, one per parameter segment.
- ``grad``: this rank's fp32 gradient shard on the device, held only while a window has gradients:
  its storage is allocated when the window needs it and released after each step, so the forward,
  where activations peak, holds no gradient memory (as with DDP's ``set_to_none`` and FSDP2). The
  window's first reduction is kept as it arrives (``pending``: the working-dtype part the
  reduce-scatter returned, half the bytes of fp32 in bf16) and becomes the fp32 shard only at a second
  reduction or when the window is finalized, in the same arithmetic as adding it to a zeroed shard.
  Where the reduction is the identity (one rank, full width) and the master is on the device, the part
  is the parameters' gradients as autograd left them (``ParamGrads``): no flat copy between them and
  the fp32 shard. The widening checks the values for NaN and inf in the same read (``ops.widen_checked``).

``build_units`` runs once: it materializes meta-device parameters unit by unit, flattens each unit,
broadcasts it from rank 0 (every rank starts from rank 0's values, as with DDP), hands this rank's
fp32 shard to the placement and points the parameters at the flat buffer. One unit at a time, so a
stage-3 model larger than one device can be built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq import ops
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import Segment, UnitLayout, make_layout
from lightning_zeroq.zero.materialize import materialize_meta_params
from lightning_zeroq.zero.unit_plan import UnitSpec

FREED_HINT = (
    "it is gathered only inside its module's forward and backward. Read or change it inside "
    "`with lightning_zeroq.gathered_parameters(module):` (a collective: every rank enters it), or after "
    "fit, when the strategy has handed the module back."
)
METADATA = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "is_floating_point",
        "is_complex",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__hash__",
        "__format__",
        "__repr__",
        "__reduce_ex__",
        "grad",
        "backward",  # autograd.grad/backward with parameters as inputs: hooks gather
        # new tensors shaped like it (an optimizer's constructor, e.g. Adagrad's sum): no values read
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)


class FreedParameter(nn.Parameter):
    """What a stage-3 parameter is while its unit is freed. Its metadata (shape, dtype, device,
    ``requires_grad``, ``grad``) reads as usual; anything that would read its values raises a
    ``RuntimeError`` naming the parameter and the fix, instead of reading freed memory. (Its data is a
    one-element placeholder expanded to the parameter's shape, so nothing can read out of bounds.)"""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        descriptor = getattr(func, "__self__", None)
        is_metadata = name in METADATA or (
            name in ("__get__", "__set__", "__delete__") and getattr(descriptor, "__name__", "") != "data"
        )
        if is_metadata:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        freed = next((a for a in args if isinstance(a, FreedParameter)), None)
        label = getattr(freed, "_zeroq_name", "a parameter") if freed is not None else "a parameter"
        raise RuntimeError(
            f"ZeroQ stage 3: {label} is sharded right now ({func.__name__ if name else func}); {FREED_HINT}"
        )

    # mypy 2.4 rejects any annotated override of Tensor.__repr__, even one with its exact signature
    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FreedParameter({getattr(self, '_zeroq_name', '?')}, shape={tuple(self.shape)}, dtype={self.dtype}): "
            f"sharded; {FREED_HINT}"
        )


def _widen(part: Tensor, out: Tensor, flag: Optional[Tensor]) -> None:
    """``out`` (fp32) = ``part`` + 0 (the values a zeroed buffer gets when ``part`` is added to it); ``flag``:
    set to 1 where a value is NaN or infinite, in the same read."""
    if flag is None:
        torch.add(part, 0.0, out=out)
    else:
        ops.widen_checked(part, out, flag)


@dataclass(eq=False)
class ParamGrads:
    """A unit's reduced part where the reduction is the identity: each parameter's gradient as autograd
    left it, flattened (None: the parameter got none), at its slot of the unit's flat layout (the slots lie
    back to back from 0; zeros in the padding). The fp32 shard is made from them in one pass, where a
    flat copy first would write and read every element once more."""

    grads: list[Optional[Tensor]]
    layout: UnitLayout

    def widen_into(self, out: Tensor, flag: Optional[Tensor]) -> None:
        """``out`` (the fp32 shard) = these gradients + 0, zeros elsewhere; ``flag``: set where any is non-finite."""
        for g, slot in zip(self.grads, self.layout.slots):
            if g is None:
                out[slot.span].zero_()
            else:
                _widen(g, out[slot.span], flag)
        out[self.layout.numel :].zero_()

    def add_into(self, out: Tensor) -> None:
        for g, slot in zip(self.grads, self.layout.slots):
            if g is not None:
                out[slot.span].add_(g)

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        for g in self.grads:
            if g is not None and g.is_cuda:
                g.record_stream(stream)


class UnitState(enum.Enum):
    """Where a unit's working buffer stands (persistent units are always GATHERED)."""

    SHARDED = "sharded"
    """Stage 3 at rest: ``flat`` has no storage; only the shards exist."""
    PREFETCHING = "prefetching"
    """A gather runs on the gather stream; the first use waits for ``Unit.ready``."""
    GATHERED = "gathered"


@dataclass(eq=False)
class Unit:
    index: int
    params: list[nn.Parameter]
    first_param_id: int
    """Parameters are numbered across units; unit parameter ``i`` has id ``first_param_id + i``."""
    layout: UnitLayout
    segments: list[Segment]
    """This rank's segments, in flat order."""
    flat: Tensor
    master: Tensor
    segment_masters: list[Tensor]
    grad: Tensor
    module: Optional[nn.Module]
    """Stage 3 transient units: the module whose forward uses the unit."""
    persistent: bool
    state: UnitState
    param_classes: list[type]
    """Each parameter's class when the engine took it (restored when its unit is gathered)."""
    param_dtypes: list[torch.dtype]
    """Each parameter's dtype when the engine took it (what ``release_module`` hands back)."""
    ready: Optional["torch.cuda.Event"] = None
    """Set while the unit is PREFETCHING."""
    pending: Optional[Tensor | ParamGrads] = None
    """The window's first reduced part, while ``grad`` holds no storage (see the module docstring)."""
    landed: Optional[Callable[[], Tensor]] = None
    """Set while the window's gradient so far lives on the host only (``land``): brings it back."""
    sums: Optional[tuple[Tensor, Optional[Tensor]]] = None
    """Its fp32 sum and (where ``squares_asked``) sum of squares, measured as it left the device."""
    squares_asked: bool = False
    """A norm of this unit's gradient was asked for (``grad_squares``): measure it as it leaves."""
    marks: tuple[int, ...] = ()
    """Persistent units: each parameter's version counter when the engine last wrote the working buffer
    (``Gatherer.publish``) or took what it held (``full_params.take_writes``). An in-place write of a parameter
    (``p.mul_``, ``p.copy_``, an initializer; a view of it included) bumps its counter, so a counter ahead
    of its mark is a write the masters have not seen. (A write through ``p.data`` bumps no counter.)"""
    frozen: Optional["Unit"] = None
    """Stage 3: the frozen parameters of the unit's module, sharded as a unit of their own dtype that has no
    gradient and no optimizer state; gathered and freed with this unit (``frozen.py``)."""
    _views: Optional[tuple[Tensor, list[Tensor]]] = field(default=None, repr=False)
    """``flat`` and its parameters' views, made once: resizing the storage keeps them valid."""
    _freed: Optional[tuple[Tensor, list[Tensor]]] = field(default=None, repr=False)
    """``flat`` and the placeholders its freed parameters point at (one element, expanded to each shape)."""

    def param_id(self, i: int) -> int:
        return self.first_param_id + i

    def versions(self) -> tuple[int, ...]:
        """Each parameter's version counter now (reading it waits for nothing: a pending parameter's too)."""
        return tuple(p._version for p in self.params)

    def mark(self) -> None:
        """The working buffer holds what the masters make (or the masters took what it holds): now."""
        self.marks = self.versions()

    def written(self) -> list[int]:
        """The parameters (indices in the unit) written in place since ``mark``."""
        now = self.versions()
        return [] if now == self.marks else [i for i, (v, m) in enumerate(zip(now, self.marks)) if v != m]

    def view_segments(self, shard: Tensor) -> list[Tensor]:
        """``shard``'s views of this rank's segments (``shard`` has the layout of ``master``)."""
        return [shard[seg.shard_span] for seg in self.segments]

    def set_master(self, master: Tensor) -> None:
        """Point the master and the optimizer's segment views at ``master`` (the same tensor objects
        stay in the optimizer's param groups; only their data moves)."""
        self.master = master
        for view, seg in zip(self.segment_masters, self.segments):
            view.data = master[seg.shard_span]

    @property
    def has_grad_storage(self) -> bool:
        return self.grad.untyped_storage().nbytes() > 0

    def add_grad(self, part: Tensor | ParamGrads) -> None:
        """Add a reduced part (this rank's share, any float dtype) to the window's gradient. The first
        one is kept as it is (the caller hands it over); a second makes the fp32 shard."""
        self.recall()
        if not self.has_grad_storage and self.pending is None:
            self.pending = part
            return
        self.materialize_grad()
        if isinstance(part, ParamGrads):
            part.add_into(self.grad)
        else:
            self.grad.add_(part)

    def materialize_grad(self, flag: Optional[Tensor] = None) -> bool:
        """Give ``grad`` its storage, holding the window's gradient so far (zeros if none): the pending
        part plus zero, in one pass -- the values a zeroed shard gets when the part is added to it
        (every x + 0 is x, and -0 becomes +0 as it does there). ``flag`` (one fp32 element): set to 1
        where a value is NaN or infinite, in the same pass. True when it was made now (and so checked);
        False when it existed already (``flag`` untouched)."""
        if self.has_grad_storage:
            return False
        self.recall()
        self.grad.untyped_storage().resize_(self.grad.numel() * self.grad.element_size())
        if self.pending is None:
            self.grad.zero_()
        elif isinstance(self.pending, ParamGrads):
            self.pending.widen_into(self.grad, flag)
        else:
            _widen(self.pending, self.grad, flag)
        self.pending = None
        return True

    def land(self, recall: Callable[[], Tensor], stream: Optional["torch.cuda.Stream"]) -> None:
        """The window's gradient was copied to the host (on ``stream``, still running): measure what the
        agreement and clipping read of it, then release it here. ``recall`` brings it back."""
        grad = self.grad if self.has_grad_storage else self.pending
        assert grad is not None, "land() needs a gradient"
        assert isinstance(grad, Tensor), "a unit stepped on the host gets its reduced part as one tensor"
        squares = grad.to(torch.float32, copy=True).pow_(2).sum() if self.squares_asked else None
        sums = (grad.sum(dtype=torch.float32), squares)
        self.drop_grad(stream)
        self.landed, self.sums = recall, sums

    def recall(self) -> None:
        """Bring a landed gradient back to the device (as the pending part: the dtype it left in)."""
        if self.landed is not None:
            self.pending, self.landed, self.sums = self.landed(), None, None

    def fp32_grad(self) -> Tensor:
        """The window's gradient in fp32 on the device, for reading only: the shard itself, or a copy."""
        if self.has_grad_storage:
            return self.grad
        part = self.pending if self.pending is not None else self.landed() if self.landed is not None else None
        if isinstance(part, ParamGrads):
            widened = torch.empty(self.grad.numel(), device=self.grad.device)
            part.widen_into(widened, None)
            return widened
        return torch.zeros(self.grad.numel(), device=self.grad.device) if part is None else part.float()

    def grad_sum(self) -> Tensor:
        """The fp32 sum of the window's gradient (a NaN or inf anywhere makes it non-finite)."""
        return self.sums[0] if self.sums is not None else self.fp32_grad().sum()

    def grad_squares(self) -> Tensor:
        """The sum of the squares of the window's gradient, in fp32."""
        self.squares_asked = True
        if self.sums is not None and self.sums[1] is not None:
            return self.sums[1]
        return self.fp32_grad().pow(2).sum()

    def drop_grad(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Release the gradient (the window is over). ``stream``: the last stream that used it, so the
        allocator reuses the memory only after that stream's work (CUDA)."""
        if isinstance(self.pending, ParamGrads) and stream is not None:
            self.pending.record_stream(stream)
        elif isinstance(self.pending, Tensor) and stream is not None and self.pending.is_cuda:
            self.pending.record_stream(stream)
        self.pending = self.landed = self.sums = None
        if self.has_grad_storage:
            if stream is not None and self.grad.is_cuda:
                self.grad.record_stream(stream)
            self.grad.untyped_storage().resize_(0)

    def release_storage(self) -> None:
        """Free the working buffer; the parameters become ``FreedParameter``s until ``restore_storage``."""
        flat = self.flat
        flat.untyped_storage().resize_(0)
        if self._freed is None or self._freed[0] is not flat:
            placeholder = torch.zeros(1, dtype=flat.dtype, device=flat.device)
            self._freed = (flat, [placeholder.expand(p.shape) for p in self.params])
        for p, freed, cls in zip(self.params, self._freed[1], self.param_classes):
            p.__class__ = cls  # already freed (a publish inside ``gathered_parameters``): set it again
            p.data = freed
            p.__class__ = FreedParameter

    def restore_storage(self) -> None:
        """Re-allocate the working buffer (same storage object: the views autograd saved stay valid)
        and point the parameters at it again. The caller fills it."""
        flat = self.flat
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        if self._views is None or self._views[0] is not flat:
            self._views = (flat, [flat[slot.span].view(p.shape) for p, slot in zip(self.params, self.layout.slots)])
        for p, view, cls in zip(self.params, self._views[1], self.param_classes):
            p.__class__ = cls
            p.data = view


def plan_layouts(specs: Sequence[UnitSpec], world_size: int, align: int) -> list[UnitLayout]:
    """Every unit's layout, known before any parameter is materialized (meta tensors have shapes)."""
    return [make_layout([p.numel() for p in spec.params], world_size, align) for spec in specs]


def build_units(
    module: nn.Module,
    specs: Sequence[UnitSpec],
    layouts: Sequence[UnitLayout],
    *,
    device: torch.device,
    param_dtype: torch.dtype,
    group: Optional[dist.ProcessGroup],
    adopt_master: Callable[[int, Tensor], Tensor],
    on_built: Callable[[Unit], None],
    shard_rank: Optional[int] = None,
    frozen_part: Optional[Callable[[UnitSpec, list[nn.Parameter]], Unit]] = None,
    frozen_only: Sequence[UnitSpec] = (),
) -> list[Unit]:
    """Flatten, broadcast from rank 0 and shard each unit, one at a time (bounded memory).

    ``adopt_master`` receives the unit index and this rank's fp32 shard (a view of a temporary) and returns the master
    tensor the placement keeps; ``on_built`` sees each unit as soon as it exists (stage 3 frees a
    transient unit there, before the next one is materialized). ``shard_rank``: which shard this rank
    keeps (default: its rank in ``group``; with hybrid groups its rank in its shard group, while the
    broadcast spans all of ``group``). ``frozen_part`` builds a unit's frozen part (``frozen.py``) from the
    spec's frozen parameters, materialized with the unit's, and the parts of their own (``frozen_only``) last.
    """
    rank, world_size = rank_and_size(group)
    rank = rank if shard_rank is None else shard_rank
    units: list[Unit] = []
    next_id = 0
    renamed: dict[int, nn.Parameter] = {}
    for index, (spec, layout) in enumerate(zip(specs, layouts)):
        params, held = list(spec.params), list(spec.frozen)
        both = params + held
        materialize_meta_params(module, both, device, renamed)
        params, held = both[: len(params)], both[len(params) :]
        classes, dtypes = [type(p) for p in params], [p.dtype for p in params]
        full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, slot in zip(params, layout.slots):
                full[slot.span].copy_(p.detach().reshape(-1))
            if world_size > 1:
                comm.broadcast(full, 0, group)
        master = adopt_master(index, full[layout.shard_span(rank)])
        flat = full.to(param_dtype) if param_dtype != torch.float32 else full
        for p, slot in zip(params, layout.slots):
            p.data = flat[slot.span].view(p.shape)
        segments = layout.segments(rank)
        unit = Unit(
            index=index,
            params=params,
            first_param_id=next_id,
            layout=layout,
            segments=segments,
            flat=flat,
            master=master,
            # Not views of ``master`` (``detach``): a view keeps its base alive whatever ``.data`` is set to
            # later, so a master replaced by ``set_master`` (one evicted to NVMe) would stay in memory.
            segment_masters=[master[seg.shard_span].detach() for seg in segments],
            grad=_without_storage(torch.empty(layout.shard_numel, dtype=torch.float32, device=device)),
            module=spec.module,
            persistent=spec.persistent,
            state=UnitState.GATHERED,
            param_classes=classes,
            param_dtypes=dtypes,
        )
        if held and frozen_part is not None:
            unit.frozen = frozen_part(spec, held)
        units.append(unit)
        on_built(unit)
        next_id += len(params)
    for spec in frozen_only:  # frozen parts of their own, after the units
        assert frozen_part is not None, "frozen parts of their own need frozen_part"
        held = list(spec.frozen)
        materialize_meta_params(module, held, device, renamed)
        frozen_part(spec, held)
    return units


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters in registration order, each once (tied weights are one parameter)."""
    return [p for p in module.parameters() if p.requires_grad]


def _without_storage(tensor: Tensor) -> Tensor:
    tensor.untyped_storage().resize_(0)
    return tensor
