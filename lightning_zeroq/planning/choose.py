"""``offload="auto"`` and ``activation_checkpointing_policy="auto"``: what goes where, decided from the
plan before the engine is built (``lightning_zeroq.choose``; the strategies call it).

1. The model's activations are traced once with its parameters and buffers swapped for meta tensors of
   the working dtype (``on_meta``; nothing is allocated) through ``forward`` (the strategies: the
   module's ``training_step`` on its first batch, moved to the meta device).
2. The budgets: device memory (``offload_memory_budget``, default the device's free memory less 10% of
   its size; peak allocated), host memory (``host_memory_budget``, default what is available), and the
   disk's free space at ``nvme_path``: every rank takes the smallest of all ranks', so every rank
   decides alike.
3. The rates the step time is figured from are measured here on a GPU (``calibrate.py``; the slowest
   rank's), or the ``Machine`` defaults (on a CPU device).
4. Candidates (``candidates``), for the configured stage: the optimizer on the device, a quarter to all
   of it on the host, half or all of it on NVMe where ``nvme_path`` is given; stage 3's parameters on
   the device or the host; with ``activation_checkpointing_policy="auto"`` none, a quarter, half,
   three quarters or all of the repeated blocks recomputing. The fastest planned one whose peak
   allocated, with 5% to spare (``PLAN_MARGIN``), fits the device budget (and whose reserved fits the device), whose host memory fits the
   host budget and whose NVMe bytes fit the disk is taken; ties go to the earlier (less offloaded,
   less recomputed) candidate. None fits: one line naming what the least demanding one needs.
5. The config written from the choice (``policies.resolve``). A share of the optimizer on the host
   becomes ``offload_optimizer_ratio="auto"``: the first step runs with all of it on the host and then
   brings back as many units as the measured peak leaves room for (``offload/auto.py``), so the plan
   decides what kind of offload and the measurement how much.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zeroq.config import ZeroConfig, memory_budget
from lightning_zeroq.planning import calibrate as calibration
from lightning_zeroq.planning.estimate import (
    Activations,
    ForwardError,
    Machine,
    Need,
    estimate_config,
    mix_names,
    mixes,
    trace_activations,
)
from lightning_zeroq.ranks import rank_and_size
from lightning_zeroq.zero import activation_checkpoint as recompute_blocks
from lightning_zeroq.zero import comm
from lightning_zeroq.zero.memory.host import ACTIVATIONS, available, size
from lightning_zeroq.zero.offload.auto import MARGIN
from lightning_zeroq.zero.policies import (
    AutoRequest,
    Chosen,
    Host,
    Nvme,
    OnDevice,
    activation_mix,
    as_auto,
    auto_request,
    from_config,
    resolve,
)
from lightning_zeroq.zero.unit_plan import repeated_blocks

log = logging.getLogger("lightning_zeroq")

PLAN_MARGIN = 0.05
"""The planned peak allocated is fitted under the budget with this share to spare: the plan's accuracy
on one H200 (``docs/plan.md`` names the runs)."""

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The shares of the optimizer (on the host) and of the blocks (recomputing) a choice is made among."""


@dataclass(frozen=True)
class Choice:
    config: ZeroConfig
    """The config to build the engine with: the offload written in, no ``"auto"`` left."""
    recompute: tuple[nn.Module, ...]
    """Blocks that recompute besides what ``config`` names (a share below all of them; ``choose(apply=True)``
    set them to)."""
    need: Optional[Need]
    """The chosen configuration's plan."""
    line: str
    """The decision in one line (logged)."""
    planned: tuple[tuple[Chosen, Need], ...] = ()
    """Every candidate with its plan, in order of preference."""


