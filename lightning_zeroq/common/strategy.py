"""What the two ZeroQ strategies share: the Trainer's ``ZeroQStrategy`` (``lightning/strategy.py``) and
Fabric's ``ZeroQFabricStrategy`` (``fabric/strategy.py``).

Each strategy is glue between its front door's lifecycle and the engine. What does not depend on the
front door lives here, once, so the two cannot drift apart:

- ``PRESETS`` / ``register_presets``: the registered names, the same in the Trainer's and Fabric's
  registries.
- ``config_from_options``: the ``ZeroConfig`` from an optional config plus keyword overrides, and the
  error for an option that is not a ``ZeroConfig`` field (values are validated by ``ZeroConfig``).
- ``as_zeroq_precision``: whatever precision plugin a connector hands over becomes the strategy's own
  plugin for the same precision string (which rejects unsupported precisions with one message).
- ``build_engine``: the engine for a module, with the precision's working dtype and loss scaling.
- ``check_one_optimizer``: Fabric's strategy steps one optimizer (the Trainer's takes several).
- ``stage3_meta_init``: the meta-device context in which stage 3 builds a model.
- ``local_checkpoint_path``: a checkpoint path, refusing a remote file system's URL.
- ``pretrained_option`` / ``load_pretrained_option``: the ``pretrained*`` options, validated when the strategy
  is made, and the load right after the engine is built (``checkpoint/pretrained.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import nn

from lightning_zeroq.checkpoint import api as checkpoint_api
from lightning_zeroq.common.migration import unknown_options_message
from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.common.watchdog import JOIN_TIMEOUT, start_watchdog, stop_watchdog
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.nulls import nothing
from lightning_zeroq.planning.choose import Choice, check_fits, choose
from lightning_zeroq.zero.engine import ZeroEngine, owning_engine
from lightning_zeroq.zero.materialize import parameters_on_meta
from lightning_zeroq.zero.policies import Chosen, OnDevice, auto_request, resolve


def local_checkpoint_path(path: Any) -> Path:
    """``path`` as an absolute local path. A URL of a remote (fsspec) file system is refused: every rank
    writes its own files with local I/O, so ``memory://x`` would become a local directory ``memory:``."""
    text = str(path)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text) and not text.startswith("file://"):
        raise ValueError(
            f"ZeroQ checkpoints are local directories written by every rank; {text!r} names a remote "
            "file system. Save to a local or mounted path and copy the directory afterwards."
        )
    return Path(text.removeprefix("file://")).absolute()


@dataclass(frozen=True)
class PretrainedOption:
    """A strategy's ``pretrained*`` options: what ``load_pretrained_option`` loads once the engine is built."""

    owner: str
    path: Path
    name_map: checkpoint_api.NameMap
    allow_missing: checkpoint_api.Allowance
    allow_unexpected: checkpoint_api.Allowance


def pretrained_option(
    owner: str,
    path: Any,
    name_map: checkpoint_api.NameMap,
    allow_missing: checkpoint_api.Allowance,
    allow_unexpected: checkpoint_api.Allowance,
) -> Optional[PretrainedOption]:
    """The ``pretrained`` options validated (a path that does not exist, a value of the wrong kind: one line
    naming it); None without ``pretrained``, where the others have nothing to apply to."""
    if path is None:
        for name, value in (
            ("pretrained_name_map", name_map),
            ("pretrained_allow_missing", allow_missing),
            ("pretrained_allow_unexpected", allow_unexpected),
        ):
            if value is not None:
                raise ValueError(
                    f"{owner}({name}=...) has nothing to {'map' if name.endswith('map') else 'allow'} "
                    "without pretrained; pass pretrained=<path of the checkpoint> too, or leave it out."
                )
        return None
    local = checkpoint_api.check_pretrained(owner, path, name_map, allow_missing, allow_unexpected)
    return PretrainedOption(owner, local, name_map, allow_missing, allow_unexpected)


