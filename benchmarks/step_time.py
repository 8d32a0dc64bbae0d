"""Whole-step time and peak memory of ZeroQ against DDP on a GPT-style model (GPU, NCCL).

The model and setting follow ``shared/reference/peers-and-limits.md`` section 9 so the figures line
up with the peers measured there: d=2048, 16 layers, 16 heads of 128, SwiGLU 5632, RMSNorm, vocab
32000, untied head (953M parameters), random tokens, micro-batch 4 x 1024 per GPU, bf16 autocast,
torch AdamW, median of ``--steps`` steps after ``--warmup``.

Arms run one after another in one launch (the link is fixed per launch by the NCCL environment).
Each arm builds its own model from the same seed and frees everything before the next, and its
peak is its own: the peak counter is reset after the model is built and the allocated bytes left
over from earlier arms are reported (``leftover_GiB``, expected 0)::

    torchrun --nproc-per-node 2 benchmarks/step_time.py --arms ddp,zeroq2,zeroq2+int8
    torchrun --nproc-per-node 2 benchmarks/step_time.py --arms zeroq3,zeroq3+offload_params
    torchrun --nproc-per-node 2 benchmarks/step_time.py --arms ddp,zeroq2,zeroq2+group1,zeroq2+group1+crossq,zeroq3,zeroq3+group1

An arm is ``ddp``, ``single`` (the floor: the same model and optimizer with no data parallelism at all,
world size 1 only; ``+compile``/``+compile_whole`` as for ``ddp``), a peer (``fsdp2`` with ``+keep``/``+offload_optimizer``; DeepSpeed ``ds2`` with
``+offload_optimizer``, ``ds3`` with ``+int8``/``+offload_optimizer``/``+offload_params``; see
``fsdp2_arm`` and ``deepspeed_arm``), or ``zeroq1/2/3``, optionally with ``+int8`` and ``+offload_optimizer`` (fp32
masters and AdamW state on the CPU) or ``+offload_params`` (stage 3: also the parameters), ``+qgrad``
(INT8 gradient reduction), ``+keep`` (stage 3, ``reshard_after_forward=False``) and ``+prefetch2``
(stage 3, two units prefetched), ``+ratio25/50/60/70/75/85/90`` (with ``+offload_optimizer``: partial offload,
``offload_optimizer_ratio``), ``+auto`` (with ``+offload_optimizer``: ``offload_optimizer_ratio="auto"`` under
``--budget``, ``offload_memory_budget``), ``+spec`` (with offload: ``offload_speculative_step``, host steps during
the backward), ``+async`` (with offload: ``offload_async_step``, the host step beside the next forward), ``+parts`` (the host
kernel's threads each take one fixed part of a call instead of chunks one after another), ``+plain`` (the
host kernel stores the bf16 copy through the caches instead of streaming it out), ``+group1/2/4`` (hybrid sharding, ``shard_group_size``: shard inside
groups of 1, 2 or 4 ranks, all-reduce across them) and ``+crossq`` (with a group option: INT8 gradients
across groups only, ``quantize_cross_group_only``). ``+clip`` (every arm): clip the gradients' global norm to ``CLIP`` before
every step, each the way its users do (``clip_grad_norm_``, DeepSpeed's ``gradient_clipping``).
``activations_GiB`` is what autograd saved for backward in one step (unique storages, parameters
excluded), measured on the first warm-up step. Rank 0 prints one JSON line per arm;
``python benchmarks/suite.py links`` runs them over the three links.

``--floor`` (arms with ``+offload_optimizer`` or ``+offload_params``): the host's floor measured beside the
arm's own steps. The timed steps run in blocks of ``--floor-block`` (3), each timed from a quiet start
to the end of its last step's host work (``engine.parts.worker.wait()``: an asynchronous step's work
counts in full, so a block gives up the overlap of its last step); after each block the same process
takes one step of torch's fused AdamW (``fused=True``, fp32 gradients, the threads the host step has)
over as many fp32 elements as the arm's model has, split into 8 tensors, as ``kernels.py host-adam`` does.
``step_s_median`` is then the median over blocks of a block's time per step, ``floor_s_median`` the
floor steps' median and ``over_floor_median`` the median of each block's time per step over the
floor step right after it. The host's speed drifts from minute to minute (the same fused step took
0.16 and 0.25 s in one process); a ratio taken block by block, seconds apart, does not carry that
drift, where a floor measured in another launch does.

Activations (``ACTIVATION_ARMS``, one per arm): ``+recompute`` recomputes every block in the backward
(``activation_checkpointing_policy=["Block"]``); ``+actoff`` offloads what ``--act-offload K`` blocks save
to pinned host memory (spread evenly, ``policies.activation_mix``), recomputes ``--act-recompute R`` of the
rest (the first ones), and with ``--act-inputs-cpu`` keeps those R blocks' checkpoint inputs on the host;
``+actauto`` lets the plan choose that mix (``lightning_zeroq.choose`` with both policies ``"auto"``,
calibrated on the GPU) under ``--act-budget`` GiB of peak allocated memory, or (``--act-budget recompute``,
the default) under the peak the same arm with ``+recompute`` measured earlier in the launch (with the plan's
5% margin: mixes planned at most at that peak): the same memory as recomputing everything; its line's
``plan`` says what it chose and its planned peak. An arm without any of them keeps every activation. Such an arm's line adds
``activation_offloading_policy``, ``activation_checkpointing_policy`` (the blocks, by name), the plan's
line (``+actauto``) and ``act_pinned_GiB`` (the host buffers it held). For the comparison the activation
suite runs (``python benchmarks/suite.py activations``): the three arms alternating, ``--repeat 2`` (each
arm run twice in turn; each run's ``--warmup`` steps are dropped, and with ``--drop-first-round`` the whole
first round too), optimizer on the host::

    torchrun --nproc-per-node 1 benchmarks/step_time.py --batch 4 --seq 4096 --repeat 2 \
        --arms zeroq2+offload_optimizer+recompute,zeroq2+offload_optimizer+actauto,zeroq2+offload_optimizer

Each round prints its arms' lines (``round``); after the last, one ``summary`` line per arm: its step
times, tokens/s and peaks per round counted. An arm that runs out of device memory (keeping every activation
of a large step), or whose plan finds nothing that fits, prints a line with ``error`` instead, at world size 1,
and the launch goes on.

``--loops fabric,trainer,fabric,trainer`` (arms ``zeroq1/2/3`` without options): the step time of ZeroQ
through Fabric against the Trainer instead, each loop in turn in one launch (alternating, so that drift
shows as a difference between repeats of the same loop)::

    torchrun --nproc-per-node 2 benchmarks/step_time.py --arms zeroq2 --loops fabric,trainer,fabric,trainer --steps 20 --warmup 5

Every loop builds ``GPT`` from the same seed, with ``precision="bf16-mixed"``,
``ZeroQ{Fabric,}Strategy(stage=...)``, torch AdamW (fused), the same random samples, one micro-batch per
step. A step is forward, backward, optimizer step and ``zero_grad``, timed with a device synchronization
on both sides: in the Fabric loop around those calls, in the Trainer from ``on_train_batch_start`` to
``on_train_batch_end`` (the batch is on the device before either); the slowest rank's median is the
loop's figure (``run_loops``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lightning_zeroq.cli.gpt import GPTConfig, GPTModel
from lightning_zeroq.zero.hooks import check_guards_in_full


class GPT(GPTModel):
    """The package's GPT with Llama-like blocks (RMSNorm, SwiGLU, no biases, no position embedding, untied
    head) and the layers' own initialization; ``forward`` returns the next-token loss."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, checkpoint: bool = False) -> None:
        super().__init__(GPTConfig(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=heads, ffn_hidden=ffn,
                                   norm="rmsnorm", mlp="swiglu", bias=False, learned_positions=False,
                                   tie_embeddings=False, init="torch"))
        self.checkpoint = checkpoint
        """``--checkpoint``: each block's activations recomputed in the backward (``torch.utils.checkpoint``,
        non-reentrant), as docs/migrating.md advises for models whose activations do not fit."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            x = self.drop(self.tok_emb(tokens))
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            logits = self.head(self.ln_f(x))
        else:
            logits = super().forward(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tokens.roll(-1, 1).view(-1))


def memory_bound(engine) -> dict:
    """The memory a ZeRO rank must hold on the GPU, from the engine's own accounting
    (``ZeroEngine.memory_report``): the sharded state that lives there (fp32 master and gradient
    shards, the optimizer's state, stage 3's stored shards: INT8 payloads, or working-dtype shards
    where the masters are offloaded; none at full width with the masters on the device, where each
    gather casts the master; offloaded pieces are on the host and not counted), persistent units at
    full width, and for stage 3 the largest transient unit twice (in use + prefetched). A gather's
    cast of this rank's shard is temporary and small beside its unit (1 / world size of it) and is
    not counted. The fp32 gradient shards (``gradient_shards_GiB``) are not in the bound: they exist
    only from the window's reductions to the end of its step, after the forward, where activations
    peak (``bound_plus_activations_GiB``), and while the backward frees them."""
    report = engine.memory_report()
    largest = report.pop("largest_transient_unit")
    state = sum(v for k, v in report.items() if k != "gradient_shards")
    gib = 2**30
    return {"state_GiB": round(state / gib, 2), "largest_unit_GiB": round(largest / gib, 3),
            "bound_GiB": round((state + 2 * largest) / gib, 2),
            **{f"{k}_GiB": round(v / gib, 2) for k, v in report.items()}}


ARM_STAGES = {"single": -1, "ddp": 0, "zeroq1": 1, "zeroq2": 2, "zeroq3": 3}
ARM_OPTIONS = ("int8", "offload_optimizer", "offload_params", "qgrad", "keep", "prefetch2", "ratio25", "ratio50", "ratio60", "ratio70", "ratio75", "ratio85", "ratio90",
               "auto", "spec", "async", "parts", "plain", "clip", "compile", "compile_whole", "group1", "group2", "group4", "crossq",
               "nvme", "spill25", "spill40", "spill50", "spill75", "muon", "recompute", "actoff", "actauto", "torchhost")
# +nvme (with +offload_optimizer / +offload_params): to NVMe swap files under --nvme-path instead of host memory
# +spillNN (with +offload_optimizer): the optimizer state of NN% of the parameters (largest units) to NVMe
# swap files under --nvme-path, the rest in host memory (offload_optimizer_nvme_ratio); parameters stay on the host
SPILLS = {"spill25": 0.25, "spill40": 0.4, "spill50": 0.5, "spill75": 0.75}
# Activations (ACTIVATIONS below): +recompute every block recomputes (activation_checkpointing_policy=["Block"]);
# +actoff the mix of --act-offload / --act-recompute / --act-inputs-cpu; +actauto the plan's mix under --act-budget
ACTIVATION_ARMS = {"recompute", "actoff", "actauto"}
# +torchhost (with offload): the host step with torch's fused CPU AdamW instead of lightning_zeroq's host kernel
SHARD_GROUPS = {"group1": 1, "group2": 2, "group4": 4}  # hybrid sharding: shard_group_size
# +compile (ddp, fsdp2, zeroq): block.compile() on every block (torchtitan's recipe; FSDP2's and stage 3's
# module hooks run outside the graphs); +compile_whole: torch.compile of the whole model (ddp: of the DDP
# module). "compile_s" is the warm-up steps' time beyond as many steady steps: compilation (dynamo,
# AOTAutograd, inductor, Triton) and any recompilation. TORCHINDUCTOR_FX_GRAPH_CACHE=0 and
# TORCHINDUCTOR_AUTOGRAD_CACHE=0 keep one arm from reusing another's graphs (Triton's kernel cache stays).
COMPILE = {"compile", "compile_whole"}
CLIP = 1.0  # +clip: gradient-norm clipping at this norm before every step (Lightning's gradient_clip_val)
RATIOS = {"ratio25": 0.25, "ratio50": 0.5, "ratio60": 0.6, "ratio70": 0.7, "ratio75": 0.75, "ratio85": 0.85, "ratio90": 0.9}  # partial optimizer offload (with +offload_optimizer)
PEERS = {  # the peers, beside zeroq in one launch: base -> the options it takes
    "fsdp2": {"keep", "offload_optimizer", "clip", "bf16reduce", *COMPILE},
    "ds2": {"offload_optimizer", "clip", "muon"},
    "ds3": {"int8", "offload_optimizer", "offload_params", "clip", "nvme", "muon"},
}


def parse_arm(arm: str) -> tuple[str, set[str]]:
    """``"zeroq3+int8"`` -> ``("zeroq3", {"int8"})``; raises ``SystemExit`` naming a bad arm."""
    base, *options = arm.split("+")
    allowed = PEERS.get(base, {"clip", *COMPILE} if base in ("ddp", "single") else set(ARM_OPTIONS) if base in ARM_STAGES else set())
    if ((base not in ARM_STAGES and base not in PEERS) or any(o not in allowed for o in options) or COMPILE <= set(options)
            or len(ACTIVATION_ARMS & set(options)) > 1):
        raise SystemExit(f"unknown arm {arm!r}: use ddp or single (+clip, +compile or +compile_whole), zeroq1/2/3 with optional +{'/+'.join(ARM_OPTIONS)}, or a peer: "
                         + ", ".join(f"{b} (+{'/+'.join(sorted(o))})" for b, o in PEERS.items()))
    return base, set(options)


def fsdp2_arm(model: nn.Module, options: set[str], dev: torch.device):
    """FSDP2 as torchtitan uses it: ``fully_shard`` per block and at the root, bf16 parameters in
    compute, fp32 gradient reduction (``+bf16reduce``: in bf16, as zeroq reduces); ``+keep``: ``reshard_after_forward=False``; ``+offload_optimizer``:
    ``CPUOffloadPolicy`` (FSDP2 offloads parameters, gradients and optimizer state together; the
    step runs on the CPU with torch's fused kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": "keep" not in options,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.bfloat16 if "bf16reduce" in options else torch.float32)}
    if "offload_optimizer" in options:
        if dev.type != "cuda":
            raise SystemExit("fsdp2+offload_optimizer needs a GPU (FSDP2's CPUOffloadPolicy moves state off an accelerator)")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, torch_finish(model, opt, options), opt


def torch_finish(model: nn.Module, opt: torch.optim.Optimizer, options: set[str]):
    """Backward, clipping with ``+clip``, step and ``zero_grad`` as with plain PyTorch (DDP, FSDP2)."""

    def finish(loss: torch.Tensor) -> None:
        loss.backward()
        if "clip" in options:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return finish


def deepspeed_arm(model: nn.Module, stage: int, options: set[str], args: argparse.Namespace):
    """DeepSpeed ZeRO-2/3 with its defaults, bf16, AdamW (``DeepSpeedCPUAdam`` under optimizer offload);
    ``+int8``: ``zero_quantized_weights`` (stage 3); ``+offload_optimizer`` / ``+offload_params``: to
    the CPU, pinned; ``+muon``: its own Muon (the hidden 2-D matrices; Adam for the rest), which needs
    ``reduce_scatter`` off."""
    import deepspeed

    zero: dict = {"stage": stage}
    if stage == 2:
        zero["reduce_bucket_size"] = int(args.bucket)
    if "int8" in options:
        zero["zero_quantized_weights"] = True
    where = {"device": "nvme", "nvme_path": args.nvme_path} if "nvme" in options else {"device": "cpu"}
    if "offload_optimizer" in options:
        zero["offload_optimizer"] = {**where, "pin_memory": True}
    if "offload_params" in options:
        zero["offload_param"] = {**where, "pin_memory": True}
    optimizer = {"type": "AdamW", "params": {"lr": 1e-4}}
    if "muon" in options:  # as the zeroq arms: lr 0.02, momentum 0.95, weight decay 0.1 on the matrices
        optimizer = {"type": "muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}}
        zero["reduce_scatter"] = False
    config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "zero_optimization": zero,
        "optimizer": optimizer,
        "gradient_clipping": CLIP if "clip" in options else 0.0,
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def finish(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return engine, finish


class SavedBytes:
    """Counts the bytes autograd saves for backward: unique storages, parameters' own excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.storages = model, {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._param_pointers():
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def _param_pointers(self) -> set[int]:
        pointers = set()
        for p in self.model.parameters():
            try:
                pointers.add(p.untyped_storage().data_ptr())
            except RuntimeError:  # a parameter without storage of its own (FSDP2's sharded DTensors)
                pass
        return pointers

    @property
    def gib(self) -> float:
        return sum(self.storages.values()) / 2**30


ON_GPU = torch.cuda.is_available()  # without CUDA: a gloo smoke run of the script itself (no memory figures)


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def allocated_gib(peak: bool = False) -> float:
    if not ON_GPU:
        return 0.0
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**30


def reserved_gib(peak: bool = False) -> float:
    """What the caching allocator holds from the device (what decides whether the next size fits)."""
    if not ON_GPU:
        return 0.0
    return (torch.cuda.max_memory_reserved() if peak else torch.cuda.memory_reserved()) / 2**30


def pinned_gib() -> float:
    """Pinned host memory now (CUDA): what torch's host allocator holds, and what lightning_zeroq
    registered exactly (``swap.buffers.pinned_empty``), which torch's statistics do not see."""
    if not ON_GPU:
        return 0.0
    from lightning_zeroq.swap.buffers import registered_bytes

    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    held = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0))
    return float(held + registered_bytes()) / 2**30


def host_rss_gib() -> float:
    """This process's resident host memory now (after the arm's steps: offloaded state included)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0.0
    return kib / 2**20


H200_BF16_DENSE_TFLOPS = 989.0


def throughput(num_params: int, args: argparse.Namespace, step_s: float) -> dict:
    """Tokens per step and per second over all ranks, model TFLOP/s per GPU (6 x parameters per token
    plus attention, 12 x layers x dim x sequence) and, on an H200, its share of the bf16 dense peak."""
    world = dist.get_world_size()
    tokens = args.batch * args.seq * world
    flops = tokens * (6 * num_params + 12 * args.layers * args.dim * args.seq)
    tflops = flops / step_s / world / 1e12
    out = {"tokens_per_step": tokens, "tokens_per_s": round(tokens / step_s), "tflops_per_gpu": round(tflops, 1)}
    if ON_GPU and "H200" in torch.cuda.get_device_name():
        out["mfu"] = round(tflops / H200_BF16_DENSE_TFLOPS, 3)
    return out


def gathered_counts(engine, dev: torch.device) -> list[float]:
    """Every rank's host bytes as the engine counts them before allocating (``zero/memory/host.py``)."""
    mine = torch.tensor([float(engine.parts.host_memory.need.total)], device=dev, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


class Arm(NamedTuple):
    """One arm, built: what its step calls (``forward``, ``finish``) and what owns its memory."""

    model: nn.Module
    forward: Callable
    finish: Callable
    engine: Any  # ZeroEngine for zeroq, else None
    optimizer: Any  # the torch optimizer (zeroq: the one attached to the engine), or DeepSpeed's ZeRO optimizer
    num_params: int


def build_arm(arm: str, args: argparse.Namespace, dev: torch.device) -> Arm:
    """The model (seed 0) wrapped as ``arm`` says, with its optimizer; no step taken."""
    base, options = parse_arm(arm)
    stage = ARM_STAGES.get(base, -1)
    if ("nvme" in options or options & SPILLS.keys()) and not getattr(args, "nvme_path", None):
        raise SystemExit(f"arm {arm!r}: +nvme needs --nvme-path DIR (a directory on a fast local disk; +spillNN too)")
    torch.manual_seed(0)
    meta = getattr(args, "meta", False) and stage > 0
    with torch.device("meta") if meta else contextlib.nullcontext():  # --meta: the engine materializes unit by unit
        model = GPT(args.vocab, args.dim, args.layers, args.heads, args.ffn, getattr(args, "checkpoint", False))
    if not meta:
        model = model.to(dev)
    num_params = sum(p.numel() for p in model.parameters())
    if "compile" in options:
        for block in model.blocks:
            block.compile()
    engine = None
    if base == "fsdp2":
        forward, finish, opt = fsdp2_arm(model, options, dev)
        if "compile_whole" in options:
            forward = torch.compile(forward)
    elif base in ("ds2", "ds3"):
        forward, finish = deepspeed_arm(model, int(base[2]), options, args)
        opt = forward.optimizer
    elif base == "single":  # the floor: no data parallelism, nothing communicated
        if dist.get_world_size() != 1:
            raise SystemExit(f"arm {arm!r} is the no-data-parallel floor: run it at world size 1")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        forward, finish = model, torch_finish(model, opt, options)
        if "compile_whole" in options:
            forward = torch.compile(model)
    elif stage == 0:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if ON_GPU else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        forward, finish = ddp, torch_finish(model, opt, options)
        if "compile_whole" in options:
            forward = torch.compile(ddp)
    else:
        from lightning_zeroq import ZeroConfig, ZeroEngine

        offload = bool(options & {"offload_optimizer", "offload_params"})
        extra = {}
        if "qgrad" in options:
            extra["quantized_gradients"] = True
        if "keep" in options:
            extra["reshard_after_forward"] = False
        if "prefetch2" in options:
            extra["stage3_prefetch_depth"] = 2
        for option in options & RATIOS.keys():
            extra["offload_optimizer_ratio"] = RATIOS[option]
        for option in options & SHARD_GROUPS.keys():
            extra["shard_group_size"] = SHARD_GROUPS[option]
        if "crossq" in options:
            extra.update(quantized_gradients=True, quantize_cross_group_only=True)
        if "auto" in options:
            extra["offload_optimizer_ratio"] = "auto"
            extra["offload_memory_budget"] = args.budget
        if "spec" in options:
            extra["offload_speculative_step"] = True
        if "async" in options:
            extra["offload_async_step"] = True
        if "nvme" in options:
            extra.update(offload_optimizer_device="nvme", nvme_path=args.nvme_path)
            if "offload_params" in options:
                extra["offload_params_device"] = "nvme"
        for spill in options & SPILLS.keys():
            extra.update(offload_optimizer_device="nvme", nvme_path=args.nvme_path,
                         offload_optimizer_nvme_ratio=SPILLS[spill])
        from lightning_zeroq.ops.host_adam import host_adam

        if offload and host_adam() is not None:  # +parts: the host kernel's threads each take one fixed part
            host_adam().set_chunk(0 if "parts" in options else 1 << 18)
            host_adam().set_stream_half("plain" not in options)  # +plain: the bf16 copy stored through the caches
        config = ZeroConfig(stage=stage, reduce_bucket_size=int(args.bucket) if stage < 3 else ZeroConfig().reduce_bucket_size,
                            quantized_weights="int8" in options, offload_optimizer=offload,
                            offload_parameters="offload_params" in options, **extra)
        config, plan_line = activation_config(model, config, options, args, dev)
        if "torchhost" in options and not offload:
            raise SystemExit(f"arm {arm!r}: +torchhost chooses the host step's kernel; add +offload_optimizer or +offload_params")
        with mock.patch("lightning_zeroq.zero.offload.host.host_adam", lambda: None) if "torchhost" in options else contextlib.nullcontext():
            engine = ZeroEngine(model, config, param_dtype=torch.bfloat16, device=dev)
        engine.plan_line = plan_line  # type: ignore[attr-defined]  # +actauto: the plan's choice, for the results
        if "muon" in options:  # Muon for the blocks' matrices, AdamW for the rest (the usual recipe)
            hidden = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
            rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
            optimizers = [torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.1),
                          torch.optim.AdamW(rest, lr=1e-4, fused=True)]
        else:
            optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)]
        opt = optimizers[-1]
        for optimizer in optimizers:
            engine.attach_optimizer(optimizer)
        forward = torch.compile(model) if "compile_whole" in options else model

        def finish(loss: torch.Tensor) -> None:
            engine.backward(loss, boundary=True)
            for optimizer in optimizers:
                if "clip" in options:
                    engine.clip_grad_norm_(CLIP, optimizer=optimizer if len(optimizers) > 1 else None)
                engine.step(optimizer if len(optimizers) > 1 else None)
            if len(optimizers) > 1:
                for optimizer in optimizers:
                    engine.zero_grad(optimizer)

    return Arm(model, forward, finish, engine, opt, num_params)