@contextlib.contextmanager
def on_meta(module: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """``module`` with every parameter and buffer swapped for a meta tensor (floating parameters in
    ``dtype``, the working dtype), put back on exit. Tied parameters stay tied."""
    swapped: list[tuple[dict, str, Any]] = []
    metas: dict[int, Any] = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in metas:
                    kind = dtype if store is m._parameters and t.is_floating_point() else t.dtype
                    meta = torch.empty(t.shape, dtype=kind, device="meta")
                    metas[id(t)] = nn.Parameter(meta, t.requires_grad) if store is m._parameters else meta
                swapped.append((store, name, t))
                store[name] = metas[id(t)]
    try:
        yield module
    finally:
        for store, name, t in swapped:
            store[name] = t


def candidates(request: AutoRequest) -> list[tuple[str, Any, Any, tuple[float, float, bool]]]:
    """``(name, optimizer, parameters, (share of the blocks offloading, share recomputing, inputs on the
    host))`` in order of preference (less offloaded, less recomputed first; ``estimate.mixes``)."""
    # Without offload="auto" the offload stays as configured (``resolve`` leaves it): one kind, named so.
    optimizers: list[tuple[str, Any]] = [
        ("optimizer on the device" if request.offload else "offload as configured", OnDevice())
    ]
    parameters: list[tuple[str, Any]] = [("", OnDevice())]
    if request.offload:
        optimizers += [(f"{share:.0%} of the optimizer on the host", Host(share)) for share in SHARES[1:]]
        if request.nvme_path:
            optimizers += [
                (f"{share:.0%} of the optimizer on NVMe", Nvme(request.nvme_path, share)) for share in (0.5, 1.0)
            ]
        if request.stage == 3:
            parameters.append((", parameters on the host", Host()))
    blocks = mixes(request.recompute, request.activations, 1.0 if request.recompute_classes else 0.0)
    out = []
    for pname, params in parameters:
        for oname, opt in optimizers:
            for offload, share, inputs in blocks:
                recompute = (
                    f", {share:.0%} of the blocks recomputing{' (inputs on the host)' if inputs else ''}"
                    if request.recompute or (request.activations and share)
                    else ""
                )
                offloading = f", {offload:.0%} offloading their activations" if request.activations else ""
                out.append((oname + pname + recompute + offloading, opt, params, (offload, share, inputs)))
    return out


def _budgets(
    request: AutoRequest, device: torch.device, group: Any
) -> tuple[Optional[int], Optional[int], int, Optional[int]]:
    """(device budget, device size, host budget, disk free), the smallest over the ranks."""
    size = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    budget = memory_budget(request.device_budget, size if size is not None else 1 << 60)
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - MARGIN * total)
    found = available(request.host_budget)
    room = found.bytes if found is not None else None
    disk = None
    if request.nvme_path:
        disk = shutil.disk_usage(request.nvme_path).free
    unknown = float(1 << 62)
    out = [
        int(v) if v != unknown else None
        for v in _smallest([v if v is not None else unknown for v in (budget, size, room, disk)], device, group)
    ]
    return out[0], out[1], out[2] if out[2] is not None else int(unknown), out[3]


def _smallest(values: list[float], device: torch.device, group: Any) -> list[float]:
    """Each of ``values``' smallest over the ranks (negate for the largest), in one collective."""
    if rank_and_size(group)[1] == 1:
        return values
    both = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(both, dist.ReduceOp.MIN, group)
    return both.tolist()


def _agreed(flags: list[bool], steps: list[float], device: torch.device, group: Any) -> tuple[list[bool], list[float]]:
    """Every rank's ``flags`` and ``steps`` per candidate: true where true on every rank, the longest step."""
    values = _smallest([float(f) for f in flags] + [-s for s in steps], device, group)
    return [v == 1.0 for v in values[: len(flags)]], [-v for v in values[len(flags) :]]


def _agreed_machine(machine: Machine, device: torch.device, group: Any) -> Machine:
    """The slowest rank's rates (every rank plans alike)."""
    if rank_and_size(group)[1] == 1:
        return machine
    block = machine.block_seconds or (0.0, 0.0)
    r = _smallest(
        [
            machine.matmul_flops,
            machine.host_step_elements_per_s,
            machine.pcie_bytes_per_s,
            machine.nvme_bytes_per_s,
            -block[0],
            -block[1],
            machine.device_bytes_per_s,
        ],
        device,
        group,
    )
    return dataclasses.replace(
        machine,
        matmul_flops=r[0],
        host_step_elements_per_s=r[1],
        pcie_bytes_per_s=r[2],
        nvme_bytes_per_s=r[3],
        block_seconds=(-r[4], -r[5]) if machine.block_seconds else None,
        device_bytes_per_s=r[6],
    )