def load_pretrained_option(option: PretrainedOption, engine: ZeroEngine, module: nn.Module) -> None:
    """Collective: the option's weights into ``module`` through the engine just built (each rank its part)."""
    checkpoint_api.load_pretrained(
        engine,
        module,
        option.path,
        name_map=option.name_map,
        allow_missing=option.allow_missing,
        allow_unexpected=option.allow_unexpected,
        where=f"{option.owner}(pretrained=...)",
    )


PRESETS: dict[str, dict[str, Any]] = {
    "zeroq": {},
    "zeroq_stage_1": {"stage": 1},
    "zeroq_stage_2": {"stage": 2},
    "zeroq_stage_2_offload": {"stage": 2, "offload_optimizer": True},
    "zeroq_stage_3": {"stage": 3},
    "zeroq_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}

P = TypeVar("P", bound=ZeroQPrecision)

PLAN_FORWARD_FIX = (
    "pass a function of the model returning one micro-batch's loss, e.g. lambda model: loss_fn(model(x), y)"
)


def register_presets(registry: _StrategyRegistry, strategy_cls: type) -> None:
    """Register every preset name for ``strategy_cls``; a name already registered is left alone, so
    importing the package twice (or registering by hand) is harmless."""
    for name, options in PRESETS.items():
        if name in registry:
            continue
        registry.register(name, strategy_cls, description=f"ZeroQ with {options or 'defaults (stage 2)'}", **options)


def config_from_options(owner: str, config: Optional[ZeroConfig], options: dict[str, Any]) -> ZeroConfig:
    """``config`` (default: ``ZeroConfig()``) with ``options`` applied and validated; ``owner`` names the
    strategy class in the error for an unknown option."""
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(
            f"{owner}(config=...) takes a ZeroConfig, got {type(config).__name__}; pass the options as "
            f"keywords ({owner}(stage=3, offload_optimizer=True)) or as {owner}(ZeroConfig(**options))."
        )
    known = set(ZeroConfig.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(unknown_options_message(owner, unknown, sorted(known)))
    return (config or ZeroConfig()).replace(**options)


def check_timeout(owner: str, timeout: Any) -> Optional[timedelta]:
    """The collective timeout as a ``timedelta``: a positive ``timedelta``, or seconds as a positive number
    (DeepSpeed's and torchrun's habit); None leaves torch's default."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    elif isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif timeout is None:
        return None
    else:
        raise ValueError(
            f"{owner}(timeout={timeout!r}) is not a duration; pass a datetime.timedelta (e.g. "
            "timedelta(minutes=30)) or a number of seconds."
        )
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"{owner}(timeout={timeout!r}) must be positive (it bounds every collective); pass e.g. "
            "timedelta(minutes=30), or leave it out for the default."
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def as_zeroq_precision(plugin: Optional[Any], plugin_cls: type[P]) -> Optional[P]:
    """The connector's plugin (Lightning picks one from ``precision=...``) as ``plugin_cls`` with the same
    precision string; ``plugin_cls`` raises for a precision ZeroQ does not support."""
    if plugin is not None and not isinstance(plugin, plugin_cls):
        plugin = plugin_cls(str(plugin.precision))
    return plugin


def build_engine(
    module: nn.Module,
    config: ZeroConfig,
    precision: ZeroQPrecision,
    device: torch.device,
    ranks_per_node: Optional[int] = None,
    plan_forward: Optional[Callable[[nn.Module], torch.Tensor]] = None,
    on_choice: Callable[[Choice], None] = nothing,
    training: bool = True,
) -> ZeroEngine:
    """The engine for ``module``. It moves the module to ``device`` unit by unit (stage 3 never holds it
    whole), materializes meta-device parameters with ``reset_parameters()``, and starts every rank from
    rank 0's values, as DDP does. ``ranks_per_node`` (the strategy's ``num_processes``) resolves
    ``shard_group_size="node"``. ``offload="auto"`` (or ``activation_checkpointing_policy="auto"``,
    ``activation_offloading_policy="auto"``) is
    decided first, from the plan of ``plan_forward(module)`` (one micro-batch's loss; ``planning/choose.py``);
    otherwise, on a GPU, a configuration whose planned peak surely exceeds the device stops here, in one
    line, before anything is allocated (``choose.check_fits``). ``on_choice`` receives the automatic choice.
    Not ``training`` (evaluation: no optimizer state to place), ``"auto"`` keeps everything on the device."""
    previous = owning_engine(module)
    if isinstance(previous, ZeroEngine):  # a fit that failed kept the module (its teardown runs no collective)
        previous.release_module()  # collective: every rank is here, setting up the new fit
    if auto_request(config) is not None and not training:
        config = resolve(config, Chosen(OnDevice(), OnDevice(), 0.0), ())
    machine: dict[str, Any] = {
        "device": device,
        "param_dtype": precision.param_dtype,
        "ranks_per_node": ranks_per_node or 1,
    }
    if auto_request(config) is not None:
        if plan_forward is None:
            raise ValueError(
                "offload='auto' / activation_checkpointing_policy='auto' / activation_offloading_policy="
                "'auto' plan from one micro-batch's "
                "loss: pass plan_forward=lambda model: <the loss of a sample batch> to the strategy."
            )
        choice = choose(module, config, plan_forward, **machine)
        config = choice.config
        on_choice(choice)
    elif plan_forward is not None:
        check_fits(module, config, plan_forward, **machine)
    return ZeroEngine(
        module,
        config,
        param_dtype=precision.param_dtype,
        loss_scaling=precision.loss_scaling,
        device=device,
        ranks_per_node=ranks_per_node,
    )


def check_one_optimizer(owner: str, found: str, count: int) -> None:
    """``found`` says where the optimizers came from, e.g. ``"configure_optimizers returned"``."""
    if count != 1:
        raise ValueError(
            f"{owner} supports exactly one optimizer, {found} {count}; put all parameters in one optimizer "
            "with several param groups."
        )


def stage3_meta_init(config: ZeroConfig) -> contextlib.AbstractContextManager:
    """Stage 3: parameters created here live on the meta device until the engine materializes them unit
    by unit with their module's ``reset_parameters()``, so a model larger than one device can be built;
    buffers and other state are created normally. Other stages: no-op."""
    return parameters_on_meta() if config.stage == 3 else contextlib.nullcontext()


def create_process_group(strategy: Any, setup: Callable[[], None]) -> None:
    """Create the process group through ``setup`` (the parent strategy's): ranks join within
    ``JOIN_TIMEOUT`` (a short collective timeout must not fail a slow start: the launcher's children
    import torch and Lightning first); collectives then get the strategy's ``timeout``. A lone
    process joins nobody: it gets ``timeout`` as given, as in Lightning's own strategies. A group
    created here is owned here (``own_process_group``); one the caller created is left alone."""
    if dist.is_initialized():  # the caller stood in for init_process_group
        setup()
        return
    timeout = strategy._timeout
    if (
        timeout is not None
        and timeout < JOIN_TIMEOUT
        and strategy.cluster_environment is not None
        and strategy.cluster_environment.world_size() > 1
    ):
        strategy._timeout = JOIN_TIMEOUT
        try:
            setup()
        finally:
            strategy._timeout = timeout
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timeout)
    else:
        setup()
    if dist.is_initialized():
        own_process_group(timeout)


_EXIT_HOOK: list[bool] = []


def own_process_group(timeout: Any) -> None:
    """For a process group this strategy created: a watchdog that ends the job when a rank stalls or
    dies, and, at the interpreter's exit, the watchdog stopped and the group destroyed. Not at
    teardown: ``save_checkpoint`` and ``full_state_dict`` after ``fit`` are collectives and need it;
    and before the interpreter tears down: otherwise the backend's threads can outlive it and a
    successful run ends with "terminate called without an active exception" (exit status 134)."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_close_process_group)
    start_watchdog(timeout)


def _close_process_group() -> None:
    stop_watchdog()
    if dist.is_initialized():
        dist.destroy_process_group()
