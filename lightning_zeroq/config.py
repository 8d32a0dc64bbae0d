"""The one validated configuration object behind ``ZeroQStrategy`` and the Hydra recipes.

Field names follow Lightning's ``DeepSpeedStrategy`` (and DeepSpeed's config keys) wherever the meaning
is the same, so users coming from DeepSpeed can move their settings over unchanged. Every field is
validated in ``__post_init__``; a bad value raises ``ValueError`` naming the field, the value and the fix.

A setting that is valid but cannot take effect with the other settings (an INT8 bucket size without
INT8 weights, a stage-3 option in stage 2, loss-scaling options without fp16) is named where the engine
decides it (``zero/policies.py``: ``Policies.ineffective``, ``policies.ineffective(config, loss_scaling=...)``);
the engine warns about each once when it is built, so Trainer, Fabric and plain-PyTorch users all see it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lightning_zeroq.validation import check_bool, check_choice, check_int, check_local_path

OFFLOAD_DEVICES = ("cpu", "nvme")
NONFINITE_ACTIONS = ("error", "skip")
FROZEN_DTYPES = (None, "bf16", "fp16", "int8")


@dataclass(kw_only=True)
class ZeroConfig:
    """Settings of the ZeRO engine. Sizes are counted in elements, as in DeepSpeed."""

    stage: int = 2
    """ZeRO stage: 1 shards optimizer state and fp32 master weights, 2 also shards gradients, 3 also
    shards parameters."""

    reduce_bucket_size: int = 200_000_000
    """Upper bound (elements) of one unit of consecutive parameters in stages 1/2. A unit is reduced with
    one reduce-scatter, so this bounds the temporary gradient memory of one reduction."""

    allgather_bucket_size: int = 200_000_000
    """Upper bound (elements, counted across all ranks) of the weights gathered in one collective after
    the optimizer step."""

    overlap_comm: bool = True
    """Run gradient reduce-scatters asynchronously on a side stream, overlapping the backward pass."""

    managed_gradient_accumulation: bool = True
    """True: the strategy knows the accumulation window from the Trainer and does the boundary work in
    the window's last backward. False (unmanaged): any number of backward passes, then a step; all
    boundary work runs inside the step."""

    offload: Optional[str] = None
    """``"auto"``: decide before the first step, from the plan of this model and its first batch
    (``planning/choose.py``: ``zeroq-plan``'s count, its activations traced on the meta device), what goes
    where: optimizer offload and its share, stage 3's parameter offload, NVMe spill when ``nvme_path`` is
    given; with ``activation_checkpointing_policy="auto"`` also how many blocks recompute. The fastest
    planned configuration whose peak fits ``offload_memory_budget`` and ``host_memory_budget`` (every rank
    the same, from the smallest budgets) is taken and logged; with optimizer offload, the share is corrected
    from the memory measured in the first step (as ``offload_optimizer_ratio="auto"``). Nothing fits: one
    line before anything is allocated. Leave ``offload_optimizer``, ``offload_optimizer_ratio`` and
    ``offload_parameters`` at their defaults with it. None: the offload options as given."""

    offload_optimizer: bool = False
    """Keep fp32 master shards and optimizer state off the GPU (see ``offload_optimizer_device``)."""

    offload_optimizer_device: str = "cpu"
    """Where optimizer state lives when ``offload_optimizer`` is set: ``"cpu"`` or ``"nvme"``."""

    offload_optimizer_ratio: Any = 1.0
    """Partial optimizer offload (DeepSpeed's ``ratio``): the fraction of the parameters whose fp32
    master and optimizer state live on the host with ``offload_optimizer`` (CPU only). Whole units go,
    largest first, until the fraction is reached; the other units keep master and state on the device
    and step there, as without offload. 1 offloads every unit, 0 none. ``"auto"``: every unit starts on
    the host; after the first step the engine brings back to the device as many units as fit in
    ``offload_memory_budget`` (measured peak plus their master and state), the same on every rank,
    and logs the decision. On a CPU device (no device memory) ``"auto"`` warns and offloads every unit."""

    offload_optimizer_nvme_ratio: Any = 1.0
    """With ``offload_optimizer_device="nvme"``: the fraction of the parameters whose fp32 master and
    optimizer state are swapped to ``nvme_path`` (whole units, largest first, above 0 and up to 1); the
    other units keep theirs in host memory, as with CPU offload. Below 1 a model whose optimizer state
    outgrows the host spills to disk only as far as it must (disk: 12 bytes per element of the units
    swapped, for AdamW). 1: every unit is swapped."""

    offload_memory_budget: Any = None
    """Device memory ``offload="auto"`` and ``offload_optimizer_ratio="auto"`` may fill (peak allocated bytes): GiB as a number
    (e.g. ``60`` or ``"60"``), a size with its unit (``"60GiB"``), or a share of the device's memory as a
    string ending in ``%`` (e.g. ``"50%"``), read as ``host_memory_budget`` is (``budget_form``).
    None: what the device has free after the first step (the caching allocator's unused reserve
    included), less a margin of 10% of its memory."""

    host_memory_budget: Any = None
    """Host memory this node's ranks may fill with offloaded state, checked before anything is allocated
    (``zero/memory/host.py`` counts the bytes per element): GiB as a number (e.g. ``120`` or ``"120"``), a
    size with its unit (``"120GiB"``), or a share of the host's memory as a string ending in ``%`` (e.g.
    ``"80%"``), read as ``offload_memory_budget`` is (``budget_form``). None: what the host reports available
    when the engine is built (``MemAvailable``, or a cgroup's limit). Set it where the host's memory grows
    as it is used (a virtual machine's balloon), which the available figure undercounts."""

    offload_speculative_step: bool = False
    """With CPU optimizer offload: step each unit on the host while the backward still runs, as soon as its
    gradient has landed, and undo that step exactly if the window's checks (finite gradients, clipping,
    used parameters) say otherwise, so the result is bitwise the same. For torch's Adam/AdamW through
    the host kernel, in a backward that ends the window, without fp16 loss scaling. Costs host memory
    for spare buffers (the step is taken out of place): 12 bytes per element of the units it steps early."""

    offload_async_step: bool = False
    """With CPU optimizer offload of every unit: ``step()`` returns once the host's work is queued, and
    a thread of its own steps the units (in forward order, as their gradients land) while the next
    forward runs, publishing each unit's new weights (copied to the device, gathered) in unit order, so
    the forward waits per unit, not for the whole step. Results are bitwise those without it: any read of
    a parameter before its unit is published (a module's forward, a callback averaging the weights,
    ``param.data``) waits for that unit, and whatever reads or writes the optimizer state waits for the
    whole step (the next backward, state dicts, checkpoints, ``gathered_parameters``, the next step).
    For torch's Adam/AdamW through the host kernel with one optimizer and no optimizer step hooks;
    otherwise the step runs as usual (a warning says why)."""

    offload_parameters: bool = False
    """Keep parameter shards off the GPU between uses (stage 3 only)."""

    offload_params_device: str = "cpu"
    """Where parameter shards live when ``offload_parameters`` is set: ``"cpu"`` or ``"nvme"``."""

    nvme_path: Optional[str] = None
    """Directory for NVMe swap files; required when either offload device is ``"nvme"``."""

    quantized_weights: bool = False
    """Gather weights as INT8 (groups of 64, one fp32 scale each) instead of at full width."""

    quantized_weights_group_size: int = 64
    """Elements per quantization group (one fp32 scale each); a positive multiple of 8."""

    quantized_weights_exact_numel: int = 65536
    """Parameters of at most this many elements (norms, biases) bypass quantization and travel
    exactly, in their own dtype, on a side channel. 0 quantizes everything."""

    stage3_wrap_classes: Optional[list[str]] = None
    """Stage 3: class names of the modules that become units (default: the repeated blocks, found
    automatically)."""

    stage3_unit_size: Optional[int] = None
    """Stage 3: instead of classes, make a unit of every module whose not-yet-wrapped parameters reach
    this many elements."""

    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: parameters of at most this many elements stay gathered (DeepSpeed's name and default)."""

    frozen_dtype: Optional[str] = None
    """Stage 3: how frozen parameters (``requires_grad=False``: a LoRA base) rest, sharded with their block's
    unit: None in their own dtype (exact: the values DDP uses); ``"bf16"`` or ``"fp16"`` rounded once when the
    engine is built; ``"int8"`` as INT8 groups of ``quantized_weights_group_size`` elements with one fp32
    scale each (about 1.06 bytes per element; parameters of at most ``quantized_weights_exact_numel`` elements
    kept exact), dequantized into their own dtype at each gather. Stages 1/2 keep frozen parameters whole, as
    DDP does."""

    stage3_prefetch: bool = True
    """Stage 3: gather the next units of the recorded order while the current one computes."""

    stage3_prefetch_depth: int = 1
    """Stage 3: how many units ahead to prefetch (each gathered unit held ahead costs its full size)."""

    reshard_after_forward: bool = True
    """Stage 3 (FSDP2's name; DeepSpeed's ``stage3_max_reuse_distance`` plays the same part): free a
    unit after its forward and gather it again for backward. False keeps units gathered from forward
    to backward: one gather per unit and step fewer, the memory of the whole model gathered at the
    end of the forward."""

    activation_checkpointing_policy: Any = None
    """The module classes (or their names) whose instances recompute their forward in the backward
    instead of keeping its activations, or modules' qualified names (``"blocks.0"``) to choose block by block
    (Lightning's ``FSDPStrategy`` name and meaning, for classes; torch's
    non-reentrant ``checkpoint``, which restores the random state: the same results, bitwise). Applied
    to the model when the engine is built; with stage 3, a checkpointed unit is gathered again for its
    recomputation. None: nothing recomputed. Stored as the class names. ``"auto"``: the repeated blocks
    (stage 3's units), as many of them as the plan needs to fit the memory budget (none when everything
    fits), decided before the first step (``offload="auto"`` says how)."""

    activation_offloading_policy: Any = None
    """The modules whose activations wait in pinned host memory between their forward and their backward
    instead of on the device: module classes (or their names), whose instances are named, or modules'
    qualified names (``"blocks.0"``), to choose block by block. A module that does not recompute copies what
    autograd saves for its backward to the host on a side stream as its forward ends and gets it back on
    another ahead of its backward (the next blocks of the backward prefetched as one starts), with no
    recomputation; a module that ``activation_checkpointing_policy`` also names recomputes and keeps only its
    checkpoint inputs on the host (DeepSpeed's ``cpu_checkpointing``). Parameters, the gathered weights of
    stage 3, tensors smaller than ``activation_offloading_min_bytes`` and tensors off the device stay where
    they are; results are bitwise the same. Stored as the names. ``"auto"``: the plan chooses, block by block,
    which keep their activations, which offload them and (with ``activation_checkpointing_policy="auto"``)
    which recompute, counting the copies' time against the compute they overlap (``offload="auto"`` says
    how). None: nothing offloaded."""

    activation_offloading_min_bytes: int = 1 << 20
    """With ``activation_offloading_policy``: saved tensors whose storage holds fewer bytes stay on the device
    (a copy's fixed cost outweighs what it frees). 0 offloads every one."""

    quantized_gradients: bool = False
    """Reduce gradients as INT8 groups with fp32 scales instead of the working dtype (ZeRO++'s qgZ
    idea, all stages): each rank quantizes every rank's part of its gradients, an all-to-all moves
    them, and each rank dequantizes what it owns and sums it in fp32. About half the bytes of bf16."""

    shard_group_size: Any = None
    """Hybrid sharding (FSDP's HSDP, DeepSpeed's MiCS): ranks form consecutive groups of this many
    ranks; each group holds one full copy of the sharded state (stages 1-3), gradients are
    reduce-scattered inside the group and all-reduced across groups (between the ranks at the same
    position in each group), stage 3 gathers inside the group. ``"node"``: the ranks of one node.
    None: one group of all ranks (plain ZeRO). Must divide the world size."""

    quantize_cross_group_only: bool = False
    """With hybrid groups (``shard_group_size`` below the world size): INT8 goes only on the slow hop
    between groups, the gradients' all-reduce across groups; traffic inside a group (the gradients'
    reduce-scatter, the weight gathers) stays at full width. Needs ``quantized_gradients=True``."""

    nonfinite_gradients: str = "error"
    """What a step does when some rank's gradients hold inf or NaN (outside fp16 loss scaling, which
    skips such steps and lowers the scale): ``"error"`` stops training with an error naming the step,
    the ranks and the parameters; ``"skip"`` skips the step on every rank and says so in the log."""

    loss_scale: float = 0.0
    """fp16 (``16-mixed``) only: 0 for dynamic loss scaling, a positive value for a fixed scale."""

    initial_scale_power: int = 16
    """fp16 dynamic loss scaling starts at ``2**initial_scale_power``."""

    loss_scale_window: int = 1000
    """fp16 dynamic loss scaling doubles the scale after this many steps without overflow."""

    min_loss_scale: float = 1.0
    """fp16 dynamic loss scaling never halves the scale below this."""

    def __post_init__(self) -> None:
        """Each option group in turn: the groups of ``zero/policies.py`` (one policy each) and of docs/options.md."""
        self._check_sharding()
        self._check_quantization()
        self._check_offload()
        self._check_numerics()

    def _check_sharding(self) -> None:
        if self.stage not in (1, 2, 3) or not isinstance(self.stage, int) or isinstance(self.stage, bool):
            raise ValueError(f"ZeroConfig.stage={self.stage!r} is not a ZeRO stage; use 1, 2 or 3.")
        self.reduce_bucket_size = _check_int("reduce_bucket_size", self.reduce_bucket_size, 1)
        for name in ("overlap_comm", "managed_gradient_accumulation", "reshard_after_forward", "stage3_prefetch"):
            check_bool("ZeroConfig", name, getattr(self, name))
        self.shard_group_size = check_shard_group_size(self.shard_group_size)
        self.stage3_param_persistence_threshold = _check_int(
            "stage3_param_persistence_threshold", self.stage3_param_persistence_threshold, 0
        )
        self.stage3_prefetch_depth = _check_int("stage3_prefetch_depth", self.stage3_prefetch_depth, 1)
        if self.stage3_unit_size is not None:
            self.stage3_unit_size = _check_int("stage3_unit_size", self.stage3_unit_size, 1)
        if self.stage3_wrap_classes is not None and (
            isinstance(self.stage3_wrap_classes, str)
            or not all(isinstance(c, str) and c for c in self.stage3_wrap_classes)
        ):
            raise ValueError(
                f"ZeroConfig.stage3_wrap_classes={self.stage3_wrap_classes!r} must be a list of module class "
                "names, e.g. ['Block']."
            )
        self.activation_checkpointing_policy = _class_names(self.activation_checkpointing_policy)
        self.activation_offloading_policy = _class_names(
            self.activation_offloading_policy,
            "activation_offloading_policy",
            otherwise="None: nothing offloaded; 'auto': the plan chooses block by block",
        )
        self.activation_offloading_min_bytes = _check_int(
            "activation_offloading_min_bytes", self.activation_offloading_min_bytes, 0
        )
        if self.activation_offloading_policy == "auto" and self.activation_checkpointing_policy not in (None, "auto"):
            raise ValueError(
                "ZeroConfig.activation_offloading_policy='auto' chooses block by block beside "
                f"activation_checkpointing_policy={self.activation_checkpointing_policy!r}, which names the blocks "
                "to recompute itself; set activation_checkpointing_policy='auto' (the plan chooses the mix of kept, "
                "offloaded and recomputed blocks) or None, or name the blocks to offload."
            )
        if self.stage3_wrap_classes and self.stage3_unit_size:
            raise ValueError(
                "ZeroConfig: set stage3_wrap_classes or stage3_unit_size, not both "
                f"(got {self.stage3_wrap_classes!r} and {self.stage3_unit_size})."
            )

    def _check_quantization(self) -> None:
        for name in ("quantized_weights", "quantized_gradients", "quantize_cross_group_only"):
            check_bool("ZeroConfig", name, getattr(self, name))
        self.allgather_bucket_size = _check_int("allgather_bucket_size", self.allgather_bucket_size, 1)
        group = self.quantized_weights_group_size = _check_int(
            "quantized_weights_group_size", self.quantized_weights_group_size, 1
        )
        if group % 8:
            raise ValueError(
                f"ZeroConfig.quantized_weights_group_size={group} must be a positive multiple of 8 "
                "(e.g. 64): groups are packed in whole 8-byte words."
            )
        self.quantized_weights_exact_numel = _check_int(
            "quantized_weights_exact_numel", self.quantized_weights_exact_numel, 0
        )
        check_choice("ZeroConfig", "frozen_dtype", self.frozen_dtype, FROZEN_DTYPES)
        if self.quantized_weights and self.allgather_bucket_size < group:
            raise ValueError(
                f"ZeroConfig.allgather_bucket_size={self.allgather_bucket_size} is smaller than one "
                f"quantization group ({group} elements); raise it to at least {group}."
            )

    def _check_offload(self) -> None:
        if self.offload not in (None, "auto"):
            raise ValueError(
                f"ZeroConfig.offload={self.offload!r}: use 'auto' (the plan decides what goes where) or "
                "None (the offload options as given)."
            )
        if self.offload == "auto":
            given = [
                f"{name}={getattr(self, name)!r}"
                for name in (
                    "offload_optimizer",
                    "offload_parameters",
                    "offload_optimizer_ratio",
                    "offload_optimizer_device",
                    "offload_params_device",
                )
                if getattr(self, name) != type(self).__dataclass_fields__[name].default
            ]
            if given:
                raise ValueError(
                    f"ZeroConfig.offload='auto' decides what {', '.join(given)} sets; drop "
                    f"{'it' if len(given) == 1 else 'them'}, or offload='auto' to choose by hand."
                )
        for name in ("offload_optimizer", "offload_speculative_step", "offload_async_step", "offload_parameters"):
            check_bool("ZeroConfig", name, getattr(self, name))
        for name in ("offload_optimizer_device", "offload_params_device"):
            value = getattr(self, name)
            if value not in OFFLOAD_DEVICES:
                raise ValueError(f"ZeroConfig.{name}={value!r} is not an offload device; use one of {OFFLOAD_DEVICES}.")
        ratio = self.offload_optimizer_ratio
        if ratio != "auto" and (
            isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0
        ):
            raise ValueError(
                f"ZeroConfig.offload_optimizer_ratio={ratio!r} must be a number from 0 to 1: the fraction of the "
                "parameters whose optimizer state is offloaded (e.g. 0.5; 1 offloads all of it), or 'auto'."
            )
        self.offload_optimizer_ratio = ratio if ratio == "auto" else float(ratio)
        spill = self.offload_optimizer_nvme_ratio
        if isinstance(spill, bool) or not isinstance(spill, (int, float)) or not 0.0 < spill <= 1.0:
            raise ValueError(
                f"ZeroConfig.offload_optimizer_nvme_ratio={spill!r} must be a number above 0 and up to 1: the "
                "fraction of the parameters whose optimizer state is swapped to NVMe (e.g. 0.4; 1 swaps all of "
                "it). To keep all of it in host memory, use offload_optimizer_device='cpu'."
            )
        self.offload_optimizer_nvme_ratio = float(spill)
        memory_budget(self.offload_memory_budget, None)  # the form; the device's size is checked when known
        host_budget(self.host_memory_budget)
        if self.offload_optimizer and self.offload_optimizer_device == "nvme" and self.offload_optimizer_ratio != 1.0:
            raise ValueError(
                f"ZeroConfig.offload_optimizer_ratio={self.offload_optimizer_ratio!r}: partial optimizer offload "
                "is implemented for the CPU only; set offload_optimizer_device='cpu' or offload_optimizer_ratio=1."
            )
        if self.offload_parameters and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_parameters=True needs stage=3 (got stage={self.stage}): parameters are "
                "only sharded at rest in stage 3. Set stage=3 or offload only the optimizer."
            )
        if self.nvme_path is not None:
            check_local_path("ZeroConfig", "nvme_path", self.nvme_path)
        if self.uses_nvme and not self.nvme_path:
            raise ValueError(
                f"ZeroConfig.nvme_path={self.nvme_path!r}: NVMe offload needs a directory to swap to; set "
                "nvme_path to a writable directory on a fast local disk."
            )

    def _check_numerics(self) -> None:
        check_choice("ZeroConfig", "nonfinite_gradients", self.nonfinite_gradients, NONFINITE_ACTIONS)
        if not isinstance(self.loss_scale, (int, float)) or self.loss_scale < 0:
            raise ValueError(
                f"ZeroConfig.loss_scale={self.loss_scale!r} must be 0 (dynamic) or a positive fixed scale."
            )
        self.initial_scale_power = _check_int("initial_scale_power", self.initial_scale_power, 0)
        self.loss_scale_window = _check_int("loss_scale_window", self.loss_scale_window, 1)
        if not isinstance(self.min_loss_scale, (int, float)) or self.min_loss_scale <= 0:
            raise ValueError(f"ZeroConfig.min_loss_scale={self.min_loss_scale!r} must be positive, e.g. 1.")

    @property
    def uses_nvme(self) -> bool:
        """Whether anything (optimizer state or stage-3 parameters) is offloaded to ``nvme_path``."""
        return bool(
            (self.offload_optimizer and self.offload_optimizer_device == "nvme")
            or (self.offload_parameters and self.offload_params_device == "nvme")
        )

    def replace(self, **changes: Any) -> "ZeroConfig":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def check_shard_group_size(value: Any, world_size: Optional[int] = None, given: Optional[str] = None) -> Any:
    """``value`` (None, ``"node"`` or a positive int) checked, and with ``world_size`` against it; ``given``:
    what the user wrote, when ``value`` was resolved from it (``"'node' (2 ranks on this node)"``)."""
    if value is None or value == "node":
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    fix = "use a divisor of the world size (ranks per group), 'node' (the ranks of one node) or None (all ranks)"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ZeroConfig.shard_group_size={value!r} must be a positive integer; {fix}.")
    if world_size is not None and (value > world_size or world_size % value):
        problem = "is larger than" if value > world_size else "does not divide"
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"ZeroConfig.shard_group_size={given or value} {problem} the world size {world_size}; {fix}: "
            f"one of {divisors}."
        )
    return value


def _class_names(
    value: Any,
    field: str = "activation_checkpointing_policy",
    forms: str = "module classes, their names or modules' qualified names, e.g. {Block}, ['Block'] or "
    "['blocks.0', 'blocks.1']",
    otherwise: str = "None: nothing recomputed; 'auto': as many blocks as the plan needs",
) -> Any:
    """A module policy (``activation_checkpointing_policy``, ``activation_offloading_policy``): None, ``"auto"``,
    or module classes / names as a sorted list of names; ``forms`` and ``otherwise`` word the error."""
    if value is None or value == "auto":
        return value
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else None
    names = [c if isinstance(c, str) else c.__name__ if isinstance(c, type) else None for c in items or ()]
    if not items or any(not n for n in names):
        raise ValueError(f"ZeroConfig.{field}={value!r} must be a list of {forms} ({otherwise}).")
    return sorted({n for n in names if n})


def _check_int(name: str, value: Any, minimum: int) -> int:
    return check_int("ZeroConfig", name, value, minimum)


def check_swap_directory(path: Optional[str]) -> None:
    """``ValueError`` unless ``path`` can hold swap files (the swapper's own check), made before any
    process starts (``zeroq-train``): a bad path is one line instead of a traceback from every rank."""
    from pathlib import Path

    from lightning_zeroq.swap.directory import directory_problem

    problem = directory_problem(Path(path or "").expanduser()) if path else "is not set"
    if problem is not None:
        raise ValueError(f"ZeroConfig.nvme_path={path!r} {problem}.")


def memory_budget(value: Any, device_bytes: Optional[int]) -> Optional[int]:
    """``offload_memory_budget`` in bytes (None: the default). ``device_bytes``: the device's memory, or
    None to check the form alone. Raises ``ValueError`` naming the value and the fix."""
    fix = f"use {BUDGET_FORMS} of the device's memory such as '50%'"
    form = budget_form("offload_memory_budget", value, fix)
    if form is None or device_bytes is None:
        return None
    number, share = form
    budget = int(number / 100 * device_bytes) if share else int(number * 2**30)
    if budget > device_bytes:
        raise ValueError(
            f"ZeroConfig.offload_memory_budget={value!r} ({budget / 2**30:.2f} GiB) is more than the device has "
            f"({device_bytes / 2**30:.2f} GiB); {fix}, at most the device's memory."
        )
    return budget


def host_budget(value: Any) -> Optional[tuple[float, bool]]:
    """``host_memory_budget``'s form, as ``budget_form`` reads it: ``(GiB or per cent, is a share)``."""
    fix = f"use {BUDGET_FORMS} of the host's memory such as '80%', or None for what is available"
    return budget_form("host_memory_budget", value, fix)


BUDGET_FORMS = "GiB as a number (e.g. 60 or '60'), a size with its unit (e.g. '60GiB', '500MB'), or a share"
"""The forms of a memory budget (``offload_memory_budget``, ``host_memory_budget``), as their errors name them."""

SIZE_UNITS = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
"""The units a budget's size may be given in (any case), in bytes."""


def budget_form(name: str, value: Any, fix: str) -> Optional[tuple[float, bool]]:
    """A memory budget, one reading for both budgets: GiB as a number (or a string of one), a size with a
    unit of ``SIZE_UNITS`` (``"500MiB"``, ``"1.5 TB"``), or a share ``"N%"`` with 0 < N <= 100. Returns
    ``(GiB, False)`` or ``(N, True)``, None for None; a ``ValueError`` naming field ``name``, the value and
    ``fix`` otherwise: "is not a number" where it reads as none of these, "must be above 0" where it does
    but is not a positive, finite size."""
    if value is None:
        return None
    share, scale = False, 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"ZeroConfig.{name}={value!r} is not a number; {fix}.")
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.endswith("%"):
        share, text = True, text[:-1].strip()
    elif text is not None:
        unit = next((u for u in sorted(SIZE_UNITS, key=len, reverse=True) if text.lower().endswith(u)), None)
        if unit is not None:
            text, scale = text[: -len(unit)].strip(), SIZE_UNITS[unit] / 2**30
    try:
        number = float(text) * scale if text is not None else float(value)
    except ValueError:
        raise ValueError(f"ZeroConfig.{name}={value!r} is not a number; {fix}.") from None
    if not 0 < number < float("inf") or (share and number > 100):
        raise ValueError(f"ZeroConfig.{name}={value!r} must be above 0 and finite (a share at most 100%); {fix}.")
    return number, share