def choose(
    module: nn.Module,
    config: ZeroConfig,
    forward: Callable[[nn.Module], Tensor],
    *,
    device: Optional[torch.device] = None,
    param_dtype: torch.dtype = torch.float32,
    group: Any = None,
    world_size: Optional[int] = None,
    ranks_per_node: int = 1,
    machine: Optional[Machine] = None,
    calibrate: bool = True,
    apply: bool = True,
) -> Choice:
    """What ``config``'s ``"auto"`` settings come to for ``module`` (anywhere, even partly on the meta
    device) and one micro-batch (``forward(model)`` returns its loss): build the engine with the returned
    ``Choice.config``. With ``apply`` the blocks chosen to recompute (when some, not all, do) are set to
    recompute here. A ``ValueError`` of one line where nothing fits. ``machine``: rates to plan with
    instead of measuring them here (``calibrate``)."""
    request = auto_request(config)
    if request is None:
        return Choice(config, (), None, "")
    device = (
        device
        if device is not None
        else next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
    )
    world = world_size if world_size is not None else rank_and_size(group)[1]
    blocks = repeated_blocks(module)
    if request.recompute and not blocks:
        raise ValueError(
            "activation_checkpointing_policy='auto' recomputes repeated blocks, and this model has none "
            "(no class repeated in an nn.ModuleList or nn.Sequential); name the classes instead."
        )
    with on_meta(module, param_dtype) as meta:
        activations = _traced(meta, forward, blocks, device, group)
        budget, size, host_room, disk = _budgets(request, device, group)
        rates = (
            dataclasses.replace(machine, ranks_per_node=ranks_per_node)
            if machine is not None
            else _default_machine(device, ranks_per_node)
        )
        timed = machine is not None
        if calibrate and machine is None and device.type == "cuda":  # a CPU "device" (tests) plans with the defaults
            rates = dataclasses.replace(
                rates,
                **calibration.rates(
                    device,
                    param_dtype,
                    block=blocks[0] if blocks else None,
                    call=activations.block_call,
                    nvme_path=request.nvme_path if request.offload else None,
                ),
            )
            timed = True
        rates = _agreed_machine(rates, device, group)
        planned = []
        for name, opt, params, (offload, share, inputs) in candidates(request):
            chosen = Chosen(opt, params, share, offload, inputs)
            need = estimate_config(
                meta,
                resolve(config, chosen, (), correct=False),
                activations,
                name=name,
                world_size=world,
                checkpointing=share,
                machine=rates,
                param_dtype=param_dtype,
                rank=rank_and_size(group)[0],
                offloading=offload,
                inputs_on_host=inputs,
            )
            planned.append((chosen, need))
    if size is None and request.device_budget is None:
        budget = None  # a CPU device: no device memory to fit (host and disk still count)
    if request.device_budget is not None:
        of = f"offload_memory_budget={request.device_budget!r} ({_size(budget)})"
    elif budget is not None:
        of = f"the device's free memory less {MARGIN:.0%} of its size ({_size(budget)})"
    else:
        of = "no device budget (a CPU device: device memory not checked)"

    def fits(need: Need) -> bool:
        return (
            (budget is None or need.device_total * (1 + PLAN_MARGIN) <= budget)
            and (size is None or need.reserved <= size)
            and need.host_total * ranks_per_node <= host_room
            and (disk is None or need.nvme * ranks_per_node <= disk)
        )

    # A rank's shards differ by padding: a candidate fits where it fits every rank, at the slowest rank's step.
    fit_flags, steps = _agreed([fits(n) for _, n in planned], [n.step_s for _, n in planned], device, group)
    planned = [(c, dataclasses.replace(n, step_s=s)) for (c, n), s in zip(planned, steps)]
    fitting = [cn for cn, ok in zip(planned, fit_flags) if ok]
    if not fitting:
        least = min(planned, key=lambda cn: (cn[1].device_total, cn[1].host_total))[1]
        fixes = ["more GPUs", "a smaller micro-batch"]
        fixes += [] if request.recompute else ["activation_checkpointing_policy='auto'"]
        fixes += [] if request.nvme_path or not request.offload else ["nvme_path (NVMe offload)"]
        raise ValueError(
            f"offload='auto': nothing fits: the least device memory any configuration needs is {_size(least.device_total)} "
            f"allocated ({least.name}; budget: {of}), with {_size(least.host_total * ranks_per_node)} of host "
            f"memory (budget {_size(host_room)}); use {', '.join(fixes)} or a larger budget."
        )
    best = min(range(len(fitting)), key=lambda i: (fitting[i][1].step_s, i))
    chosen, need = fitting[best]
    names = [type(blocks[0]).__name__] if blocks else []
    on_host, _ = mix_names(module, blocks, chosen.offload_share, chosen.recompute_share, chosen.inputs_on_host)
    resolved = resolve(config, chosen, names, correct=device.type == "cuda", offloaded=on_host)
    recompute: tuple[nn.Module, ...] = ()
    if request.recompute and 0 < chosen.recompute_share < 1:
        recompute = tuple(
            blocks[i] for i in activation_mix(len(blocks), chosen.offload_share, chosen.recompute_share)[1]
        )
        if apply:
            recompute_blocks.apply_to(recompute)
    step = f"step ~{need.step_s:.3g} s" if timed else "step time not planned (no GPU to measure the rates on)"
    line = (
        f"offload='auto' chose {need.name}: planned peak {_size(need.device_total)} allocated "
        f"({_size(need.reserved)} reserved) of {of}, host {_size(need.host_total)} "
        f"of {_size(host_room)}, {step} ({len(fitting)} of {len(planned)} planned fit)"
    )
    log.info(line)
    return Choice(resolved, recompute, need, line, tuple(planned))


