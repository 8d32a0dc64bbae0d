"""The host memory an offload configuration needs, checked before it is allocated: a configuration the
host cannot hold stops with one line naming the need, what is available and the fix, on every rank,
before any step (not the kernel's OOM killer half-way through the first one).

[Note: host bytes per element]
Per element of this rank's shard of the units stepped on the host (``offload_optimizer``, CPU):

- the fp32 master, 4 bytes;
- the buffer the reduced gradient lands in: with bf16 working weights a bf16 buffer, 2, which the host
  kernel reads as it is; an fp32 buffer, 4, otherwise, and also beside the bf16 one where a window
  sums several backward passes (accumulation) or an optimizer other than the kernel's reads the
  gradient (counted when the optimizer is attached where that is known: a Trainer with
  ``accumulate_grad_batches`` above 1; else checked when the buffers are first made);
- with bf16 working weights, the host kernel's bf16 copy of the updated master, 2 (none for stage 3's
  transient units with their parameters on the host: the kernel writes it into their buffer);
- the optimizer state, counted when the optimizer is attached: torch's Adam and AdamW 8 (two fp32
  moments), SGD with momentum 4; other optimizers are not counted;
- ``offload_speculative_step``: the spare buffers, 12 (made for every host unit at the first window that can speculate).

With the optimizer on NVMe the host keeps the gradient buffers; masters and state are
on the disk, whose room the swap space checks when it reserves its files, and in the step's buffers
while a unit steps: per unit size, at most ``nvme.UNITS_IN_FLIGHT`` units' master and state
(``nvme.step_buffer_elements``: the one stepping, the one read ahead, the writes behind). Stage-3 parameters on the host
(``offload_parameters``) rest in a buffer of the payload's dtype per transient unit: 2 bytes per element
in bf16, about 1.06 with INT8 weights.

Several ranks on one host each need their share: the check multiplies by the ranks on this node. What
is available is read once, before any rank of the engine allocates: the kernel's ``MemAvailable``, or
less where a cgroup limits the process (``memory.max`` less ``memory.current``). Where a host's memory
grows as it is used (a virtual machine's balloon) that undercounts: ``host_memory_budget`` then says how
much this node's ranks may use.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from lightning_zeroq.config import host_budget
from lightning_zeroq.zero.frozen import FrozenNeed
from lightning_zeroq.zero.layout import UnitLayout
from lightning_zeroq.zero.memory import device as device_memory
from lightning_zeroq.zero.offload.nvme import step_buffer_elements
from lightning_zeroq.zero.offload.split import host_units
from lightning_zeroq.zero.optim.binding import adam_kind
from lightning_zeroq.zero.optim.matrix import is_matrix_optimizer
from lightning_zeroq.zero.policies import Auto, Host, Nvme, Offload, OnDevice

GiB = 2**30


class HostMemoryError(RuntimeError):
    """The host cannot hold what the offload configuration puts there."""


@dataclass
class HostNeed:
    """What this rank puts in host memory, by kind (bytes), and the elements of its host units."""

    parts: dict[str, int] = field(default_factory=dict)
    host_elements: int = 0
    """Elements of this rank's segments of the units stepped on the host (the optimizer state's count:
    the shards' padding has none)."""
    swap_elements: int = 0
    """With the optimizer on NVMe: the elements of each step buffer kind (master, each state key) held at
    once while units swap (``nvme.step_buffer_elements``)."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def text(self) -> str:
        return ", ".join(f"{name} {size(nbytes)}" for name, nbytes in self.parts.items() if nbytes)


def size(nbytes: float) -> str:
    """``71.2 GiB``, ``512.0 MiB``, ``12.0 KiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str
    """Where the figure comes from (``MemAvailable``, a cgroup's limit, ``host_memory_budget``)."""


