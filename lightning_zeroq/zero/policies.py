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
- ``recompute`` and ``ActivationOffloading``: the modules that recompute their forward, and those whose
  activations wait in host memory; from ``activation_checkpointing_policy``, ``activation_offloading_policy``,
  ``activation_offloading_min_bytes``.
- ``settings``: every field as given, which all ranks must agree on (``agreement.py``), less the
  ones that may differ by rank (``RANK_LOCAL``).
- ``ineffective``: one sentence per setting the policies leave out, written by the maker of the policy
  that decides it (``_sharding``, ``_quantization``, ``_offload``, ``_numerics``), so a rule and its
  warning cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

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
    frozen_dtype: Optional[str] = None
    """How frozen parameters rest (``ZeroConfig.frozen_dtype``; ``frozen.py``)."""


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
class ActivationOffloading:
    """What waits in host memory between a module's forward and its backward (``activation_offload.py``)."""

    modules: tuple[str, ...] = ()
    """Class names or qualified module names: what autograd saves in their forward (for modules that also
    recompute, their checkpoint inputs) goes to the host. Empty: nothing."""
    min_bytes: int = 1 << 20
    """Saved tensors whose storage holds fewer bytes stay on the device."""


@dataclass(frozen=True)
class Policies:
    sharding: Sharding
    offload: Offload
    quantization: Quantization
    numerics: Numerics
    ineffective: tuple[str, ...]
    """One sentence per setting that cannot take effect (the engine warns about each once)."""
    recompute: tuple[str, ...] = ()
    """Class names of the modules that recompute their forward in the backward (``activation_checkpoint.py``)."""
    activations: ActivationOffloading = ActivationOffloading()
    """The modules whose activations wait in host memory (``activation_offload.py``)."""
    settings: tuple[tuple[str, str], ...] = ()
    """``(field, repr of its value)`` of every field that must be the same on every rank."""


RANK_LOCAL = ("nvme_path", "offload_memory_budget", "host_memory_budget")
"""Fields that may differ by rank: a node's own NVMe mount; the memory budget, which ranks agree on
themselves (the worst rank's decides, ``offload/auto.py``); a node's own host memory."""


@dataclass(frozen=True)
class AutoRequest:
    """What ``offload="auto"`` and ``activation_checkpointing_policy="auto"`` leave to the plan
    (``planning/choose.py``), before the engine is built."""

    stage: int
    offload: bool
    """Decide optimizer offload (and its share), parameter offload (stage 3), NVMe spill."""
    recompute: bool
    """Decide how many of the repeated blocks recompute their forward."""
    nvme_path: Optional[str]
    device_budget: Any
    """``offload_memory_budget``'s form (None: the device's free memory less a margin)."""
    host_budget: Any
    recompute_classes: tuple[str, ...] = ()
    """With ``offload="auto"`` alone: the classes given to checkpoint (the plan counts them)."""
    activations: bool = False
    """Decide which of the repeated blocks keep their activations in host memory (``activation_offloading_policy``)."""


@dataclass(frozen=True)
class Chosen:
    """The plan's answer to an ``AutoRequest``."""

    optimizer: Union[OnDevice, Host, Nvme]
    parameters: Union[OnDevice, Host]
    recompute_share: float
    """Of the repeated blocks, the share that recomputes (the first ones in forward order, of those not offloaded)."""
    offload_share: float = 0.0
    """Of the repeated blocks, the share whose saved tensors wait in host memory, spread evenly over them
    (``activation_mix``)."""
    inputs_on_host: bool = False
    """The recomputing blocks keep their checkpoint inputs in host memory (DeepSpeed's ``cpu_checkpointing``)."""


def auto_request(config: ZeroConfig) -> Optional[AutoRequest]:
    """What the plan must decide for ``config``; None when nothing is left to it."""
    c = config
    recompute = c.activation_checkpointing_policy == "auto"
    activations = c.activation_offloading_policy == "auto"
    if c.offload != "auto" and not recompute and not activations:
        return None
    return AutoRequest(
        c.stage,
        c.offload == "auto",
        recompute,
        c.nvme_path,
        c.offload_memory_budget,
        c.host_memory_budget,
        () if recompute else tuple(c.activation_checkpointing_policy or ()),
        activations,
    )