def _traced(
    meta: nn.Module, forward: Callable[[nn.Module], Tensor], blocks: Any, device: torch.device, group: Any
) -> Activations:
    """``trace_activations``, or one error on every rank where some rank's forward cannot run on the meta
    device (a value it reads, such as an integer count, that the meta device does not hold)."""
    failed: Optional[BaseException] = None
    activations = None
    try:
        activations = trace_activations(meta, forward, blocks)
    except ForwardError:
        raise  # the forward's own complaint, worded for the user (every rank alike: it is the same batch)
    except Exception as error:  # noqa: BLE001 - whatever the user's forward raises on meta tensors
        failed = error
    if _smallest([-float(failed is not None)], device, group)[0] < 0 or activations is None:
        what = (
            f"{type(failed).__name__}: {str(failed).strip().splitlines()[0] if str(failed).strip() else ''}"
            if failed is not None
            else "it failed on another rank"
        )
        raise ValueError(
            f"offload='auto' plans from one micro-batch traced on the meta device, and this one cannot "
            f"run there ({what}); pass plan_forward=lambda model: <one micro-batch's loss, reading no "
            "tensor's value> to the strategy, or choose the offload by hand (zeroq-plan shows what fits)."
        )
    return activations


def given_mix(
    module: nn.Module, blocks: list[nn.Module], recompute: tuple[str, ...], offload: tuple[str, ...]
) -> tuple[float, float, bool]:
    """``(share offloading, share recomputing, inputs on the host)`` of the repeated ``blocks`` under the class
    or qualified names a configuration gives (``activation_checkpointing_policy``, ``activation_offloading_policy``;
    a block named in both recomputes with its inputs on the host)."""
    if not blocks:
        return 0.0, 0.0, False
    qualified = {id(m): n for n, m in module.named_modules()}
    rec = [type(b).__name__ in recompute or qualified.get(id(b)) in recompute for b in blocks]
    off = [type(b).__name__ in offload or qualified.get(id(b)) in offload for b in blocks]
    alone = sum(o and not r for o, r in zip(off, rec))
    return alone / len(blocks), sum(rec) / len(blocks), any(o and r for o, r in zip(off, rec))


def report_first_step(choice: Choice, device: torch.device) -> None:
    """Log the device's peak since the engine was built beside what the choice planned (after the first
    optimizer step; on a GPU)."""
    if choice.need is None or device.type != "cuda":
        return
    log.info(
        f"offload='auto' ({choice.need.name}): peak after the first step {_size(torch.cuda.max_memory_allocated(device))} "
        f"allocated, {_size(torch.cuda.max_memory_reserved(device))} reserved; planned "
        f"{_size(choice.need.device_total)} and {_size(choice.need.reserved)}"
    )


def _size(value: Optional[int]) -> str:
    return "none" if value is None or value >= 1 << 61 else size(value)