def engine_need(
    offload: Offload,
    layouts: Sequence[UnitLayout],
    rank: int,
    param_dtype: torch.dtype,
    payload: dict[int, tuple[int, torch.dtype]],
    frozen_bytes: int = 0,
) -> HostNeed:
    """The host memory the engine allocates for shard ``rank`` (``payload``: stage 3's transient units,
    index -> (payload elements, dtype), rested on the host with ``offload.parameters`` Host; ``frozen_bytes``:
    this rank's stored frozen shards, ``zero/frozen.py``, on the host with any parameter offload)."""
    need = HostNeed()
    policy = offload.optimizer
    if isinstance(policy, OnDevice):
        on_host: frozenset[int] = frozenset()
    elif isinstance(policy, Host):
        on_host = host_units(layouts, policy.ratio, policy.last_first)
    else:  # Auto starts with every unit on the host; Nvme keeps every unit's gradient buffers there
        on_host = frozenset(range(len(layouts)))
    elements = sum(layouts[i].shard_numel for i in on_host)
    half = param_dtype == torch.bfloat16
    params_on_host = isinstance(offload.parameters, Host)
    resident = on_host
    if isinstance(policy, Nvme):  # only the units not swapped keep master and state in host memory
        swapped = host_units(layouts, policy.ratio)
        resident = on_host - swapped
        need.swap_elements = step_buffer_elements([layouts[i].shard_numel for i in swapped])
        need.parts["NVMe step buffers (masters)"] = 4 * need.swap_elements
    if resident:
        need.host_elements = sum(seg.numel for i in resident for seg in layouts[i].segments(rank))
        need.parts["fp32 masters"] = 4 * sum(layouts[i].shard_numel for i in resident)
    need.parts["bf16 gradient buffers" if half else "fp32 gradient buffers"] = (2 if half else 4) * elements
    if half and isinstance(policy, (Host, Auto, Nvme)):  # stage 3's host buffers hold a transient unit's copy
        copied = (i for i in on_host if not (params_on_host and i in payload))
        need.parts["bf16 copies of the masters"] = 2 * sum(layouts[i].shard_numel for i in copied)
    if params_on_host:
        need.parts["stage-3 parameters"] = sum(n * dtype.itemsize for n, dtype in payload.values())
    if frozen_bytes and not isinstance(offload.parameters, OnDevice):
        need.parts["frozen shards"] = frozen_bytes
    return need


ACTIVATIONS = "offloaded activations"
"""The host need's kind for activation offload's pinned buffers (``zero/activation_offload.py``): the storages
its blocks save, each in a buffer at most 1/8 larger (``HostPool``), counted as the pool grows and planned from
the traced forward (``planning/estimate.py``)."""


def activations_host_bytes(moved: int) -> int:
    """The host memory planned for ``moved`` bytes of offloaded activations: 9/8 of them, each buffer's class
    being at most 1/8 larger (``HostPool``)."""
    return moved + moved // 8


ADAM_STATE_BYTES = 8
"""Adam's two fp32 moments per parameter element."""