def activation_config(model: nn.Module, config, options: set[str], args: argparse.Namespace, dev: torch.device):
    """``config`` with the arm's activation option (``ACTIVATION_ARMS``) written in, and the plan's line (``+actauto``)."""
    from lightning_zeroq.zero.policies import activation_mix

    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    if "recompute" in options:
        return config.replace(activation_checkpointing_policy=["Block"]), ""
    if "actoff" in options:
        offloaded, recomputed = activation_mix(len(names), args.act_offload / len(names), args.act_recompute / len(names))
        on_host = offloaded + (recomputed if args.act_inputs_cpu else [])
        return config.replace(activation_offloading_policy=[names[i] for i in on_host] or None,
                              activation_checkpointing_policy=[names[i] for i in recomputed] or None), ""
    if "actauto" not in options:
        return config, ""
    from lightning_zeroq import choose

    budget = args.act_budget
    if budget == "recompute":  # the peak the +recompute twin measured earlier in this launch
        base = parse_arm(args.current_arm)[0]
        twin_options = (options - {"actauto"}) | {"recompute"}
        twin = "+".join([base, *sorted(twin_options)])
        peaks = [r["peak_alloc_GiB_per_rank"] for r in MEASURED if "error" not in r
                 and parse_arm(r["arm"]) == (base, twin_options)]
        if ON_GPU and not peaks:
            raise SystemExit(f"arm {args.current_arm!r}: --act-budget recompute needs the arm {twin!r} earlier in "
                             "--arms (its measured peak is the budget), or give --act-budget GiB")
        # The plan fits a candidate's planned peak, with PLAN_MARGIN to spare, under the budget: the twin's measured
        # peak with that margin lets every mix whose planned peak is at most that peak in.
        from lightning_zeroq.planning.choose import PLAN_MARGIN

        budget = max(peaks[-1]) * (1 + PLAN_MARGIN) if peaks and ON_GPU else None  # the CPU: no device to fit
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    auto = config.replace(activation_offloading_policy="auto", activation_checkpointing_policy="auto",
                          offload_memory_budget=budget)
    choice = choose(model, auto, lambda m: m(tokens), device=dev, param_dtype=torch.bfloat16,
                    world_size=dist.get_world_size())
    planned = f"; planned peak {choice.need.device_total / 2**30:.2f} GiB allocated" if choice.need is not None else ""
    return choice.config, choice.line + planned