def _default_machine(device: torch.device, ranks_per_node: int) -> Machine:
    """The default rates, with the CUDA libraries' workspaces where the device is a GPU (none on the CPU)."""
    workspaces = Machine.device_workspace_bytes if device.type == "cuda" else 0
    return Machine(ranks_per_node=ranks_per_node, device_workspace_bytes=workspaces)


def check_fits(
    module: nn.Module,
    config: ZeroConfig,
    forward: Callable[[nn.Module], Tensor],
    *,
    device: torch.device,
    param_dtype: torch.dtype,
    group: Any = None,
    ranks_per_node: int = 1,
    device_bytes: Optional[int] = None,
) -> None:
    """Before the engine is built on a GPU: the plan of ``config`` as given (``forward``: one micro-batch's
    loss, traced on the meta device). Where its peak surely exceeds what the device has free (the planned
    peak allocated, less ``PLAN_MARGIN``, above the free memory of the fullest rank), a ``ValueError`` of one
    line on every rank, naming the need, what is there, and the fastest configuration of the same stage that
    fits (what ``offload="auto"`` with ``activation_checkpointing_policy="auto"`` would choose).
    ``device_bytes``: the free memory to check against instead of the GPU's (a CPU device has none: no check)."""
    if device.type != "cuda" and device_bytes is None:
        return
    blocks = repeated_blocks(module)
    given = from_config(config, loss_scaling=False)
    offload, share, inputs = given_mix(module, blocks, given.recompute, given.activations.modules)
    need, failed = None, 0
    try:
        with on_meta(module, param_dtype) as meta:
            activations = trace_activations(meta, forward, blocks)
            need = estimate_config(
                meta,
                config,
                activations,
                name="the configuration as given",
                world_size=rank_and_size(group)[1],
                checkpointing=share,
                param_dtype=param_dtype,
                rank=rank_and_size(group)[0],
                machine=_default_machine(device, ranks_per_node),
                offloading=offload,
                inputs_on_host=inputs,
            )
    except Exception as error:  # a forward the meta device cannot run: no check, on every rank alike
        log.debug(f"the check before launch could not trace one micro-batch on the meta device ({error!r})")
        failed = 1
    free_here = device_bytes if device_bytes is not None else torch.cuda.mem_get_info(device)[0]
    found = available(config.host_memory_budget)
    moved = need.host.get(ACTIVATIONS, 0) if need is not None else 0
    host_room = found.bytes if found is not None and moved else 1 << 62  # checked here where activations go there
    # the fullest rank's room, the largest rank's need, whether any rank could not trace; the host's alike
    room_f, peak_f, ok, host_f, host_need_f = _smallest(
        [
            free_here,
            -(need.device_total if need else 0),
            -failed,
            host_room,
            -(need.host_total * ranks_per_node if need else 0),
        ],
        device,
        group,
    )
    room, peak, failed = int(room_f), -int(peak_f), int(-ok)
    host_need, host_room = -int(host_need_f), int(host_f)
    if not failed and need is not None and host_need > host_room:
        raise ValueError(
            f"ZeroQ: this configuration needs about {_size(host_need)} of host memory on this node "
            f"({_size(moved * ranks_per_node)} of it offloaded activations) and {_size(host_room)} is "
            "available; offload the activations of fewer blocks (activation_offloading_policy naming "
            "fewer modules, or 'auto' with activation_checkpointing_policy='auto'), recompute them "
            "(activation_checkpointing_policy), or set host_memory_budget where the host's memory grows "
            "as it is used."
        )
    if failed or need is None or peak * (1 - PLAN_MARGIN) <= room:
        return
    auto = as_auto(config, room / 2**30)
    try:
        nearest = (
            "the fastest that fits: "
            + choose(
                module,
                auto,
                forward,
                device=device,
                param_dtype=param_dtype,
                group=group,
                ranks_per_node=ranks_per_node,
                apply=False,
            ).need.name  # type: ignore[union-attr]
        )
        nearest += " (offload='auto', activation_checkpointing_policy='auto' choose it)"
    except ValueError:
        nearest = f"no offload or checkpointing setting of stage {given.sharding.stage} fits: use more GPUs or a smaller micro-batch"
    raise ValueError(
        f"ZeroQ: this configuration needs about {_size(peak)} of device memory at its peak "
        f"({_size(need.device['activations'])} of it activations), and the GPU has {_size(room)} free; {nearest}."
    )