def state_bytes_per_element(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """The optimizer state per parameter element (fp32): Adam's two moments, SGD's momentum."""
    per_element = 0
    for optimizer in optimizers:
        if adam_kind(optimizer) is not None:
            per_element = max(per_element, ADAM_STATE_BYTES)
        elif isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
            per_element = max(per_element, 4)
    return per_element


def optimizer_need(
    optimizers: Sequence[torch.optim.Optimizer],
    host_elements: int,
    speculative: bool,
    swap_elements: int = 0,
    state_bytes: Optional[int] = None,
) -> HostNeed:
    """The host memory the attached optimizers' state (and speculative spare buffers) will take
    (``state_bytes``: per element, else ``optim/binding.py``'s; ``swap_elements``: ``HostNeed.swap_elements``)."""
    need = HostNeed(host_elements=host_elements, swap_elements=swap_elements)
    per_element = state_bytes_per_element(optimizers) if state_bytes is None else state_bytes
    need.parts["optimizer state"] = per_element * host_elements
    if swap_elements:
        need.parts["NVMe step buffers (optimizer state)"] = per_element * swap_elements
    if speculative:
        need.parts["speculative spare buffers"] = 12 * host_elements
    return need


def available(budget: Any) -> Optional[Available]:
    """What this node's ranks may put in host memory: ``budget`` (``host_memory_budget``: GiB, or a share
    of the host's memory as ``"N%"``) or what the host reports available; None where it cannot tell."""
    form = host_budget(budget)
    if form is not None:
        number, share = form
        total = _meminfo("MemTotal") if share else None
        if share and total is None:
            return None
        nbytes = int(number / 100 * total) if total is not None else int(number * GiB)
        return Available(nbytes, f"host_memory_budget={budget!r}")
    free = _meminfo("MemAvailable")
    if free is None:
        return None
    limited = _cgroup_room()
    if limited is not None and limited < free:
        return Available(limited, "the cgroup's memory limit less its use")
    return Available(free, "MemAvailable")


RATIO_STEP = 0.05
"""The steps of ``offload_optimizer_nvme_ratio`` the nearest fitting configuration is looked for in."""


def nearest_fit(offload: Offload, total: Callable[[Offload], int], room: int) -> Optional[tuple[str, int]]:
    """The nearest configuration to ``offload`` whose host need (``total``: this node's bytes under an
    offload policy, the optimizer's state included) fits ``room``, as the options to set and its bytes:
    without speculative spares; then the smallest share of the optimizer state swapped to NVMe
    (``offload_optimizer_nvme_ratio`` in steps of ``RATIO_STEP``); None if none does."""
    if offload.speculative:
        need = total(dataclasses.replace(offload, speculative=False))
        if need <= room:
            return "offload_speculative_step=False", need
        offload = dataclasses.replace(offload, speculative=False)
    policy = offload.optimizer
    if isinstance(policy, (Host, Auto)) or (isinstance(policy, Nvme) and policy.ratio < 1):
        path = policy.path if isinstance(policy, Nvme) else ""
        start = policy.ratio if isinstance(policy, Nvme) else 0.0
        for k in range(1, round(1 / RATIO_STEP) + 1):
            ratio = round(k * RATIO_STEP, 2)
            if ratio <= start:
                continue
            need = total(dataclasses.replace(offload, optimizer=Nvme(path or ".", ratio)))
            if need <= room:
                where = "" if path else ", nvme_path=<a local disk>"
                share = f", offload_optimizer_nvme_ratio={ratio}" if ratio < 1 else ""
                return f"offload_optimizer_device='nvme'{where}{share}", need
    return None


def check(
    need: HostNeed,
    room: Optional[Available],
    ranks_on_node: int,
    what: str,
    nearest: Optional[tuple[str, int]] = None,
    with_adam: bool = False,
    fix: Optional[str] = None,
) -> None:
    """Raise ``HostMemoryError`` (one line) if ``ranks_on_node`` ranks needing ``need`` each do not fit;
    ``nearest``: the nearest configuration that fits (``nearest_fit``), named as the fix (``with_adam``:
    found for Adam's state, no optimizer being attached yet); ``fix``: what to do instead, where no nearest is
    named (``"offload fewer blocks, "``)."""
    if room is None or need.total == 0:
        return
    total = need.total * ranks_on_node
    if total <= room.bytes:
        return
    ranks = f"{ranks_on_node} ranks x {size(need.total)}" if ranks_on_node > 1 else "1 rank"
    fix = (
        f"the nearest that fits{' with Adam' if with_adam else ''} is {nearest[0]} ({size(nearest[1])} on this "
        "node); or, "
        if nearest is not None
        else fix
        if fix is not None
        else "offload less (offload_optimizer_ratio below 1, or no offload_parameters), put the optimizer on "
        "NVMe (offload_optimizer_device='nvme'), spread the model over more nodes, or, "
    )
    raise HostMemoryError(
        f"ZeroConfig: {what} needs {size(total)} of host memory on this node ({ranks}: {need.text()}) "
        f"and {size(room.bytes)} is available ({room.source}); {fix}where this host's memory grows as it is "
        "used, set host_memory_budget (GiB) to what it can hold."
    )


def ranks_on_node(ranks_per_node: Optional[int]) -> int:
    """The ranks that share this host's memory: the strategy's count, else torchrun's ``LOCAL_WORLD_SIZE``."""
    if ranks_per_node is not None:
        return ranks_per_node
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else 1


def _meminfo(key: str) -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == key:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> Optional[int]:
    """Bytes this process's cgroup may still take (v2, then v1); None without a limit."""
    pairs = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ]
    for limit_path, used_path in pairs:
        try:
            limit_text = Path(limit_path).read_text().strip()
            used = int(Path(used_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit_text.isdigit() or int(limit_text) >= 2**60:
            return None  # "max", or v1's "unlimited" (a number near 2**63)
        return max(0, int(limit_text) - used + _reclaimable(Path(used_path).parent))
    return None


def _reclaimable(cgroup: Path) -> int:
    """The cgroup's inactive file cache (counted in its use, given back under pressure)."""
    try:
        for line in (cgroup / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class _Build(NamedTuple):
    """What the engine's build gives the checks: its unit layouts, this rank, the working dtype, and stage
    3's transient units with their payload (elements, dtype)."""

    layouts: Sequence[UnitLayout]
    rank: int
    param_dtype: torch.dtype
    payload: dict[int, tuple[int, torch.dtype]]
    frozen: FrozenNeed = device_memory.NO_FROZEN

    @property
    def persistent(self) -> list[bool]:
        return [i not in self.payload for i in range(len(self.layouts))]


class HostBudget:
    """The engine's host memory: what is available, read when the engine is built (before any rank
    allocates), and the checks of what the build, the attached optimizers and, later, fp32 gradient
    buffers put there; with them, the device's share of the model's state (``memory/device.py``)."""

    def __init__(self, offload: Offload, ranks_per_node: Optional[int]) -> None:
        self.offload, self.ranks = offload, ranks_on_node(ranks_per_node)
        self.room = available(offload.host_budget)
        self.need = HostNeed()
        """What this rank put on the host so far (counted)."""
        self.accumulates: Optional[bool] = None
        """Whether windows sum several backward passes (the Lightning strategy knows; None: unknown)."""
        self._build: Optional[_Build] = None
        """The build's layouts and payloads: the device check counts from them again when the optimizer
        comes, and both checks count other configurations from them for the nearest that fits."""
        self._room: Optional[int] = None
        """The device's memory (None off CUDA: nothing to check)."""

    def built(
        self,
        layouts: Sequence[UnitLayout],
        rank: int,
        param_dtype: torch.dtype,
        payload_dtype: torch.dtype,
        transient: dict[int, int],
        placement: Any,
        frozen: FrozenNeed = device_memory.NO_FROZEN,
    ) -> None:
        """Check the build's need (``transient``: stage 3's units with their payload's elements; ``frozen``:
        stage 3's frozen parts) and watch the placement's fp32 gradient buffers."""
        payload = {i: (n, payload_dtype) for i, n in transient.items()}
        self.need = engine_need(self.offload, layouts, rank, param_dtype, payload, frozen.stored_bytes)
        self._build = _Build(layouts, rank, param_dtype, payload, frozen)
        check(
            self.need,
            self.room,
            self.ranks,
            "this offload configuration",
            self._nearest(self.need, self.room, ADAM_STATE_BYTES),
            with_adam=True,
        )
        self._room = device_memory.capacity(placement.device)
        self._check_device(0, "this configuration's state")
        landing = getattr(getattr(placement, "host", placement), "landing", None)
        if landing is not None:
            landing.before_fp32 = self._fp32_buffers

    def attached(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Before the optimizers' state is made: it must fit beside what the build allocated."""
        need = optimizer_need(optimizers, self.need.host_elements, self.offload.speculative, self.need.swap_elements)
        matrix = [o for o in optimizers if is_matrix_optimizer(o)]
        kernel_reads_all = all(adam_kind(o) is not None for o in optimizers) and _kernel_loads()
        if matrix and self.need.host_elements and self._build is not None:
            # A matrix step of host units: each unit's blended segments and results in pinned buffers, two units
            # in flight (``optim.matrix.start_matrices``), each buffer at most the largest shard in fp32, and
            # pinned memory comes in powers of two.
            largest = max((layout.shard_numel for layout in self._build.layouts), default=0)
            need.parts["matrix optimizer staging buffers"] = 4 * _power_of_two(4 * largest)
        half = self.need.parts.get("bf16 gradient buffers", 0)  # bf16 weights: fp32 buffers only where read
        if half and (self.accumulates or not kernel_reads_all):
            need.parts["fp32 gradient buffers"] = 2 * half
        for name in (
            "optimizer state",
            "speculative spare buffers",
            "NVMe step buffers (optimizer state)",
        ):  # another optimizer's
            self.need.parts.pop(name, None)
        self._check_more(need, "the optimizer's state on the host", state_bytes_per_element(optimizers))
        self.need.parts.update(need.parts)
        self._check_device(state_bytes_per_element(optimizers), "this configuration's state with the optimizer's")

    def _check_device(self, state_bytes: int, what: str) -> None:
        build, room = self._build, self._room
        if build is None or room is None:
            return
        shape = (build.layouts, build.persistent, self.offload, build.param_dtype)
        kinds = device_memory.device_kinds(*shape, state_bytes, build.rank, build.payload, build.frozen)
        nearest = None
        if sum(kinds.values()) > room:  # at the build no optimizer is attached yet: the fix allows for Adam's state
            nearest = device_memory.nearest_fit(
                *shape, state_bytes or ADAM_STATE_BYTES, build.rank, build.payload, room, build.frozen
            )
        device_memory.check(kinds, room, what, nearest, with_adam=state_bytes == 0)

    def _fp32_buffers(self, nbytes: int) -> None:
        """The landing makes its fp32 buffers (a window of several backward passes, an fp32 reader)."""
        if "fp32 gradient buffers" in self.need.parts:
            return  # counted already
        need = HostNeed({"fp32 gradient buffers": nbytes})
        self._check_more(need, "summing several backward passes on the host (fp32 gradient buffers)")
        self.need.parts.update(need.parts)

    def activations(self, nbytes: int) -> None:
        """Activation offload's host buffers are about to hold ``nbytes`` (``activation_offload.HostPool``): it
        must fit beside what the engine holds, or one line says so before they are made."""
        held = self.need.parts.get(ACTIVATIONS, 0)
        if nbytes <= held:
            return
        fix = (
            "offload the activations of fewer blocks (activation_offloading_policy naming fewer modules, or "
            "activation_offloading_policy='auto' with activation_checkpointing_policy='auto', which plans the "
            "host's room), recompute them (activation_checkpointing_policy), use a smaller micro-batch, or, "
        )
        self._check_more(HostNeed({ACTIVATIONS: nbytes - held}), "offloading activations (host buffers)", fix=fix)
        self.need.parts[ACTIVATIONS] = nbytes

    def _check_more(
        self, need: HostNeed, what: str, state_bytes: Optional[int] = None, fix: Optional[str] = None
    ) -> None:
        """``need`` beside what this engine holds already (``state_bytes``: the optimizer's per element,
        for the nearest configuration that fits; ``fix``: what to do where none is found)."""
        if self.offload.host_budget is not None:  # the budget, read at the build, less what the engine holds
            held = self.need.total * self.ranks
            room = (
                None
                if self.room is None
                else Available(self.room.bytes - held, f"{self.room.source} less the {size(held)} the engine holds")
            )
        else:
            room = available(None)  # what this engine allocated is in use already
        nearest = None
        if state_bytes is not None and room is not None:  # the whole need against what the engine could have
            whole = Available(room.bytes + self.need.total * self.ranks, room.source)
            nearest = self._nearest(need, whole, state_bytes, with_held=True)
        check(need, room, self.ranks, what, nearest, fix=fix)

    def _nearest(
        self, need: HostNeed, room: Optional[Available], state_bytes: int, with_held: bool = False
    ) -> Optional[tuple[str, int]]:
        """The nearest configuration whose need, with ``state_bytes`` of optimizer state per host element,
        fits ``room`` (only asked when ``need``, with what the engine holds if ``with_held``, does not)."""
        if room is None or self._build is None:
            return None
        held = self.need.total if with_held else 0
        if (held + need.total) * self.ranks <= room.bytes:
            return None
        build = self._build

        def total(offload: Offload) -> int:
            other = engine_need(offload, build.layouts, build.rank, build.param_dtype, build.payload)
            state = optimizer_need([], other.host_elements, offload.speculative, other.swap_elements, state_bytes)
            return (other.total + state.total) * self.ranks

        return nearest_fit(self.offload, total, room.bytes)


def _kernel_loads() -> bool:
    from lightning_zeroq.ops.host_adam import host_adam

    return host_adam() is not None


def _power_of_two(nbytes: int) -> int:
    """What torch's pinned allocator takes for ``nbytes`` (the next power of two)."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0