MEASURED: list[dict] = []
"""The results of this launch's arms so far (``+actauto``'s ``--act-budget recompute`` reads its twin's peak)."""


class Floor:
    """``--floor``: torch's fused AdamW over ``numel`` fp32 elements (8 tensors), one step at a time."""

    def __init__(self, numel: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.params = [nn.Parameter(torch.randn(numel // 8, generator=gen)) for _ in range(8)]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=0.1, fused=True)
        self.optimizer.step()  # the state is made here, outside any timed step

    def time_step(self) -> float:
        start = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - start


_FLOOR: dict[int, Floor] = {}


def floor_for(numel: int) -> Floor:
    """One floor per launch (its 16 bytes per element are made once)."""
    if numel not in _FLOOR:
        _FLOOR.clear()
        _FLOOR[numel] = Floor(numel)
    return _FLOOR[numel]


def run_arm(arm: str, args: argparse.Namespace, dev: torch.device) -> dict:
    rank = dist.get_rank()
    leftover = allocated_gib()
    # Every arm compiles afresh: dynamo's code cache is per code object (Module._call_impl, Block.forward),
    # so an arm would otherwise reuse an earlier arm's graphs and recompilations (and, past dynamo's
    # recompile limit, run eagerly without a word).
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # this arm's graphs, breaks and recompiles alone
    rss_before, pinned_before = host_rss_gib(), pinned_gib()
    built = build_arm(arm, args, dev)
    model, forward, finish, engine, num_params = built.model, built.forward, built.finish, built.engine, built.num_params
    del built
    g = torch.Generator(device=dev).manual_seed(rank)
    saved = SavedBytes(model)
    times, warmup_times, floor_times = [], [], []
    floor = (floor_for(num_params) if args.floor and parse_arm(arm)[1] & {"offload_optimizer", "offload_params"}
             else None)
    sync()
    built_reserved = reserved_gib()
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        if args.memory_peak and ON_GPU and i == 1:
            torch.cuda.memory._record_memory_history(max_entries=500_000)
        if args.memory_peak and ON_GPU and i == 2:
            print_memory_peak(arm, torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        in_block = (i - args.warmup) % args.floor_block if floor is not None and i >= args.warmup else 0
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev, generator=g)
        if in_block == 0:
            if engine is not None and floor is not None:
                engine.parts.worker.wait()  # --floor: a block starts quiet (its last step's host work counts in full)
            sync()
            t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            # (not around activation offload's own hooks: it leaves a block inside others' hooks alone)
            if i == 0 and not parse_arm(arm)[1] & ACTIVATION_ARMS:
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    loss = forward(tokens)
            else:
                loss = forward(tokens)
        finish(loss)
        if floor is None or i < args.warmup:
            sync()
            (times if i >= args.warmup else warmup_times).append(time.perf_counter() - t0)
        elif in_block == args.floor_block - 1 or i == args.warmup + args.steps - 1:
            if engine is not None:
                engine.parts.worker.wait()  # the block's last host step counts in full
            sync()
            times.append((time.perf_counter() - t0) / (in_block + 1))
            floor_times.append(floor.time_step())
    peak, peak_reserved = allocated_gib(peak=True), reserved_gib(peak=True)
    compile_s = max(0.0, sum(warmup_times) - len(warmup_times) * statistics.median(times))
    if args.profile:
        profile_steps(arm, args, dev, forward, finish, g)
    rss = host_rss_gib()
    stats = torch.tensor([statistics.median(times), peak, loss.item(), saved.gib, leftover, rss, compile_s,
                          peak_reserved, built_reserved, rss - rss_before, pinned_gib() - pinned_before], device=dev)
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    result = {
        "arm": arm, "link": args.link, "params_M": round(num_params / 1e6, 1),
        "step_s_median": round(max(float(s[0]) for s in gathered), 4),
        "peak_alloc_GiB_per_rank": [round(float(s[1]), 2) for s in gathered],
        "peak_reserved_GiB_per_rank": [round(float(s[7]), 2) for s in gathered],
        "reserved_after_build_GiB_per_rank": [round(float(s[8]), 2) for s in gathered],
        "final_loss": round(float(gathered[0][2]), 4),
        "activations_GiB": round(float(gathered[0][3]), 2),
        "leftover_GiB": round(max(float(s[4]) for s in gathered), 3),
        "host_rss_GiB_per_rank": [round(float(s[5]), 2) for s in gathered],
        # What the arm added to the host (a launch's first arm: later arms reuse what earlier ones freed),
        # per parameter of the model over the ranks of this host.
        "host_rss_added_GiB_per_rank": [round(float(s[9]), 2) for s in gathered],
        "host_pinned_added_GiB_per_rank": [round(float(s[10]), 2) for s in gathered],
        "host_bytes_per_param": round(sum(float(s[9]) for s in gathered) * 2**30 / num_params, 2),
        "compile_s": round(max(float(s[6]) for s in gathered), 1),
        "world_size": dist.get_world_size(), "torch": torch.__version__,
    }
    result.update(throughput(num_params, args, float(result["step_s_median"])))
    if parse_arm(arm)[1] & {"compile", "compile_whole"}:
        counters = torch._dynamo.utils.counters  # what dynamo made of this arm (rank 0's), warm-up included
        result.update(dynamo_graphs=counters["stats"]["unique_graphs"],
                      dynamo_graph_breaks=sum(counters["graph_break"].values()),
                      dynamo_break_reasons=sorted({reason.splitlines()[0][:120] for reason in counters["graph_break"]}),
                      dynamo_recompiles=counters["recompiles"].get("total", sum(counters["recompiles"].values())))
    if "muon" in parse_arm(arm)[1]:
        result["newton_schulz_s"] = newton_schulz_seconds(args, dev)
    if floor_times:
        result.update(floor_s_median=round(statistics.median(floor_times), 4),
                      over_floor_median=round(statistics.median(t / f for t, f in zip(times, floor_times)), 3),
                      steps_s=[round(t, 4) for t in times], floor_s=[round(f, 4) for f in floor_times])
    if engine is not None and parse_arm(arm)[1] & ACTIVATION_ARMS:
        activations = engine.parts.activations
        offloaded, recomputed = engine.config.activation_offloading_policy, engine.config.activation_checkpointing_policy
        result.update(activation_offloading_policy=offloaded, activation_checkpointing_policy=recomputed,
                      act_pinned_GiB=round(activations.pool.held / 2**30, 2) if activations is not None else 0.0)
        if getattr(engine, "plan_line", ""):
            result["plan"] = engine.plan_line
    if engine is not None:
        result["host_counted_bytes_per_param"] = round(
            sum(float(s) for s in gathered_counts(engine, dev)) / num_params, 2)
        result.update(memory_bound(engine))
        result["bound_plus_activations_GiB"] = round(result["bound_GiB"] + result["activations_GiB"], 2)
        spec = getattr(getattr(engine.parts.placement, "host", engine.parts.placement), "spec", None)
        if spec is not None:  # offload_speculative_step: units whose early step stayed, and those undone
            c = spec.counts
            result.update(speculated_kept=c.kept, speculated_undone=c.undone, speculated_offered=c.offered,
                          speculated_unstarted=c.unstarted, speculation_landing_s=round(c.landing_s, 3),
                          speculation_stepping_s=round(c.stepping_s, 3))
        engine.close()
    del model, forward, finish, loss, saved
    engine = None
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned host blocks an offload arm left in torch's cache
            torch._C._host_emptyCache()
    return result


def newton_schulz_seconds(args: argparse.Namespace, dev: torch.device) -> float:
    """+muon: the time of one step's orthogonalizations alone (torch's Newton-Schulz iteration over every
    matrix Muon steps, on this device, as each rank runs them), the median of five."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    with torch.device("meta"):
        shapes = [p.shape for n, p in GPT(args.vocab, args.dim, args.layers, args.heads, args.ffn).named_parameters()
                  if n.startswith("blocks") and p.dim() == 2]
    matrices = [torch.randn(shape, device=dev) for shape in shapes]
    times = []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        for m in matrices:
            _zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7)
        sync()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[1:]), 4)


def print_memory_peak(arm: str, snapshot: dict) -> None:
    """``--memory-peak``: the device allocations live at the highest point of one recorded step (those
    made before the step, e.g. the model's own, are not in the record), summed by where they were made."""
    live, total, best, at_best = {}, 0, -1, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > best:
            best, at_best = total, dict(live)
    by_site: dict = {}
    for event in at_best.values():
        frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py")
                  and "/torch/" not in f["filename"]][:2]
        site = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames) or "?"
        by_site[site] = by_site.get(site, 0) + event["size"]
    print(f"[memory peak {arm}] {best / 2**30:.3f} GiB allocated in the step above what was live before it", file=sys.stderr)
    for site, size in sorted(by_site.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {size / 2**30:7.3f} GiB  {site[:160]}", file=sys.stderr)


def profile_steps(arm, args, dev, forward, finish, g) -> None:
    """Two more steps under ``torch.profiler`` (CPU and CUDA): a Chrome trace per rank in
    ``--profile`` and, on stderr, where the second step's wall time went: every ``zeroq.*`` range and
    the device's copies and collectives, as start and end (ms from the step's start) and totals."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    with profile(activities=activities) as prof:
        for i in range(2):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev, generator=g)
            sync()
            with record_function(f"bench.step{i}"):
                with record_function("bench.forward"), torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = forward(tokens)
                with record_function("bench.finish"):
                    finish(loss)
                sync()
    os.makedirs(args.profile, exist_ok=True)
    rank = dist.get_rank()
    prof.export_chrome_trace(os.path.join(args.profile, f"{arm.replace('+', '_')}_rank{rank}.json"))
    if rank != 0:
        return
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    step = next(e for e in events if e.name == "bench.step1")
    t0, t1 = step.time_range.start, step.time_range.end
    lines, totals = [], {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        s, t = e.time_range.start, e.time_range.end
        if s < t0 or s > t1:
            continue
        device = e.device_type.name == "CUDA"
        kind = ("memcpy " + e.name.split()[-1] if "Memcpy" in e.name or "memcpy" in e.name.lower() else
                "nccl" if "nccl" in e.name.lower() else None) if device else (e.name if e.name.startswith(("zeroq.", "bench.", "FSDP::", "Optimizer.step")) else None)
        if kind is None:
            continue
        totals[kind] = totals.get(kind, 0.0) + (t - s) / 1e3
        if not device or (t - s) > 200:
            lines.append(f"  {(s - t0) / 1e3:8.1f} {(t - t0) / 1e3:8.1f}  {'GPU' if device else 'CPU'} {e.name[:70]}")
    print(f"[profile {arm}] step {(t1 - t0) / 1e3:.1f} ms; totals (ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items())), file=sys.stderr)
    print("\n".join(lines[:400]), file=sys.stderr, flush=True)
    print(device_time(arm, events, t0, t1), file=sys.stderr, flush=True)


def device_time(arm: str, events, t0: float, t1: float, top: int = 20) -> str:
    """Where the device's time in ``[t0, t1]`` went: how long it was busy (the union of its kernels and
    copies), and the kernels taking the most of it, by name, with their counts (what an arm adds over
    another shows as rows the other lacks, or longer ones)."""
    spans, by_name = [], {}
    for e in events:
        s, t = e.time_range.start, e.time_range.end
        if e.device_type.name != "CUDA" or s < t0 or s > t1:
            continue
        spans.append((s, t))
        name = e.name[:90]
        total, count = by_name.get(name, (0.0, 0))
        by_name[name] = (total + (t - s) / 1e3, count + 1)
    busy, end = 0.0, float("-inf")
    for s, t in sorted(spans):
        if t > end:
            busy += (t - max(s, end)) / 1e3
            end = t
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return (f"[device {arm}] busy {busy:.1f} of {(t1 - t0) / 1e3:.1f} ms ({len(spans)} kernels and copies); the largest:\n"
            + "\n".join(f"  {total:8.2f} ms  x{count:<5d} {name}" for name, (total, count) in rows))


LOOPS = ("fabric", "trainer")  # --loops: the front door a zeroq arm is stepped through


class RandomTokens(torch.utils.data.Dataset):
    """``--loops``: sample ``i`` is the same random token sequence in every loop and on every run."""

    def __init__(self, n: int, vocab: int, seq: int) -> None:
        self.n, self.vocab, self.seq = n, vocab, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))


def loop_model(args: argparse.Namespace) -> GPT:
    """On the host, from one seed, in every loop; the engine moves it to the GPU unit by unit."""
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.ffn)


def loop_data(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """The same samples on the same rank in every loop (the Trainer would shuffle with its own sampler)."""
    from torch.utils.data import DataLoader, DistributedSampler

    n = (args.warmup + args.steps) * args.batch * dist.get_world_size()
    data = RandomTokens(n, args.vocab, args.seq)
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False)
    return DataLoader(data, batch_size=args.batch, sampler=sampler)


def run_fabric(stage: int, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Forward, backward, optimizer step and ``zero_grad`` in a Fabric loop, timed around those calls."""
    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy

    fabric = L.Fabric(accelerator="cuda" if ON_GPU else "cpu", devices=dist.get_world_size(), precision="bf16-mixed",
                      strategy=ZeroQFabricStrategy(stage=stage, reduce_bucket_size=int(args.bucket)))
    fabric.launch()
    model = fabric.setup(loop_model(args))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    times, losses = [], []
    for tokens in fabric.setup_dataloaders(loop_data(args), use_distributed_sampler=False):
        sync()
        t0 = time.perf_counter()
        loss = model(tokens)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    fabric.strategy.teardown()
    return times, losses


def run_trainer(stage: int, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The same through ``Trainer.fit``, timed from ``on_train_batch_start`` to ``on_train_batch_end``."""
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync()
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(float(outputs["loss"]))

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = loop_model(args)

        def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(tokens)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    timer = Timer()
    trainer = L.Trainer(accelerator="cuda" if ON_GPU else "cpu", devices=dist.get_world_size(),
                        precision="bf16-mixed", strategy=ZeroQStrategy(stage=stage, reduce_bucket_size=int(args.bucket)),
                        max_steps=args.warmup + args.steps, callbacks=[timer], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(LitGPT(), loop_data(args))
    return timer.times, timer.losses


def run_loop(loop: str, stage: int, args: argparse.Namespace) -> dict:
    """One ``--loops`` entry: the slowest rank's median step, each rank's peak, the first and last loss."""
    leftover = allocated_gib()
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    times, losses = (run_fabric if loop == "fabric" else run_trainer)(stage, args)
    gc.collect()
    peak = allocated_gib(peak=True)
    if ON_GPU:
        torch.cuda.empty_cache()
    dev = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    stats = torch.tensor([statistics.median(times[args.warmup:]), peak, leftover], device=dev)
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    return {
        "mode": loop, "stage": stage, "link": args.link,
        "step_s_median": round(max(float(s[0]) for s in gathered), 4),
        "peak_alloc_GiB_per_rank": [round(float(s[1]), 2) for s in gathered],
        "leftover_GiB": round(max(float(s[2]) for s in gathered), 3),
        "first_loss": round(losses[0], 4), "final_loss": round(losses[-1], 4),
        "steps": args.steps, "warmup": args.warmup, "world_size": dist.get_world_size(), "torch": torch.__version__,
    }


def run_loops(arms: list[str], args: argparse.Namespace) -> None:
    """``--loops``: each arm (``zeroq1/2/3``) through Fabric and through the Trainer, in the order given, in
    one launch; one JSON line per loop, then a ``summary`` line per arm: the mean of each loop's medians
    and ``fabric_over_trainer`` (1.00 = the same; the target is within 3%)."""
    loops = args.loops.split(",")
    if any(loop not in LOOPS for loop in loops):
        raise SystemExit(f"unknown loop in {args.loops!r}: use {', '.join(LOOPS)}")
    stages = []
    for arm in arms:
        base, options = parse_arm(arm)
        if base not in ("zeroq1", "zeroq2", "zeroq3") or options:
            raise SystemExit(f"--loops takes the arms zeroq1, zeroq2 and zeroq3 without options, not {arm!r}")
        stages.append(ARM_STAGES[base])
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if ON_GPU else "gloo")  # Fabric and the Trainer join it
    for stage in stages:
        results = []
        for loop in loops:
            results.append(run_loop(loop, stage, args))
            if dist.get_rank() == 0:
                print(json.dumps(results[-1]), flush=True)
        medians = {m: [r["step_s_median"] for r in results if r["mode"] == m] for m in LOOPS}
        if dist.get_rank() == 0 and all(medians.values()):
            fabric, trainer = (statistics.mean(medians[m]) for m in LOOPS)
            print(json.dumps({"summary": True, "stage": stage, "fabric_step_s": round(fabric, 4),
                              "trainer_step_s": round(trainer, 4), "fabric_over_trainer": round(fabric / trainer, 4),
                              "within_3pct": abs(fabric / trainer - 1) <= 0.03, "repeats": medians}), flush=True)
    dist.destroy_process_group()


def add_model_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    """The link, the model (defaults: the 953M GPT), the data shape and the timing, shared with the
    other GPT scripts here."""
    parser.add_argument("--link", default=os.environ.get("BENCH_LINK", "nvlink"))
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--bucket", type=float, default=2e8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", default="ddp,zeroq2", help="comma-separated, run in this order")
    add_model_arguments(parser, steps=10, warmup=3)
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--meta", action="store_true",
                        help="zeroq arms: build the model on the meta device; the engine materializes it unit by unit")
    parser.add_argument("--nvme-path", default=None, help="the +nvme arms' swap directory (a fast local disk)")
    parser.add_argument("--memory-peak", action="store_true", help="print what is live at one step's peak (print_memory_peak)")
    parser.add_argument("--budget", default=None, help="offload_memory_budget of the +auto arms (GiB, or e.g. '50%%')")
    parser.add_argument("--floor", action="store_true",
                        help="offload arms: a step of torch's fused AdamW over the model's elements after each block of timed steps (Floor)")
    parser.add_argument("--floor-block", type=int, default=3, help="with --floor: steps timed together before each floor step")
    parser.add_argument("--profile", default="", help="a folder: profile two more steps of each arm (profile_steps)")
    parser.add_argument("--loops", default="",
                        help="e.g. fabric,trainer,fabric,trainer: step each zeroq arm through these front doors instead (run_loops)")
    parser.add_argument("--repeat", type=int, default=1, help="run the arms this many times, in turn (rounds)")
    parser.add_argument("--drop-first-round", action="store_true", help="leave the first round out of the summary")
    parser.add_argument("--act-offload", type=int, default=None,
                        help="+actoff: blocks whose saved tensors go to the host, spread evenly (default a quarter)")
    parser.add_argument("--act-recompute", type=int, default=0, help="+actoff: blocks of the rest that recompute")
    parser.add_argument("--act-inputs-cpu", action="store_true",
                        help="+actoff: the recomputing blocks keep their checkpoint inputs on the host")
    parser.add_argument("--act-budget", default="recompute",
                        help="+actauto: GiB of peak allocated memory the plan fits the mix under, or 'recompute' "
                             "(the peak the arm's +recompute twin measured earlier in the launch)")
    args = parser.parse_args()
    if args.act_offload is None:
        args.act_offload = args.layers // 4
    if not 0 <= args.act_offload <= args.layers or not 0 <= args.act_recompute <= args.layers - args.act_offload:
        parser.error(f"--act-offload {args.act_offload} --act-recompute {args.act_recompute}: give block counts "
                     f"that add up to at most --layers ({args.layers})")
    if args.act_budget != "recompute":
        try:
            args.act_budget = float(args.act_budget)
        except ValueError:
            parser.error(f"--act-budget {args.act_budget}: give GiB (a number) or 'recompute'")
    if args.repeat < 1 or (args.drop_first_round and args.repeat < 2):
        parser.error(f"--repeat {args.repeat}: give 1 or more rounds (2 or more with --drop-first-round)")
    if args.loops:
        run_loops(args.arms.split(","), args)
        return
    # Every arm guards its compiled code alike: stage 3 turns dynamo's guard fast path over unchanged module
    # dictionaries off (torch 2.9-2.11), which would otherwise differ before and after a launch's first stage-3 arm.
    check_guards_in_full(())
    if args.floor_block < 1:
        parser.error(f"--floor-block {args.floor_block}: give the steps timed together before each floor step, 1 or more")
    arms = args.arms.split(",")
    for arm in arms:
        parse_arm(arm)  # fail before any work

    dist.init_process_group("nccl" if ON_GPU else "gloo")
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    for round_ in range(1, args.repeat + 1):
        for arm in arms:
            args.current_arm = arm
            result = run_or_report(arm, args, dev)
            if args.repeat > 1:
                result["round"] = round_
            MEASURED.append(result)
            if dist.get_rank() == 0:
                print(json.dumps(result), flush=True)
    if args.repeat > 1 and dist.get_rank() == 0:
        for summary in summaries(arms, MEASURED, first=2 if args.drop_first_round else 1):
            print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


def run_or_report(arm: str, args: argparse.Namespace, dev: torch.device) -> dict:
    """``run_arm``; at world size 1, an arm that runs out of device memory, or whose plan (``+actauto``) finds
    nothing that fits, is a line with ``error`` instead."""
    try:
        return run_arm(arm, args, dev)
    except (torch.OutOfMemoryError, ValueError) as error:
        if dist.get_world_size() > 1 or (isinstance(error, ValueError) and "nothing fits" not in str(error)):
            raise  # the other ranks wait in a collective (or a bug): end the launch
        first = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        what = "out of device memory" if isinstance(error, torch.OutOfMemoryError) else "the plan"
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
    return {"arm": arm, "error": f"{what}: {first[:300]}", "params_M": None}


def summaries(arms: list[str], results: list[dict], first: int = 1) -> list[dict]:
    """One line per arm over the rounds from ``first`` on: each round's step time, tokens/s and peaks, their mean."""
    out = []
    for arm in dict.fromkeys(arms):
        rounds = [r for r in results if r["arm"] == arm and r.get("round", 1) >= first]
        done = [r for r in rounds if "error" not in r]
        line: dict[str, Any] = {"summary": arm, "rounds": [r.get("round", 1) for r in rounds]}
        if done:
            line.update(step_s=[r["step_s_median"] for r in done], tokens_per_s=[r["tokens_per_s"] for r in done],
                        mean_tokens_per_s=round(statistics.mean(r["tokens_per_s"] for r in done)),
                        peak_alloc_GiB=max(max(r["peak_alloc_GiB_per_rank"]) for r in done),
                        peak_reserved_GiB=max(max(r["peak_reserved_GiB_per_rank"]) for r in done),
                        host_rss_GiB=max(max(r["host_rss_GiB_per_rank"]) for r in done))
        if len(done) < len(rounds):
            line["errors"] = [r["error"] for r in rounds if "error" in r]
        out.append(line)
    return out


if __name__ == "__main__":
    main()
