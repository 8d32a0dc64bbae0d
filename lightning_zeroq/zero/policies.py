"""The engine's settings as small frozen policies, made once from the user's ``ZeroConfig``.

``ZeroConfig`` is what users write (flat, DeepSpeed's names, validated field by field). The engine
reads it here only, at its front door: ``from_config`` turns it into one ``Policies``, and every
part of the engine reads the policy it needs (the plan its units, the offload module its placement,
the wires their quantization, the step its loss scaling), never the config. A policy says what was
asked for in the engine's terms; what it means for the hardware (groups, stores, wires) is built
from it by the part that owns it.

- ``Sharding``: the stage, its units (``Buckets`` in stages 1/2, ``ModuleUnits`` in stage 3), the
  shard group size; from ``stage``, ``reduce_bucket_size``, ``stage3_*``, ``reshard_after_forward``,
  ``shard_group_size``, ``overlap_comm``, ``managed_gradient_accumulation``.
- ``Offload``: ``optimizer`` and ``parameters``, each ``OnDevice``, ``Host(ratio)`` or ``Nvme(path)``,
  the optimizer also ``Auto(budget)``, and whether host steps are ``speculative`` or ``asynchronous``; from ``offload_*``
  and ``nvme_path``.
- ``Quantization``: INT8 weights and gradients; from ``quantized_*``, ``allgather_bucket_size``,
  ``quantize_cross_group_only``.
- ``Numerics``: fp16 loss scaling and what non-finite gradients do; from ``loss_scale``,
  ``initial_scale_power``, ``loss_scale_window``, ``min_loss_scale``, ``nonfinite_gradients``.
- ``settings``: every field as given, which all ranks must agree on (``agreement.py``), less the
  ones that may differ by rank (``RANK_LOCAL``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_zeroq.config import ZeroConfig


@dataclass(frozen=True)
class Buckets:
    """Stages 1/2: units of consecutive trainable parameters of at most ``numel`` elements, always gathered."""

    numel: int


@dataclass(frozen=True)
class ModuleUnits:
    """Stage 3: units that follow modules, gathered before use and freed after."""

    wrap_classes: Optional[tuple[str, ...]]
    """Class names of the modules that become units (None: the repeated blocks, found automatically)."""
    unit_size: Optional[int]
    """Instead of classes: any module whose not-yet-wrapped parameters reach this many elements."""
    persistence_threshold: int
    """Parameters of at most this many elements stay gathered."""
    prefetch_depth: int
    """Units gathered ahead of the recorded order (0: no prefetch)."""
    reshard_after_forward: bool


@dataclass(frozen=True)
class Sharding:
    stage: int
    units: Union[Buckets, ModuleUnits]
    group_size: Union[None, int, str]
    """Ranks per shard group (hybrid sharding); None: all ranks; ``"node"`` must be resolved before."""
    overlap_comm: bool
    managed_accumulation: bool
    """The caller says which backward ends a window (``pre_backward(boundary=True)``)."""


@dataclass(frozen=True)
class OnDevice:
    """Nothing offloaded."""


@dataclass(frozen=True)
class Host:
    """Offloaded to host memory; for the optimizer, units up to ``ratio`` of the parameters: the largest
    first, or with ``last_first`` the last units first (``split.host_units``)."""

    ratio: float = 1.0
    last_first: bool = False
    """Host steps that overlap the backward or the next forward (speculative, asynchronous): the units
    whose gradients land first and which the next forward needs last go to the host, the first units
    (the embedding, needed first and landed last) stay on the device."""


@dataclass(frozen=True)
class Nvme:
    """Swapped to files under ``path``; for the optimizer, the largest units up to ``ratio`` of the
    parameters (the others stay in host memory)."""

    path: str
    ratio: float = 1.0


@dataclass(frozen=True)
class Auto:
    """Optimizer state starts on the host; after the first step, what fits in ``budget`` comes back
    (``ZeroConfig.offload_memory_budget``'s form, resolved against the device by ``memory_budget``)."""

    budget: Any


@dataclass(frozen=True)
class Offload:
    optimizer: Union[OnDevice, Host, Nvme, Auto]
    """Where fp32 masters and optimizer state live."""
    parameters: Union[OnDevice, Host, Nvme]
    """Where stage 3 rests a transient unit's shard between gathers."""
    speculative: bool = False
    """Host units step during the backward, undone where the window's checks say otherwise (host or
    auto optimizer offload, no loss scaling, managed accumulation)."""
    asynchronous: bool = False
    """The host step runs beside the next forward, which waits per unit (every unit on the host)."""
    host_budget: Any = None
    """``ZeroConfig.host_memory_budget``: the host memory this node's ranks may fill (None: what is available)."""


@dataclass(frozen=True)
class Quantization:
    weights: bool
    """Gather weights as INT8 groups (inside a shard group; see ``hybrid.Topology``)."""
    gradients: bool
    """Reduce gradients as INT8 groups."""
    cross_group_only: bool
    """With hybrid groups, INT8 only on the gradients' sum across groups."""
    group_size: int
    """Elements per INT8 group (one fp32 scale each), for weights and gradients."""
    exact_numel: int
    """Weight tensors of at most this many elements travel exactly, beside the INT8 payload."""
    gather_bucket_numel: int
    """Upper bound of the weights gathered in one INT8 collective (elements, all ranks together)."""

    @property
    def any(self) -> bool:
        return self.weights or self.gradients


@dataclass(frozen=True)
class LossScaling:
    """fp16 loss scaling: a fixed scale, or dynamic from ``initial_scale``."""

    fixed_scale: Optional[float]
    """None: dynamic."""
    initial_scale: float
    growth_interval: int
    min_scale: float


@dataclass(frozen=True)
class Numerics:
    loss_scaling: Optional[LossScaling]
    """None: no loss scaling (fp32, bf16)."""
    nonfinite_gradients: str
    """``"error"`` or ``"skip"``: what a step does with inf or NaN gradients outside loss scaling."""


@dataclass(frozen=True)
class Policies:
    sharding: Sharding
    offload: Offload
    quantization: Quantization
    numerics: Numerics
    ineffective: tuple[str, ...]
    """One sentence per setting that cannot take effect (the engine warns about each once)."""
    recompute: tuple[str, ...] = ()
    """Class names of the modules that recompute their forward in the backward (``recompute.py``)."""
    settings: tuple[tuple[str, str], ...] = ()
    """``(field, repr of its value)`` of every field that must be the same on every rank."""


RANK_LOCAL = ("nvme_path", "offload_memory_budget", "host_memory_budget")
"""Fields that may differ by rank: a node's own NVMe mount; the memory budget, which ranks agree on
themselves (the worst rank's decides, ``offload/auto.py``); a node's own host memory."""


def from_config(config: ZeroConfig, *, loss_scaling: bool) -> Policies:
    """The policies ``config`` asks for (``loss_scaling``: the precision is fp16 with loss scaling)."""
    c = config
    units: Union[Buckets, ModuleUnits] = Buckets(c.reduce_bucket_size)
    if c.stage == 3:
        units = ModuleUnits(
            wrap_classes=tuple(c.stage3_wrap_classes) if c.stage3_wrap_classes is not None else None,
            unit_size=c.stage3_unit_size,
            persistence_threshold=c.stage3_param_persistence_threshold,
            prefetch_depth=c.stage3_prefetch_depth if c.stage3_prefetch else 0,
            reshard_after_forward=c.reshard_after_forward,
        )
    sharding = Sharding(c.stage, units, c.shard_group_size, c.overlap_comm, c.managed_gradient_accumulation)
    quantization = Quantization(c.quantized_weights, c.quantized_gradients, c.quantize_cross_group_only,
                                c.quantized_weights_group_size, c.quantized_weights_exact_numel,
                                c.allgather_bucket_size)
    scaling = None
    if loss_scaling:
        scaling = LossScaling(float(c.loss_scale) if c.loss_scale > 0 else None, 2.0 ** c.initial_scale_power,
                              c.loss_scale_window, float(c.min_loss_scale))
    settings = tuple((f.name, repr(getattr(c, f.name))) for f in dataclasses.fields(c) if f.name not in RANK_LOCAL)
    return Policies(sharding, _offload(c, loss_scaling), quantization, Numerics(scaling, c.nonfinite_gradients),
                    tuple(c.ineffective(loss_scaling)), settings=settings,
                    recompute=tuple(c.activation_checkpointing_policy or ()))


def _offload(c: ZeroConfig, loss_scaling: bool) -> Offload:
    optimizer: Union[OnDevice, Host, Nvme, Auto] = OnDevice()  # also with ratio 0, which offloads nothing
    if c.offload_optimizer and c.offload_optimizer_device == "nvme":
        assert c.nvme_path is not None  # ZeroConfig checks it (and that the ratio is 1)
        optimizer = Nvme(c.nvme_path, c.offload_optimizer_nvme_ratio)
    elif c.offload_optimizer and c.offload_optimizer_ratio == "auto":
        optimizer = Auto(c.offload_memory_budget)
    elif c.offload_optimizer and c.offload_optimizer_ratio > 0.0:
        optimizer = Host(c.offload_optimizer_ratio, last_first=c.offload_speculative_step or c.offload_async_step)
    parameters: Union[OnDevice, Host, Nvme] = OnDevice()
    if c.offload_parameters and c.offload_params_device == "nvme":
        assert c.nvme_path is not None
        parameters = Nvme(c.nvme_path)
    elif c.offload_parameters:
        parameters = Host()
    speculative = (c.offload_speculative_step and isinstance(optimizer, (Host, Auto)) and not loss_scaling
                   and c.managed_gradient_accumulation)
    asynchronous = c.offload_async_step and isinstance(optimizer, Host)
    return Offload(optimizer, parameters, speculative, asynchronous, c.host_memory_budget)
