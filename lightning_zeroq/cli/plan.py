"""``zeroq-plan``: what each configuration needs and whether it fits, before launch, for a GPT of the
given shape (the package's GPT: ``--norm rmsnorm --mlp swiglu`` is Llama's block), built on the meta
device, so a 70B model plans on a laptop in seconds (``planning/estimate.py``). No GPU, nothing allocated.

    zeroq-plan --dim 4096 --layers 32 --heads 32 --ffn 11008 --batch 8 --seq 4096 \\
        --device-gib 139 --host-gib 120 --nvme-path /local/swap
    zeroq-plan --recipe gpt1m_zero3_offload_cpu model.n_layer=48   # a recipe of zeroq-train, with overrides

With ``--recipe``, the model, the micro-batch, the world size and the precision are the recipe's
(Hydra overrides as ``zeroq-train`` takes them), and the recipe's own ZeRO settings are planned first,
beside the other candidates.

Per configuration (stages 1-3; no offload, half or all of the optimizer on the host, parameters too,
NVMe where ``--nvme-path`` is given; each without and with checkpointing of every block and, where the
device's memory is known, the fastest mix of blocks that keep, offload to the host and recompute their
activations that fits and beats both), per rank:
device memory (allocated: state, gathered units, activations), host and disk memory, a first-order
step time from ``--tflops``, ``--host-elements-per-s``, ``--pcie-gbs`` and ``--nvme-gbs``, and
whether it fits; the fitting ones first, fastest first. The machine's memory is read from this
machine where not given (the GPU's where there is one, the host's available memory, the disk's free
space at ``--nvme-path``). Exit status: 0 if some configuration fits, 1 if none does.

``--model MODULE:NAME`` plans your own model, with ``--forward`` (run with the model on the meta device;
inputs built elsewhere are moved there) or ``--sample``; the tokens are counted from the token ids the
forward feeds, or given with ``--tokens``. ``--precision`` takes Lightning's names. Under the table the
fastest row that fits is printed as the ``Trainer`` and ``ZeroQStrategy`` arguments it means
(``--show-args``: every row's). Without a GPU or ``--device-gib`` the device is not checked, and the rows
say so. A bad value is one line naming it and the fix (exit status 2).

``--measure [N]`` then trains the N fastest fitting configurations (default all) for a few steps on this
machine, each in a process of its own (``cli/measure.py``), and prints the measured peaks (device
allocated and reserved, host), step time and tokens/s beside the predicted ones, with the error in per
cent; a configuration that fails to run is listed with its one-line error. ``--json FILE`` writes
every planned and measured row; ``--against FILE`` prints this plan beside the measured rows of such a
file, running nothing (a new plan model checked against measurements made before it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from lightning_zeroq.cli.gpt import GPTConfig, GPTModel, add_lora
from lightning_zeroq.planning.estimate import GIB, Machine, Need, estimate_training
from lightning_zeroq.zero.memory.host import available
from lightning_zeroq.zero.unit_plan import repeated_blocks

RUNTIME_HOST_GIB = 0.6
"""A process's CUDA runtime and libraries in host memory, GiB (measured: ``docs/plan.md``, the host column)."""


def _gib(value: Optional[float], what: str, parser: argparse.ArgumentParser) -> Optional[int]:
    if value is None:
        return None
    if not 0 < value < float("inf"):
        parser.error(f"{what}={value}: give the memory in GiB, above 0 and finite")
    return int(value * GIB)