def activation_mix(blocks: int, offload_share: float, recompute_share: float) -> tuple[list[int], list[int]]:
    """Which of ``blocks`` repeated blocks (forward order) offload their saved tensors and which recompute:
    ``round(offload_share * blocks)`` offloaded, spread evenly from the first (each one's copies overlap the
    compute of the blocks up to the next, in the forward and in the backward); of the rest, the first
    ``round(recompute_share * blocks)`` recompute."""
    k = min(blocks, round(offload_share * blocks))
    offloaded = sorted({i * blocks // k for i in range(k)}) if k else []
    rest = [i for i in range(blocks) if i not in set(offloaded)]
    return offloaded, rest[: min(len(rest), round(recompute_share * blocks))]


def resolve(
    config: ZeroConfig, chosen: Chosen, blocks: Sequence[str], *, correct: bool = True, offloaded: Sequence[str] = ()
) -> ZeroConfig:
    """``config`` with the plan's choice written into it (``blocks``: the class name of the repeated
    blocks, when all of them recompute; ``offloaded``: the qualified names of the blocks whose activations
    go to the host, with ``activation_offloading_policy="auto"``). With ``correct`` the share of the optimizer on the host becomes
    ``offload_optimizer_ratio="auto"`` (corrected from the first step's measured memory) unless a fixed
    share is needed (``offload_async_step``); without it (no device memory to measure), the share planned."""
    c, fields = config, dict[str, Any]()
    fixed = c.offload_async_step or not correct
    if c.offload == "auto":
        opt, budget = chosen.optimizer, c.offload_memory_budget
        fields.update(
            offload=None,
            offload_parameters=not isinstance(chosen.parameters, OnDevice),
            offload_optimizer=not isinstance(opt, OnDevice),
        )
        if isinstance(opt, Host):
            fields["offload_optimizer_ratio"] = opt.ratio if fixed else "auto"
        elif isinstance(opt, Nvme):
            fields.update(offload_optimizer_device="nvme", offload_optimizer_nvme_ratio=opt.ratio)
        if not isinstance(opt, Host) or fixed:
            budget = None  # what the plan fitted under it holds; nothing corrects later
        if not isinstance(opt, Host):  # asked for in case the optimizer went to the host; it did not
            fields.update(offload_speculative_step=False, offload_async_step=False)
        nvme = isinstance(opt, Nvme)
        fields.update(
            offload_memory_budget=budget,
            nvme_path=c.nvme_path if nvme else None,
            host_memory_budget=c.host_memory_budget
            if fields["offload_optimizer"] or fields["offload_parameters"]
            else None,
        )
    if c.activation_checkpointing_policy == "auto":
        fields["activation_checkpointing_policy"] = list(blocks) if chosen.recompute_share == 1.0 and blocks else None
    if c.activation_offloading_policy == "auto":
        fields["activation_offloading_policy"] = list(offloaded) or None
    if c.offload != "auto" and c.offload_optimizer_ratio != "auto":
        fields["offload_memory_budget"] = None  # the plan fitted the blocks' choice under it; nothing reads it later
    return c.replace(**fields)


def as_auto(config: ZeroConfig, budget_gib: float) -> ZeroConfig:
    """``config`` with its offload and checkpointing left to the plan under ``budget_gib`` of device
    memory (what the check before launch offers as the nearest configuration that fits)."""
    return config.replace(
        offload="auto",
        activation_checkpointing_policy="auto",
        offload_optimizer=False,
        offload_parameters=False,
        offload_optimizer_ratio=1.0,
        offload_optimizer_device="cpu",
        offload_params_device="cpu",
        offload_async_step=False,
        offload_memory_budget=budget_gib,
    )


def from_config(config: ZeroConfig, *, loss_scaling: bool) -> Policies:
    """The policies ``config`` asks for (``loss_scaling``: the precision is fp16 with loss scaling). Each
    policy's maker also says which settings it left out and why (``Policies.ineffective``): the sentence
    is written where the setting is decided, never beside it."""
    c = config
    if auto_request(c) is not None:
        raise ValueError(
            "offload='auto', activation_checkpointing_policy='auto' and activation_offloading_policy='auto' "
            "are decided from a plan of the "
            "model and a batch before the engine is built: the strategies do it; with the engine "
            "directly, call lightning_zeroq.choose(model, config, forward) first and build with the "
            "config it returns."
        )
    notes = Notes(c)
    sharding = _sharding(c, notes)
    quantization = _quantization(c, notes)
    offload = _offload(c, loss_scaling, notes)
    numerics = _numerics(c, loss_scaling, notes)
    settings = tuple((f.name, repr(getattr(c, f.name))) for f in dataclasses.fields(c) if f.name not in RANK_LOCAL)
    if not c.activation_offloading_policy:
        notes.unused(["activation_offloading_min_bytes"], "without activation_offloading_policy (nothing offloaded)")
    activations = ActivationOffloading(tuple(c.activation_offloading_policy or ()), c.activation_offloading_min_bytes)
    return Policies(
        sharding,
        offload,
        quantization,
        numerics,
        tuple(notes),
        settings=settings,
        recompute=tuple(c.activation_checkpointing_policy or ()),
        activations=activations,
    )


def ineffective(config: ZeroConfig, *, loss_scaling: bool) -> list[str]:
    """One sentence for every setting changed from its default that cannot take effect with the others."""
    return list(from_config(config, loss_scaling=loss_scaling).ineffective)


class Notes(list):
    """The sentences of ``Policies.ineffective``, with the config's defaults at hand."""

    def __init__(self, config: ZeroConfig) -> None:
        super().__init__()
        self.config, self._default = config, ZeroConfig()

    def changed(self, *names: str) -> list[str]:
        return [n for n in names if getattr(self.config, n) != getattr(self._default, n)]

    def unused(self, names: Sequence[str], why: str) -> None:
        """Each of ``names`` changed from its default: ``<name>=<value> has no effect <why>.``"""
        for name in self.changed(*names):
            self.append(f"{name}={getattr(self.config, name)!r} has no effect {why}.")


def _sharding(c: ZeroConfig, notes: Notes) -> Sharding:
    units: Union[Buckets, ModuleUnits] = Buckets(c.reduce_bucket_size)
    if c.stage == 3:
        units = ModuleUnits(
            wrap_classes=tuple(c.stage3_wrap_classes) if c.stage3_wrap_classes is not None else None,
            unit_size=c.stage3_unit_size,
            persistence_threshold=c.stage3_param_persistence_threshold,
            prefetch_depth=c.stage3_prefetch_depth if c.stage3_prefetch else 0,
            reshard_after_forward=c.reshard_after_forward,
            frozen_dtype=c.frozen_dtype,
        )
        if not c.stage3_prefetch:
            notes.unused(["stage3_prefetch_depth"], "with stage3_prefetch=False")
        notes.unused(
            ["reduce_bucket_size"],
            "in stage 3: its units follow modules (stage3_wrap_classes / stage3_unit_size); it sizes stage 1/2 units",
        )
    else:
        notes.unused(
            [
                "stage3_wrap_classes",
                "stage3_unit_size",
                "stage3_param_persistence_threshold",
                "stage3_prefetch",
                "stage3_prefetch_depth",
                "reshard_after_forward",
            ],
            f"in stage {c.stage} (stage 3 only)",
        )
        notes.unused(
            ["frozen_dtype"],
            f"in stage {c.stage}: frozen parameters stay whole on every rank there, as in DDP (stage 3 shards them)",
        )
    return Sharding(c.stage, units, c.shard_group_size, c.overlap_comm, c.managed_gradient_accumulation)


def _quantization(c: ZeroConfig, notes: Notes) -> Quantization:
    weights = c.quantized_weights
    if weights and c.quantize_cross_group_only:
        notes.append(
            "quantized_weights=True has no effect with quantize_cross_group_only=True: weights are "
            "gathered inside a group only (every group steps its own copy), at full width."
        )
    if not c.quantized_weights:
        int8_frozen = c.frozen_dtype == "int8" and c.stage == 3
        unused = [] if int8_frozen else ["allgather_bucket_size", "quantized_weights_exact_numel"]
        if not c.quantized_gradients and not int8_frozen:
            unused.append("quantized_weights_group_size")  # every INT8 path uses it
        notes.unused(
            unused, "without quantized_weights=True (the full-width gather writes into the working buffers in place)"
        )
    if c.quantize_cross_group_only and not c.quantized_gradients:
        notes.append(
            "quantize_cross_group_only=True has no effect without quantized_gradients=True (the "
            "gradients' all-reduce across groups is the only traffic between groups)."
        )
    return Quantization(
        weights,
        c.quantized_gradients,
        c.quantize_cross_group_only,
        c.quantized_weights_group_size,
        c.quantized_weights_exact_numel,
        c.allgather_bucket_size,
    )


def _numerics(c: ZeroConfig, loss_scaling: bool, notes: Notes) -> Numerics:
    scaling = None
    if loss_scaling:
        scaling = LossScaling(
            float(c.loss_scale) if c.loss_scale > 0 else None,
            2.0**c.initial_scale_power,
            c.loss_scale_window,
            float(c.min_loss_scale),
        )
    else:
        for name in notes.changed("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale"):
            notes.append(
                f"{name}={getattr(c, name)!r} only applies to precision='16-mixed' (fp16 loss scaling); it is ignored."
            )
    return Numerics(scaling, c.nonfinite_gradients)


def _offload(c: ZeroConfig, loss_scaling: bool, notes: Notes) -> Offload:
    on_cpu = c.offload_optimizer and c.offload_optimizer_device == "cpu"
    kind: type = OnDevice  # also with ratio 0, which offloads nothing
    if c.offload_optimizer and c.offload_optimizer_device == "nvme":
        kind = Nvme
    elif on_cpu and c.offload_optimizer_ratio == "auto":
        kind = Auto
    elif on_cpu and c.offload_optimizer_ratio > 0.0:
        kind = Host
    if not c.offload_optimizer:
        notes.unused(["offload_optimizer_device"], "without offload_optimizer=True")
        notes.unused(["offload_optimizer_ratio"], "without offload_optimizer=True (nothing is offloaded)")
    if kind is not Nvme:
        notes.unused(
            ["offload_optimizer_nvme_ratio"], "without offload_optimizer=True and offload_optimizer_device='nvme'"
        )
    if kind is not Auto and c.offload_memory_budget is not None:
        notes.append(
            f"offload_memory_budget={c.offload_memory_budget!r} has no effect without offload_optimizer_ratio='auto'."
        )
    speculative = (
        c.offload_speculative_step and kind in (Host, Auto) and not loss_scaling and c.managed_gradient_accumulation
    )
    if c.offload_speculative_step and not speculative:
        if kind not in (Host, Auto):
            why = "without CPU optimizer offload (offload_optimizer=True, offload_optimizer_device='cpu')"
        elif loss_scaling:
            why = "with fp16 loss scaling (precision='16-mixed'): the step's unscaling multiplier is never 1"
        else:
            why = "with managed_gradient_accumulation=False: no backward is known to end the window"
        notes.append(f"offload_speculative_step=True has no effect {why}.")
    asynchronous = c.offload_async_step and kind is Host
    if c.offload_async_step and not asynchronous:
        if not c.offload_optimizer:
            fix = "set offload_optimizer=True"
        elif c.offload_optimizer_device != "cpu":
            fix = f"set offload_optimizer_device='cpu' (it is {c.offload_optimizer_device!r})"
        else:
            fix = f"set offload_optimizer_ratio above 0 and not 'auto' (it is {c.offload_optimizer_ratio!r})"
        notes.append(f"offload_async_step=True has no effect without CPU optimizer offload of a fixed share: {fix}.")
    optimizer: Union[OnDevice, Host, Nvme, Auto] = OnDevice()
    if kind is Nvme:
        assert c.nvme_path is not None  # ZeroConfig checks it (and that the ratio is 1)
        optimizer = Nvme(c.nvme_path, c.offload_optimizer_nvme_ratio)
    elif kind is Auto:
        optimizer = Auto(c.offload_memory_budget)
    elif kind is Host:
        assert isinstance(c.offload_optimizer_ratio, float)
        optimizer = Host(c.offload_optimizer_ratio, last_first=speculative or asynchronous)
    parameters: Union[OnDevice, Host, Nvme] = OnDevice()
    if c.offload_parameters and c.offload_params_device == "nvme":
        assert c.nvme_path is not None
        parameters = Nvme(c.nvme_path)
    elif c.offload_parameters:
        parameters = Host()
    else:
        notes.unused(["offload_params_device"], "without offload_parameters=True")
    if (
        isinstance(optimizer, OnDevice)
        and isinstance(parameters, OnDevice)
        and c.host_memory_budget is not None
        and not c.activation_offloading_policy
    ):
        notes.append(
            f"host_memory_budget={c.host_memory_budget!r} has no effect without offload_optimizer, "
            "offload_parameters or activation_offloading_policy (nothing goes to the host)."
        )
    if c.nvme_path and not (isinstance(optimizer, Nvme) or isinstance(parameters, Nvme)):
        notes.append(f"nvme_path={c.nvme_path!r} has no effect: nothing is offloaded to NVMe.")
    return Offload(optimizer, parameters, speculative, asynchronous, c.host_memory_budget)
