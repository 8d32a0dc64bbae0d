"""Optimizers that need each matrix whole: Muon (``torch.optim.Muon``).

A shard holds each parameter cut at arbitrary element boundaries, which is all an elementwise update
needs. Muon's update is elementwise but for one step: the momentum-blended gradient of each 2-D
parameter is orthogonalized by Newton-Schulz iterations over the whole matrix. So each rank steps its
segments' elementwise parts itself (the momentum buffer is sharded like Adam's moments), and each
matrix has an owner (``owners``: the ranks share the matrices by their Newton-Schulz cost): every rank
sends its segments of the blended updates to their owners (one all-to-all), each owner makes its
matrices whole and orthogonalizes each once with torch's own function, and sends every rank its
segments of the results (a second all-to-all), which each rank applies. The same input gives the same
bits wherever it is orthogonalized, so the result is bitwise the unsharded optimizer's. With the
optimizer on the host the momentum stays there and the matrix is orthogonalized on the device: the
host kernel blends a unit's segments into one pinned buffer that crosses in one copy, the results come
back in one, and the next unit blends while the device works (``start_matrices``).

Communication per step and rank: its shard of the matrices' updates sent once and its owned matrices
received (``MatrixRule.wire``: 2 bytes per element with torch's bf16 iteration, else 4), then the results
the other way, on top of the weights' gather;
AdamW's step adds none. The orthogonalization of each matrix runs once in the group.

Other optimizers of this kind: ``register_matrix_optimizer(cls, rule)`` with a ``MatrixRule`` (its
elementwise blend, its whole-matrix transform, its elementwise apply); Muon is one such rule.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from lightning_zeroq.ops.host_adam import HostAdam, muon_apply_reference, muon_blend_reference
from lightning_zeroq.ranks import agree, rank_and_size
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.unit import Unit


class MatrixRule:
    """How ZeroQ steps an optimizer whose update needs each matrix whole, in three parts, so that its
    state stays sharded like Adam's moments (``register_matrix_optimizer``):

    - ``blend(view, grad, state, group)``: elementwise, on this rank's segment of one matrix (``view``:
      the fp32 master segment, ``grad``: its gradient, ``state``: the optimizer's state of that segment,
      ``group``: its param group): update the per-element state and return the segment of the matrix
      to make whole (fp32, ``view``'s shape);
    - ``whole(matrix, group)``: on the whole matrix (2-D, fp32, on the device), the same on every rank
      (the same input must give the same bits: the ranks then agree without another collective); it
      returns a tensor of ``matrix``'s shape (checked on every rank: see ``start_matrices``);
    - ``apply(view, update, group, shape)``: elementwise, in place, on this rank's segment of the
      parameter, from its segment of ``whole``'s result (``shape``: the parameter's).

    The optimizer's own ``step()`` is still called (with no gradients: it must skip parameters whose
    ``grad`` is None, as torch's optimizers do), so what watches it sees the step."""

    def blend(self, view: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        raise NotImplementedError

    def whole(self, matrix: torch.Tensor, group: dict) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, view: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
        raise NotImplementedError

    def wire(self) -> torch.dtype:
        """The dtype the blended segments travel in to the matrix's owner and the results travel back in:
        float32, unless ``whole()`` rounds its input to a narrower dtype first and returns that dtype, so
        that rounding before the journey gives the same bits in half the bytes (Muon's)."""
        return torch.float32


class MuonRule(MatrixRule):
    """``torch.optim.Muon``: the momentum (and Nesterov's blend) elementwise, torch's own Newton-Schulz
    iteration on the whole matrix, then decoupled weight decay and the learning rate adjusted to the
    matrix's shape, as torch's ``Muon.step`` does."""

    def blend(self, view: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        return muon_blend_reference(self.momentum_buffer(view, state), grad, group["momentum"], group["nesterov"])

    @staticmethod
    def momentum_buffer(view: torch.Tensor, state: dict) -> torch.Tensor:
        """The segment's momentum buffer, made as torch's Muon makes it at its first step."""
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(view)
        return buf

    def whole(self, matrix: torch.Tensor, group: dict) -> torch.Tensor:
        parts = _muon_parts()  # looked up at each call: the tests replace torch's iteration
        assert parts is not None  # matrix_optimizers() offers Muon only with them
        return parts[0](matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def wire(self) -> torch.dtype:
        """bfloat16 with torch's own iteration, which rounds its input to bfloat16 first and returns
        bfloat16 (``test_torchs_iteration_reads_and_returns_bfloat16`` holds torch to it); float32
        where the iteration was replaced (the parity tests run it in fp32)."""
        parts = _muon_parts()
        return torch.bfloat16 if parts is not None and parts[0] is _TORCH_ITERATION else torch.float32

    def apply(self, view: torch.Tensor, update: torch.Tensor, group: dict, shape: torch.Size) -> None:
        muon_apply_reference(view, update, *self.scales(group, shape))

    @staticmethod
    def scales(group: dict, shape: torch.Size) -> tuple[float, float]:
        """The decoupled weight decay's factor and the learning rate adjusted to the matrix's shape."""
        parts = _muon_parts()
        assert parts is not None
        lr = float(group["lr"])
        return 1 - lr * group["weight_decay"], parts[1](lr, group["adjust_lr_fn"], shape)


_RULES: dict[type, MatrixRule] = {}
"""Optimizer classes registered with ``register_matrix_optimizer``, and their rules."""


def register_matrix_optimizer(cls: type, rule: MatrixRule) -> type:
    """Declare that optimizer class ``cls`` needs each parameter's matrix whole, stepped by ``rule`` (a
    ``MatrixRule``); ZeroQ then takes it in every stage, with and without CPU optimizer offload, for 2-D
    parameters. Returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"an object of type {type(cls).__name__}"
        raise TypeError(
            f"register_matrix_optimizer() takes an optimizer class (a subclass of torch.optim.Optimizer) "
            f"and its MatrixRule, e.g. register_matrix_optimizer(MyMuon, MyMuonRule()); got {what}."
        )
    if not isinstance(rule, MatrixRule):
        raise TypeError(
            f"register_matrix_optimizer({cls.__name__}, ...): the rule must be a "
            f"lightning_zeroq.MatrixRule (blend, whole, apply); got {type(rule).__name__}."
        )
    _RULES[cls] = rule
    return cls


def matrix_optimizers() -> tuple[type, ...]:
    """The optimizer classes stepped here: those registered, and ``torch.optim.Muon`` where this torch has it."""
    muon = getattr(torch.optim, "Muon", None)
    return (*_RULES, *((muon,) if muon is not None and _muon_parts() is not None else ()))


_MUON = MuonRule()

_SHAPES_CHECKED: dict[int, tuple[MatrixRule, set[tuple[int, ...]]]] = {}
"""Per rule (by id, the rule kept beside: a rule need not be hashable), the matrix shapes for which every
rank has called its ``whole()`` and checked the result's shape."""


def rule_of(optimizer: torch.optim.Optimizer) -> MatrixRule:
    for cls, rule in _RULES.items():
        if isinstance(optimizer, cls):
            return rule
    return _MUON


def check_whole(rule: MatrixRule, result: Any, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``result`` (``rule.whole()`` of ``param``'s matrix) is a tensor of ``param``'s shape,
    naming the rule, the parameter and both shapes."""
    expected = tuple(param.shape)
    if isinstance(result, torch.Tensor) and tuple(result.shape) == expected:
        return
    name = getattr(param, "_zeroq_name", "a parameter")
    rule_name = type(rule).__name__
    fix = (
        f"whole() must return the matrix it is given, transformed, at its shape (the MatrixRule "
        f"{type(optimizer).__name__} was registered with; lightning_zeroq.register_matrix_optimizer)"
    )
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"{rule_name}.whole() returned a {type(result).__name__} for {name} of shape {expected}, "
            f"not a tensor: {fix}"
        )
    raise ValueError(f"{rule_name}.whole() returned shape {tuple(result.shape)} for {name} of shape {expected}: {fix}")


@functools.cache
def _muon_parts_available() -> bool:
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # noqa: F401
    except ImportError:
        return False
    return True


_TORCH_ITERATION: Any = None
"""torch's own Newton-Schulz function, as imported here (the tests may replace the module's later)."""
try:
    from torch.optim._muon import _zeropower_via_newtonschulz as _TORCH_ITERATION
except ImportError:
    pass


def _muon_parts() -> Optional[tuple[Any, Any]]:
    """torch's own Newton-Schulz iteration and learning-rate adjustment (None where this torch lacks them)."""
    if not _muon_parts_available():
        return None
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz, _adjust_lr


def is_matrix_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, matrix_optimizers())


class _Matrix(NamedTuple):
    """One matrix of a step: its parameter, this rank's segment of it (``view``; None where this rank
    holds none or has no gradient for it) with its gradient and the multiplier that gradient still owes,
    its param group, and each rank's element count."""

    param: torch.Tensor
    view: Optional[torch.Tensor]
    grad: Optional[torch.Tensor]
    gmul: float
    hyper: dict
    counts: list[int]
    unit: Unit
    span: Optional[slice]
    """``view``'s span in the unit's shard (None with ``view``)."""


class MatrixSource(Protocol):
    """Where a matrix step reads a unit's gradient (the placement's ``Updater`` role)."""

    def matrix_grad(self, unit: Unit) -> tuple[torch.Tensor, float]:
        """The unit's gradient shard as the optimizer reads it (fp32, or bf16 for the host kernel) and the
        multiplier it still owes (unscaling and clipping: 1.0 when none)."""

    def host_kernel(self, unit: Unit) -> Optional[HostAdam]:
        """The host kernel that steps the unit's segments where they live on the host, if any."""

    def kernel_copy(self, unit: Unit) -> Optional[torch.Tensor]:
        """Where the host kernel writes the unit's bf16 master copy as it steps (None: no such copy)."""

    def copied(self, unit: Unit, spans: Sequence[slice]) -> None:
        """These spans of ``kernel_copy(unit)`` were just written with their masters."""


def start_matrices(
    binding: Any,
    units: Sequence[Unit],
    used: Sequence[Any],
    source: MatrixSource,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> Callable[[], None]:
    """A matrix optimizer's step of ``units`` (the same units, in the same order, on every rank of
    ``group``; ``rule_of`` the optimizer: Muon's or a registered one), from the gradients ``source``
    gives (``matrix_grad``).

    Each matrix is made whole and transformed once, by its owner (``owners``): every rank sends its
    segments of the blended update to their matrices' owners in one all-to-all, each owner transforms
    its matrices, and sends each rank its segments of the results in a second. A matrix's whole is
    the same input wherever it is transformed, so the result is the one every rank would compute.

    Returns the step's finish, which applies the results: everything before it is issued here (on a
    GPU the transforms and the copies run on while the caller goes on), so a step of host units one
    at a time blends the next unit on the host while the device works on this one (``step.step_in``).

    Segments on the host (optimizer offload) blend into one buffer (pinned where a GPU copies it) that
    crosses to ``device`` in one copy, in the dtype ``whole()`` reads (``MatrixRule.wire``: bf16 for
    torch's Muon iteration), and the results come back in one copy. Muon's elementwise parts there run
    in the host kernel (``ops.host_adam``: torch's ops' bits, in one pass each, reading the gradient as it
    landed), else with torch's ops."""
    optimizer = binding.optimizer
    rule = rule_of(optimizer)
    checked = _SHAPES_CHECKED.setdefault(id(rule), (rule, set()))[1]
    groups = {id(p): optimizer.param_groups[gi] for gi, given in enumerate(binding.given) for p in given}
    matrices: list[_Matrix] = []
    kernel: Optional[HostAdam] = None
    for unit in sorted(units, key=lambda u: u.index):
        mine: dict[int, Any] = {seg.param: (view, seg) for view, seg in binding.optimized[unit.index]}
        counts = _segment_numels(unit.layout)
        grad, gmul = None, 1.0
        for i, param in enumerate(unit.params):
            if unit.param_id(i) not in binding.param_ids or not used[unit.param_id(i)]:
                continue  # another optimizer's, or no rank used it: left as torch.optim leaves it
            if param.dim() != 2:
                raise ValueError(
                    f"{type(optimizer).__name__} steps 2-D parameters only; "
                    f"{getattr(param, '_zeroq_name', 'a parameter')} has shape {tuple(param.shape)}: "
                    "give it to another optimizer (e.g. AdamW)"
                )
            view, seg = mine.get(i, (None, None))
            if view is not None and grad is None:
                grad, gmul = source.matrix_grad(unit)
                kernel = kernel or source.host_kernel(unit)
            g = grad[seg.shard_span] if view is not None and grad is not None else None
            span = seg.shard_span if seg is not None else None
            matrices.append(_Matrix(param, view, g, gmul, groups[id(param)], counts[i], unit, span))
    if not matrices:
        return _done
    rank, world = rank_and_size(group)
    owner = owners([tuple(m.param.shape) for m in matrices], world, first=min(u.index for u in units))
    wire = rule.wire()
    home = next((m.view.device for m in matrices if m.view is not None), device)
    fused = kernel is not None and kernel.muon and type(rule) is MuonRule and home.type == "cpu"
    send = _blend(rule, matrices, owner, rank, world, wire, home, device, optimizer, kernel if fused else None)
    wholes = _to_owners(send.to(device, non_blocking=True), matrices, owner, rank, world, group, device, wire)
    results: dict[int, torch.Tensor] = {}
    failed: Optional[Exception] = None
    for k, whole in wholes.items():
        result = rule.whole(whole.view(matrices[k].param.shape), matrices[k].hyper)
        try:
            check_whole(rule, result, matrices[k].param, optimizer)
        except (TypeError, ValueError) as error:
            failed = failed or error
            continue
        results[k] = result.reshape(-1).to(wire)  # exact: Muon's result is bf16, a registered rule's fp32
    shapes = {tuple(m.param.shape) for m in matrices}
    if not shapes <= checked:  # a shape not seen before: every rank learns whether an owner's result was wrong
        agree([] if failed is None else [f"{type(failed).__name__}: {failed}"], group, _raised_alike, quick=True)
        checked.update(shapes)
    elif failed is not None:
        raise failed
    received, at = _from_owners(matrices, results, owner, rank, world, group, device, wire)
    back, arrived = received, None
    if home != device:  # the results cross back in one copy, which the finish waits for
        back = _buffer(received.numel(), wire, home, pin=device.type == "cuda")
        back.copy_(received, non_blocking=True)
        if device.type == "cuda":
            arrived = torch.cuda.Event()
            arrived.record(torch.cuda.current_stream(device))

    def finish() -> None:
        if arrived is not None:
            arrived.synchronize()
        applies, copied = [], []
        for k, m in enumerate(matrices):
            if m.view is None:
                continue
            update = back[at[k] : at[k] + m.view.numel()]
            if fused:
                assert kernel is not None and m.span is not None
                decay, lr = MuonRule.scales(m.hyper, m.param.shape)
                copy = source.kernel_copy(m.unit)  # the updated master rounded to bf16 there too: its publish
                working = copy[m.span] if copy is not None else None
                applies.append(kernel.muon_apply(m.view, update, decay=decay, lr=lr, working=working))
                if working is not None:
                    copied.append((m.unit, m.span))
            else:
                rule.apply(m.view, update.to(m.view.device), m.hyper, m.param.shape)
        if applies:
            assert kernel is not None
            kernel.run_muon(applies)  # back and the views outlive the call
        for unit, span in copied:  # once the run wrote them
            source.copied(unit, [span])

    return finish


def _done() -> None:
    """The finish of a matrix step with no matrices."""


def _buffer(n: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A buffer of ``n`` elements on ``device``, pinned where asked (a GPU copies to or from it)."""
    return torch.empty(n, dtype=dtype, device=device, pin_memory=pin and device.type == "cpu")


def _blend(
    rule: MatrixRule,
    matrices: list[_Matrix],
    owner: list[int],
    rank: int,
    world: int,
    wire: torch.dtype,
    home: torch.device,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    kernel: Optional[HostAdam],
) -> torch.Tensor:
    """This rank's blended segments, in ``wire`` dtype, in one buffer on the segments' side (``home``),
    ordered by their matrices' owners (rank 0's first), as ``_to_owners`` sends them. ``kernel``: Muon's
    blend in the host kernel, one call for all segments; else the rule's ``blend`` with torch's ops."""
    order = [k for d in range(world) for k, m in enumerate(matrices) if owner[k] == d and m.view is not None]
    send = _buffer(sum(matrices[k].counts[rank] for k in order), wire, home, pin=device.type == "cuda")
    jobs, at = [], 0
    for k in order:
        m = matrices[k]
        assert m.view is not None and m.grad is not None
        n = m.view.numel()
        state = optimizer.state[m.view]
        if kernel is not None:
            momentum, nesterov = float(m.hyper["momentum"]), bool(m.hyper["nesterov"])
            jobs.append(
                kernel.muon_blend(
                    MuonRule.momentum_buffer(m.view, state),
                    m.grad,
                    send[at : at + n],
                    momentum=momentum,
                    nesterov=nesterov,
                    gmul=m.gmul,
                )
            )
        else:
            grad = m.grad.float() if m.gmul == 1.0 else m.grad.float() * m.gmul
            send[at : at + n].copy_(rule.blend(m.view, grad, state, m.hyper))
        at += n
    if jobs:
        assert kernel is not None
        kernel.run_muon(jobs)
    return send


def owners(shapes: Sequence[tuple[int, ...]], world: int, first: int = 0) -> list[int]:
    """Which rank transforms each matrix: the largest first (by the Newton-Schulz cost, rows x cols x
    the smaller of the two), each to the rank with the least cost so far, ties to the first such rank
    counting from rank ``first % world`` (the batch's first unit: a step of one unit at a time, as with
    offload, spreads its units over the ranks); the same on every rank, from the shapes alone."""
    load = [0] * world
    owner = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda k: (-_cost(shapes[k]), k))
    for k in order:
        r = min(range(world), key=lambda r: (load[r], (r - first) % world))
        owner[k] = r
        load[r] += _cost(shapes[k])
    return owner


def _cost(shape: tuple[int, ...]) -> int:
    rows, cols = shape[0], shape[1]
    return rows * cols * min(rows, cols)


def _to_owners(
    flat_send: torch.Tensor,
    matrices: list[_Matrix],
    owner: list[int],
    rank: int,
    world: int,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    wire: torch.dtype,
) -> dict[int, torch.Tensor]:
    """Every rank's segments of the blended updates (``flat_send``: this rank's, on ``device``, by
    owner), sent to their owners: this rank's own matrices whole (flat, ``wire`` dtype, on ``device``),
    by position in ``matrices``."""
    by_dest = [[k for k, m in enumerate(matrices) if owner[k] == d and m.view is not None] for d in range(world)]
    in_splits = [sum(matrices[k].counts[rank] for k in by_dest[d]) for d in range(world)]
    mine = [k for k in range(len(matrices)) if owner[k] == rank]
    out_splits = [sum(matrices[k].counts[s] for k in mine) for s in range(world)]
    received = torch.empty(sum(out_splits), dtype=wire, device=device)
    comm.all_to_all_uneven(received, flat_send, out_splits, in_splits, group)
    wholes = {k: torch.empty(matrices[k].param.numel(), dtype=wire, device=device) for k in mine}
    at = 0
    for s in range(world):  # from rank s: its segment of each of my matrices, in order
        for k in mine:
            n = matrices[k].counts[s]
            if n:
                start = sum(matrices[k].counts[:s])  # the segments lie in rank order within the matrix
                wholes[k][start : start + n].copy_(received[at : at + n])
                at += n
    return wholes


def _from_owners(
    matrices: list[_Matrix],
    results: dict[int, torch.Tensor],
    owner: list[int],
    rank: int,
    world: int,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    wire: torch.dtype,
) -> tuple[torch.Tensor, dict[int, int]]:
    """Each owner's results, sent back: one buffer on ``device`` holding this rank's segment of each
    matrix it holds one of, and where each begins in it (by position in ``matrices``)."""
    pieces = []
    in_splits = []
    for d in range(world):  # to rank d: its segment of each of my matrices
        n_to_d = 0
        for k in sorted(results):
            n = matrices[k].counts[d]
            if n:
                start = sum(matrices[k].counts[:d])
                pieces.append(results[k][start : start + n])
                n_to_d += n
        in_splits.append(n_to_d)
    flat_send = torch.cat(pieces) if pieces else torch.empty(0, dtype=wire, device=device)
    holding = [k for k, m in enumerate(matrices) if m.counts[rank]]
    out_splits = [sum(matrices[k].counts[rank] for k in holding if owner[k] == s) for s in range(world)]
    received = torch.empty(sum(out_splits), dtype=wire, device=device)
    comm.all_to_all_uneven(received, flat_send, out_splits, in_splits, group)
    starts: dict[int, int] = {}
    at = 0
    for s in range(world):
        for k in holding:
            if owner[k] == s:
                starts[k] = at
                at += matrices[k].counts[rank]
    return received, starts


def _raised_alike(by_rank: list[list[str]]) -> Exception:
    """The first rank's wrong shape, as the owner's check raised it (``check_whole``: a TypeError or a ValueError)."""
    kind, _, message = next(error for errors in by_rank for error in errors).partition(": ")
    return TypeError(message) if kind == "TypeError" else ValueError(message)


@functools.lru_cache(maxsize=None)
def _segment_numels(layout: UnitLayout) -> list[list[int]]:
    """Per parameter of the unit, the elements of it each rank's shard holds (0 where none)."""
    counts = [[0] * layout.world_size for _ in layout.slots]
    for rank in range(layout.world_size):
        for seg in layout.segments(rank):
            counts[seg.param][rank] = seg.numel
    return counts