def machine_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Machine:
    """The machine of the flags, what is not given read from this machine."""
    device = _gib(args.device_gib, "--device-gib", parser)
    if device is None and torch.cuda.is_available():
        device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    host = _gib(args.host_gib, "--host-gib", parser)
    if host is None:
        room = available(None)
        host = room.bytes if room is not None else None
    nvme = _gib(args.nvme_gib, "--nvme-gib", parser)
    if args.nvme_path and not os.path.isdir(args.nvme_path):
        parser.error(
            f"--nvme-path {args.nvme_path}: no such directory; give an existing directory on the disk to "
            "plan NVMe offload to (or leave --nvme-path out)"
        )
    if nvme is None and args.nvme_path:
        nvme = shutil.disk_usage(args.nvme_path).free
    for name in ("tflops", "host_elements_per_s", "pcie_gbs", "nvme_gbs", "reserved_per_allocated", "device_tbs"):
        if not 0 < getattr(args, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: give a rate above 0")
    runtime = args.runtime_host_gib
    if runtime is None:
        runtime = RUNTIME_HOST_GIB if torch.cuda.is_available() or args.device_gib is not None else 0.0
    if not 0 <= runtime < float("inf"):
        parser.error(f"--runtime-host-gib={runtime}: give GiB, 0 or more")
    block = None
    if args.block_ms is not None:
        try:
            forward, both = (float(v) / 1e3 for v in args.block_ms.split(","))
        except ValueError:
            parser.error(f"--block-ms {args.block_ms}: give two numbers, e.g. 1.03,2.91 (forward, forward+backward)")
        if not 0 < forward <= both < float("inf"):
            parser.error(f"--block-ms {args.block_ms}: the forward must be above 0 and at most forward+backward")
        block = (forward, both)
    return Machine(
        device,
        host,
        nvme,
        args.ranks_per_node,
        args.tflops * 1e12,
        args.host_elements_per_s,
        args.pcie_gbs * 1e9,
        args.nvme_gbs * 1e9,
        args.reserved_per_allocated,
        runtime_host_bytes=int(runtime * GIB),
        device_bytes_per_s=args.device_tbs * 1e12,
        block_seconds=block,
    )


def _recipe(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[GPTConfig, list, torch.dtype]:
    """The recipe's model, micro-batch, world size and precision (into ``args``), and the configurations to
    plan: the recipe's own first, then the other candidates."""
    from lightning_zeroq.cli.config import config_error_line, world_size_of
    from lightning_zeroq.cli.train import compose_config, recipe_names, to_run_config
    from lightning_zeroq.planning.estimate import candidates

    if args.recipe not in recipe_names():
        parser.error(f"--recipe {args.recipe}: no such recipe; the recipes are {', '.join(recipe_names())}")
    try:
        run = to_run_config(compose_config([f"recipe={args.recipe}", *args.overrides]))
    except Exception as error:  # Hydra's and the configs' own errors, as zeroq-train words them
        parser.error(f"--recipe {args.recipe}: {config_error_line(error)}")
    args.batch, args.seq = run.data.batch_size, run.data.seq_len
    args.lora = (run.finetune.lora_rank, run.finetune.lora_alpha) if run.finetune.lora_rank else None
    args.world_size = world_size_of(run.trainer) or run.trainer.num_nodes  # every node's ranks
    per_node = max(1, args.world_size // run.trainer.num_nodes)
    if args.ranks_per_node == 1:  # not given: the recipe's ranks per node (what shard_group_size="node" means)
        args.ranks_per_node = per_node
    dtype = torch.bfloat16 if run.trainer.precision.startswith("bf16") else torch.float32
    own = {f.name: getattr(run.zero, f.name) for f in dataclasses.fields(run.zero)}
    return run.model, [(f"recipe {args.recipe}", own), *candidates(args.nvme_path, bool(args.lora))], dtype


def _with_common_fields(
    args: argparse.Namespace, parser: argparse.ArgumentParser, configs: Optional[list]
) -> Optional[list]:
    """Every candidate with ``--shard-group-size`` and ``--quantized-weights`` (checked as ``ZeroConfig`` and
    the hybrid groups check them)."""
    from lightning_zeroq.config import ZeroConfig
    from lightning_zeroq.planning.estimate import candidates
    from lightning_zeroq.zero import hybrid

    common: dict = {}
    if args.shard_group_size is not None:
        size = args.shard_group_size if args.shard_group_size == "node" else None
        if size is None:
            try:
                size = int(args.shard_group_size)
            except ValueError:
                parser.error(f"--shard-group-size {args.shard_group_size}: give a number of ranks or 'node'")
        try:
            hybrid.shard_group_size(
                ZeroConfig(shard_group_size=size).shard_group_size, args.world_size, args.ranks_per_node
            )
        except ValueError as error:
            parser.error(f"--shard-group-size {args.shard_group_size}: {error}")
        common["shard_group_size"] = size
    if args.quantized_weights:
        common["quantized_weights"] = True
    if not common:
        return configs
    return [
        (name, {**fields, **common}) for name, fields in (configs or candidates(args.nvme_path, args.model is not None))
    ]


def gpt_on_meta(cfg: GPTConfig, batch: int, seq: int, dtype: torch.dtype) -> tuple[GPTModel, Any]:
    """The package's GPT on the meta device and ``forward(model)``: one micro-batch's cross-entropy loss
    (``batch`` x ``seq`` tokens, the logits in fp32), what the plan traces."""
    with torch.device("meta"):
        model = GPTModel(cfg).to(dtype)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")

    def forward(m: torch.nn.Module) -> torch.Tensor:
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))

    return model, forward


def _load(spec: str, flag: str, parser: argparse.ArgumentParser) -> Any:
    """``MODULE:NAME`` imported (the working directory on the path, as ``python -m`` has it)."""
    import importlib

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        parser.error(f"{flag} {spec}: give MODULE:NAME, e.g. mypackage.models:make_model")
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module_name) or not name.isidentifier():
        parser.error(
            f"{flag} {spec}: give MODULE:NAME, a module importable from here by its dotted name (not a "
            "path) and a name in it, e.g. mypackage.models:make_model"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    with _as_error(parser, f"{flag} {spec}: importing {module_name}"):
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        parser.error(f"{flag} {spec}: module {module_name!r} has no attribute {name!r}")
    return getattr(module, name)


@contextlib.contextmanager
def _as_error(parser: argparse.ArgumentParser, what: str, fix: str = "") -> Iterator[None]:
    """Whatever the user's code raises, or a ``sys.exit`` it calls, as one line naming ``what`` ran and
    ``fix`` (rc 2)."""
    try:
        yield
    except SystemExit as stop:
        parser.error(f"{what} called sys.exit({stop.code!r}); the plan needs it to return")
    except Exception as error:  # noqa: BLE001 - the user's code: any error is theirs to fix, in one line
        text = str(error).strip().splitlines()
        parser.error(f"{what} failed: {type(error).__name__}: {text[0] if text else ''}{fix}")


def _own_model(
    args: argparse.Namespace, parser: argparse.ArgumentParser, dtype: torch.dtype
) -> tuple[torch.nn.Module, Any, int]:
    """``--model`` built on the meta device (a LightningModule's ``configure_model`` too), the function that
    gives one micro-batch's loss, and the tokens it holds."""
    import lightning as L
    from lightning.fabric.utilities.apply_func import apply_to_collection

    from lightning_zeroq.lightning.plan_batch import training_step_loss

    make = _load(args.model, "--model", parser)
    with torch.device("meta"), _as_error(parser, f"--model {args.model}: building the model"):
        model = make()
        if isinstance(model, L.LightningModule):
            model.configure_model()
    if not isinstance(model, torch.nn.Module):
        parser.error(f"--model {args.model}: returned {type(model).__name__}, not an nn.Module")
    if next(model.parameters(), None) is None:
        parser.error(
            f"--model {args.model}: the model has no parameters, so there is nothing to plan; return the "
            "module that holds them (a LightningModule's configure_model builds them too)"
        )
    model = model.to(dtype)
    count = args.tokens
    if args.forward is not None:
        return model, _load(args.forward, "--forward", parser), count
    if not isinstance(model, L.LightningModule):
        parser.error(
            f"--sample {args.sample}: a plain nn.Module has no training_step; give --forward (a function "
            "of the model returning the loss)"
        )
    sample = _load(args.sample, "--sample", parser)
    with _as_error(parser, f"--sample {args.sample}"):
        batch = apply_to_collection(sample(), torch.Tensor, lambda t: t.to("meta"))
    return model, training_step_loss(batch, f"--sample {args.sample}: {{}}"), count


def table(needs: list[Need], tokens: int) -> str:
    header = (
        "| configuration | device GiB allocated | reserved | of it activations | host GiB | disk GiB | step s "
        "| tokens/s | fits |"
    )
    rows = [header, "|---|---|---|---|---|---|---|---|---|"]
    for n in needs:
        rate = f"{tokens / n.step_s:,.0f}" if n.step_s > 0 else "-"
        rows.append(
            f"| {n.name} | {n.device_total / GIB:.2f} | {n.reserved / GIB:.2f} | {n.device['activations'] / GIB:.2f} | "
            f"{n.host_total / GIB:.2f} | {n.nvme / GIB:.2f} | {seconds(n.step_s)} | {rate} | {fits(n)} |"
        )
    return "\n".join(rows)


def fits(need: Need) -> str:
    """The fits column: yes, no and why, or unchecked where the device's memory is not known."""
    if not need.fits:
        return "no: " + need.why
    return "yes" if need.device_checked else "unchecked (device)"


def seconds(value: float) -> str:
    """A step time: three decimals, or three significant digits where that would show 0.000."""
    return f"{value:.3f}" if value >= 0.001 or value == 0 else f"{value:.3g}"


PRECISIONS = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "32-true": torch.float32,
}
"""``--precision``: Lightning's names, as the strategies take them, and the working weights' dtype each plans."""
SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def strategy_args(need: Need, block: Optional[str], precision: str) -> str:
    """The ``Trainer`` arguments a row means: ``ZeroQStrategy`` with the row's ``ZeroConfig`` fields that
    differ from the defaults (the stage always), ``activation_checkpointing_policy`` naming the repeated
    block's class on a ``+checkpointing`` row, and the precision planned."""
    from lightning_zeroq.config import ZeroConfig

    default = ZeroConfig()
    given: dict[str, Any] = {"stage": need.config.stage}
    given.update(
        {
            f.name: getattr(need.config, f.name)
            for f in dataclasses.fields(ZeroConfig)
            if f.init and f.name != "stage" and getattr(need.config, f.name) != getattr(default, f.name)
        }
    )
    if need.checkpointing >= 1 and block:
        given["activation_checkpointing_policy"] = [block]
    return (
        f"Trainer(strategy=ZeroQStrategy({', '.join(f'{k}={v!r}' for k, v in given.items())}), precision={precision!r})"
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroq-plan", description=__doc__.split("\n\n")[0].replace("\n", " "))
    shape = parser.add_argument_group("the model (the package's GPT) and the batch")
    shape.add_argument("--dim", type=int, default=2048)
    shape.add_argument("--layers", type=int, default=16)
    shape.add_argument("--heads", type=int, default=16)
    shape.add_argument("--ffn", type=int, default=5632, help="hidden width of the MLP")
    shape.add_argument("--vocab", type=int, default=32000)
    shape.add_argument("--norm", choices=("rmsnorm", "layernorm"), default="rmsnorm")
    shape.add_argument("--mlp", choices=("swiglu", "gelu"), default="swiglu")
    shape.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and rank")
    shape.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    shape.add_argument("--world-size", type=int, default=1)
    shape.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default=None,
        help="Lightning's precision to plan (default bf16-mixed: bf16 working weights, fp32 masters; "
        "32-true: fp32 weights; 16-mixed: fp16); a recipe's is its own",
    )
    shape.add_argument(
        "--shard-group-size",
        default=None,
        help="hybrid sharding for every candidate: shard within groups of this many ranks (or 'node')",
    )
    shape.add_argument(
        "--quantized-weights",
        action="store_true",
        help="INT8 weights for every candidate (stage 3's stored payloads are INT8 groups)",
    )
    where = parser.add_argument_group("the machine (read from this one where not given)")
    where.add_argument("--device-gib", type=float, default=None)
    where.add_argument("--host-gib", type=float, default=None, help="host memory of one node")
    where.add_argument("--ranks-per-node", type=int, default=1)
    where.add_argument("--nvme-path", default=None, help="plan NVMe offload to this directory too")
    where.add_argument("--nvme-gib", type=float, default=None, help="free disk space (default: at --nvme-path)")
    where.add_argument("--tflops", type=float, default=400.0, help="achieved bf16 matmul TFLOP/s per GPU")
    where.add_argument(
        "--host-elements-per-s", type=float, default=5.0e9, help="optimizer elements the host steps per second (AdamW)"
    )
    where.add_argument("--pcie-gbs", type=float, default=40.0, help="host-device copy GB/s each way")
    where.add_argument("--nvme-gbs", type=float, default=3.0, help="disk read/write GB/s")
    where.add_argument(
        "--reserved-per-allocated",
        type=float,
        default=Machine.reserved_per_allocated,
        help="the device memory the allocator reserves per byte allocated at the peak",
    )
    shape.add_argument("--recipe", default=None, help="plan a zeroq-train recipe (conf/ and recipes/) instead")
    shape.add_argument(
        "--model",
        default=None,
        metavar="MODULE:NAME",
        help="plan your own model instead: a class or factory of no arguments returning an nn.Module "
        "or LightningModule (built on the meta device)",
    )
    shape.add_argument(
        "--sample",
        default=None,
        metavar="MODULE:NAME",
        help="with a LightningModule --model: a function returning one micro-batch for training_step",
    )
    shape.add_argument(
        "--forward",
        default=None,
        metavar="MODULE:NAME",
        help="with --model: a function of the model returning one micro-batch's loss (any module); "
        "it runs with the model on the meta device, and inputs it builds elsewhere are moved "
        "there (build them with device='meta' to allocate nothing)",
    )
    shape.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="with --model: tokens per micro-batch and rank (default: the elements of the first "
        "integer tensor, the token ids, that the forward or training_step calls a module with; "
        "required where it calls none)",
    )
    shape.add_argument("overrides", nargs="*", help="with --recipe: Hydra overrides, as zeroq-train takes them")
    where.add_argument("--device-tbs", type=float, default=3.0, help="device memory TB/s (its optimizer step)")
    where.add_argument(
        "--block-ms",
        default=None,
        metavar="F,FB",
        help="one block's forward and forward+backward in ms at this micro-batch (as --calibrate "
        "prints them), for the blocks' compute instead of --tflops",
    )
    where.add_argument(
        "--runtime-host-gib",
        type=float,
        default=None,
        help=f"host memory of each process's CUDA runtime (default: measured with --calibrate on a GPU, "
        f"else {RUNTIME_HOST_GIB} where a GPU is given or found, else 0)",
    )
    where.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the rates on this machine (one block at the micro-batch, the host step, "
        "copies, the disk at --nvme-path; on a GPU the CUDA runtime's host memory too) instead "
        "of the flags above",
    )
    check = parser.add_argument_group("measuring the plan on this machine")
    check.add_argument(
        "--measure",
        nargs="?",
        type=int,
        const=0,
        default=None,
        metavar="N",
        help="train the N fastest fitting configurations (default: all) a few steps each and "
        "print measured beside predicted",
    )
    check.add_argument("--only", default=None, help="with --measure: comma-separated configuration names to run")
    check.add_argument("--steps", type=int, default=3, help="with --measure: timed steps per configuration")
    check.add_argument("--warmup", type=int, default=2, help="with --measure: untimed steps first")
    check.add_argument("--timeout", type=float, default=600.0, help="with --measure: seconds per configuration")
    check.add_argument(
        "--show-args",
        action="store_true",
        help="print every row's Trainer and ZeroQStrategy arguments (the fastest that fits: always)",
    )
    check.add_argument("--json", default=None, help="write the planned (and measured) rows to this file")
    check.add_argument(
        "--against",
        default=None,
        metavar="FILE",
        help="print this plan beside the measured rows of an earlier --measure --json FILE (same "
        "shape and rates given as flags), without running anything",
    )
    args = parser.parse_args(argv)
    if args.measure is not None and args.measure < 0:
        parser.error(f"--measure {args.measure}: give how many configurations to run (0 or none: all that fit)")
    for name in ("steps", "warmup"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            parser.error(f"--{name}={getattr(args, name)}: give a whole number, {1 if name == 'steps' else 0} or more")
    if args.against is not None and args.measure is not None:
        parser.error("--against FILE compares with rows measured before; --measure measures now: give one of them")
    if args.model is not None and args.recipe:
        parser.error("--model and --recipe: give one of them")
    if args.model is not None and (args.sample is None) == (args.forward is None):
        parser.error(
            f"--model {args.model}: give --sample (a LightningModule's micro-batch) or --forward (a function "
            "of the model returning the loss), one of them"
        )
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens={args.tokens}: give the tokens per micro-batch and rank, 1 or more")
    if args.model is None and (args.sample or args.forward or args.tokens):
        parser.error("--sample, --forward and --tokens go with --model (your own model)")
    if args.overrides and not args.recipe:
        parser.error(f"{args.overrides}: overrides need --recipe NAME (the model's shape is given by flags otherwise)")
    for name in ("dim", "layers", "heads", "ffn", "vocab", "batch", "seq", "world_size", "ranks_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: give a whole number, 1 or more")
    if args.recipe and args.precision:
        parser.error(
            f"--precision {args.precision}: a recipe plans its own precision; override it as "
            f"trainer.precision={args.precision}"
        )
    precision = args.precision or "bf16-mixed"
    configs, dtype = None, PRECISIONS[precision]
    if args.recipe:
        cfg, configs, dtype = _recipe(args, parser)
        precision = {torch.bfloat16: "bf16-mixed", torch.float32: "32-true"}.get(dtype, precision)
    else:
        try:
            cfg = GPTConfig(
                vocab_size=args.vocab,
                block_size=args.seq,
                n_layer=args.layers,
                n_head=args.heads,
                n_embd=args.dim,
                ffn_hidden=args.ffn,
                norm=args.norm,
                mlp=args.mlp,
                bias=False,
                learned_positions=False,
                tie_embeddings=False,
                init="torch",
            )
        except ValueError as error:
            parser.error(str(error))
    if args.ranks_per_node > args.world_size:
        parser.error(
            f"--ranks-per-node {args.ranks_per_node} is more than --world-size {args.world_size}: give "
            f"the ranks of one node, at most {args.world_size} (host memory is counted for that many)"
        )
    configs = _with_common_fields(args, parser, configs)
    machine = machine_from(args, parser)
    count: Optional[int]
    if args.model is not None:
        model, forward, count = _own_model(args, parser, dtype)
        what = f"--forward {args.forward}" if args.forward else f"--sample {args.sample}"
    else:
        flags = (
            f"--dim {args.dim} --layers {args.layers} --heads {args.heads} --ffn {args.ffn} --vocab {args.vocab} "
            f"--batch {args.batch} --seq {args.seq}"
        )
        with _as_error(parser, f"{flags}: building the model on the meta device", "; give smaller sizes"):
            model, forward = gpt_on_meta(cfg, args.batch, args.seq, dtype)
        if getattr(args, "lora", None):  # a fine-tuning recipe: its LoRA factors train, the rest is frozen
            add_lora(model, *args.lora)
        count, what = args.batch * args.seq, flags

    device = None
    if args.calibrate:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda" and args.runtime_host_gib is None:  # not given: measured
            runtime = runtime_host_bytes(args.timeout)
            if runtime is not None:
                machine = dataclasses.replace(machine, runtime_host_bytes=runtime)
                print(
                    f"calibrated here: a process's CUDA runtime and libraries hold {runtime / GIB:.2f} GiB of host "
                    "memory",
                    flush=True,
                )
    try:
        needs = estimate_training(
            model,
            forward,
            tokens=count,
            world_size=args.world_size,
            machine=machine,
            configs=configs,
            nvme_path=args.nvme_path,
            param_dtype=dtype,
            calibrate_on=device,
        )
    except SystemExit as stop:
        parser.error(f"{what}: the forward called sys.exit({stop.code!r}); the plan needs it to return the loss")
    except Exception as error:  # noqa: BLE001 - the user's forward, traced on the meta device: one line
        text = str(error).strip().splitlines()
        line = f"{type(error).__name__}: {text[0] if text else ''}"
        if "no integer tensor" in line:
            parser.error(
                f"{what}: the forward calls no module with an integer tensor (token ids) to count the "
                "tokens from; give --tokens (tokens per micro-batch and rank)"
            )
        parser.error(
            f"{what}: planning failed on the meta device ({line}); the forward runs with the model on "
            "the meta device, so it can read no tensor's value (an integer count, a condition)"
        )
    traced = needs[0].traced
    if count is None:
        count = needs[0].tokens
    elif args.model is not None and traced is not None and traced.tokens and traced.tokens != count:
        print(
            f"note: --tokens {count:,} counts the step time, and the forward feeds {traced.tokens:,} token ids, "
            "which the memory is traced from",
            flush=True,
        )
    params = sum(p.numel() for p in model.parameters())
    known = ", ".join(
        f"{k} {v / GIB:.1f} GiB"
        for k, v in (("device", machine.device_bytes), ("host", machine.host_bytes), ("disk", machine.nvme_bytes))
        if v is not None
    )
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    shown = f"{count:,}" if args.model is not None else f"{args.batch} x {args.seq}"
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if frozen:
        size += f" ({frozen / params:.1%} frozen: stage 3 shards them, in their own dtype or frozen_int8's INT8)"
    print(
        f"{size} parameters, {shown} tokens per micro-batch and rank, world size "
        f"{args.world_size}; machine: {known or 'memory unknown (nothing checked)'}; per rank, "
        f"{precision} ({SHORT[dtype]} weights), AdamW:\n"
    )
    print(table(needs, count))
    blocks = repeated_blocks(model)
    block = type(blocks[0]).__name__ if blocks else None
    if traced is not None and traced.self_checkpointed:
        print(
            f"\nthe model recomputes its {block} blocks itself (each saves only its input): no +checkpointing "
            "rows, and what a block holds while it recomputes is not counted"
        )
    if machine.device_bytes is None:
        print(
            '\nthe device\'s memory was not checked (no GPU here and no --device-gib): "unchecked" rows fit '
            "the host and the disk; pass --device-gib to check the device too"
        )
    best = next((n for n in needs if n.fits), None)
    fitting = "fastest that fits" if machine.device_bytes is not None else "fastest, the device unchecked"
    print(
        f"\n{fitting}: {best.name} ({seconds(best.step_s)} s a step)\n  as {strategy_args(best, block, precision)}"
        if best
        else "\nnothing fits: more ranks, a smaller micro-batch, or NVMe offload (--nvme-path)"
    )
    if args.show_args:
        print("\nthe arguments of each row:")
        for need in needs:
            print(f"  {need.name}: {strategy_args(need, block, precision)}")
    rows = [planned_row(n, count) for n in needs]
    if args.measure is not None:
        if args.recipe or args.model:
            parser.error(
                "--measure runs the package's GPT of the given shape (one process per configuration and "
                "rank); plan a recipe or your own model without it"
            )
        if args.world_size != args.ranks_per_node:
            parser.error(
                f"--measure runs the ranks on this machine: give --ranks-per-node {args.world_size} with "
                f"--world-size {args.world_size} (a plan across nodes is measured by launching it there)"
            )
        chosen = [n for n in needs if n.fits]
        if args.only:
            names = args.only.split(",")
            unknown = [name for name in names if name not in {n.name for n in needs}]
            if unknown:
                parser.error(f"--only {','.join(unknown)}: no such configuration; the table above names them")
            chosen = [n for n in needs if n.name in names]
        chosen = chosen[: args.measure or None]
        rows = measure_all(chosen, rows, cfg, args)
    if args.against is not None:
        rows = against(rows, args.against, parser)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return 0 if best else 1


def runtime_host_bytes(timeout: Optional[float] = None) -> Optional[int]:
    """Host memory a training process's CUDA runtime and libraries take on this machine, measured as
    ``--measure`` counts a configuration's (``cli/measure.py``): a two-block GPT of width 64 trained for two
    steps in a fresh process, stage 2, nothing offloaded, so that all it holds on the host is the runtime's.
    None where that run fails."""
    from lightning_zeroq.cli.measure import measure

    tiny = GPTConfig(
        vocab_size=256,
        block_size=32,
        n_layer=2,
        n_head=2,
        n_embd=64,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        learned_positions=False,
        tie_embeddings=False,
        init="torch",
    )
    got = measure(
        {
            "gpt": dataclasses.asdict(tiny),
            "config": {"stage": 2},
            "checkpointing": 0.0,
            "batch": 2,
            "seq": 32,
            "warmup": 1,
            "steps": 1,
        },
        timeout=timeout,
    )
    return got.get("host_bytes")


def planned_row(need: Need, tokens: int) -> dict:
    return {
        "configuration": need.name,
        "fits": need.fits,
        "device_checked": need.device_checked,
        "predicted_allocated_GiB": round(need.device_total / GIB, 2),
        "predicted_reserved_GiB": round(need.reserved / GIB, 2),
        "predicted_host_GiB": round(need.host_total / GIB, 2),
        "predicted_disk_GiB": round(need.nvme / GIB, 2),
        "predicted_step_s": round(need.step_s, 4),
        "tokens_per_step": tokens,
    }


def measure_all(chosen: list[Need], rows: list[dict], cfg: GPTConfig, args: argparse.Namespace) -> list[dict]:
    """Run each chosen configuration (``cli/measure.py``) and print predicted beside measured."""
    from lightning_zeroq.cli.measure import measure

    by_name = {row["configuration"]: row for row in rows}
    per = "configuration" if args.world_size == 1 else f"rank, {args.world_size} ranks; the largest peaks of any rank"
    print(f"\nmeasured on this machine ({args.warmup} + {args.steps} steps each, one process per {per}):\n")
    print("| configuration | allocated GiB predicted / measured | reserved GiB | host GiB | step s | tokens/s |")
    print("|---|---|---|---|---|---|")
    for i, need in enumerate(chosen):
        print(f"[{i + 1}/{len(chosen)}] {need.name} ...", file=sys.stderr, flush=True)
        fields = {f.name: getattr(need.config, f.name) for f in dataclasses.fields(need.config) if f.init}
        spec = {
            "gpt": dataclasses.asdict(cfg),
            "config": fields,
            "checkpointing": need.checkpointing,
            "batch": args.batch,
            "seq": args.seq,
            "warmup": args.warmup,
            "steps": args.steps,
        }
        got = measure(spec, timeout=args.timeout, world_size=args.world_size)
        row = by_name[need.name]
        if "error" in got:
            row["error"] = got["error"]
            print(f"| {need.name} | failed: {got['error']} | | | | |", flush=True)
            continue
        row.update(
            measured_allocated_GiB=round(got.get("allocated_bytes", 0) / GIB, 2),
            measured_reserved_GiB=round(got.get("reserved_bytes", 0) / GIB, 2),
            measured_host_GiB=round(got["host_bytes"] / GIB, 2),
            measured_step_s=round(got["step_s"], 4),
        )
        tokens = args.batch * args.seq
        rate = "/".join(f"{tokens / s:,.0f}" if s else "-" for s in (need.step_s, got["step_s"]))
        print(
            f"| {need.name} | {_pair(row, 'allocated_GiB')} | {_pair(row, 'reserved_GiB')} | "
            f"{_pair(row, 'host_GiB')} | {_pair(row, 'step_s')} | {rate} |",
            flush=True,
        )
    return rows


KINDS = (("allocated_GiB", 0.05), ("reserved_GiB", 0.10), ("host_GiB", 0.10), ("step_s", 0.15))
"""What ``--measure`` and ``--against`` compare, each with the error the plan aims within (``docs/plan.md``)."""


def against(rows: list[dict], path: str, parser: argparse.ArgumentParser) -> list[dict]:
    """This plan's rows beside the measured ones of ``path`` (an earlier ``--measure --json``): printed as
    ``--measure`` prints them, then how many of each kind fall within their aim."""
    try:
        stored = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        parser.error(f"--against {path}: cannot read it as the JSON lines of --json ({error})")
    measured = {row["configuration"]: row for row in stored if "measured_step_s" in row}
    if not measured:
        parser.error(f"--against {path}: no measured row in it (write one with --measure --json FILE)")
    by_name = {row["configuration"]: row for row in rows}
    unknown = sorted(set(measured) - set(by_name))
    if unknown:
        parser.error(f"--against {path}: {', '.join(unknown)} not planned here; plan the same shape and candidates")
    print(f"\nthis plan beside the measurements of {Path(path).name}:\n")
    print("| configuration | allocated GiB predicted / measured | reserved GiB | host GiB | step s |")
    print("|---|---|---|---|---|")
    within = {kind: 0 for kind, _ in KINDS}
    for name, got in measured.items():
        row = by_name[name]
        row.update({f"measured_{kind}": got[f"measured_{kind}"] for kind, _ in KINDS})
        print(f"| {name} | {' | '.join(_pair(row, kind) for kind, _ in KINDS)} |")
        for kind, aim in KINDS:
            planned, value = row[f"predicted_{kind}"], row[f"measured_{kind}"]
            within[kind] += bool(value) and abs(planned - value) <= aim * value
    print(
        "\nwithin the aim, of "
        + str(len(measured))
        + ": "
        + ", ".join(f"{kind.split('_')[0]} (+-{aim:.0%}) {within[kind]}" for kind, aim in KINDS)
    )
    return rows


def _pair(row: dict, kind: str) -> str:
    """``predicted / measured (error of the prediction in per cent of the measured)``."""
    planned, measured = row[f"predicted_{kind}"], row[f"measured_{kind}"]
    error = f" ({100 * (planned - measured) / measured:+.0f}%)" if measured else ""
    return f"{planned:g} / {measured:g}{error}"


if __name__ == "__main__":
    sys.exit(main())
