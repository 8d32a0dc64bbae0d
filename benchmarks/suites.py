"""The benchmark suites that ``benchmarks/suite.py`` runs: each a list of launches of the scripts in this
folder through their command lines (arms x model x world size x link), with a time limit per launch.

A launch's arguments may hold ``{scratch}`` (a scratch folder for checkpoints and snapshots, default the
system temp dir), ``{out}`` (the results folder) and ``{cores}`` (this machine's CPU cores); its
environment may hold ``{threads}`` (the cores per rank: the host step of the offload arms needs them, and
``torchrun`` would set ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# NCCL's link per launch (step_time.py reads BENCH_LINK to name it in its results).
LINKS: dict[str, dict[str, str]] = {
    "nvlink": {},
    "shm": {"NCCL_P2P_DISABLE": "1"},  # through host memory
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},
}

# The model flags of step_time.py and checkpoints.py save-load (their GPT).
MODELS: dict[str, tuple[str, ...]] = {
    "953m": (),  # the scripts' default: d=2048, 16 layers, SwiGLU 5632, vocab 32000, untied head
    "1b": ("--layers", "17"),  # 1.005B parameters
    "3800m": ("--dim", "3072", "--layers", "32", "--heads", "24", "--ffn", "8192"),  # 3.82B parameters
    "3370m": ("--dim", "3072", "--layers", "28", "--heads", "24", "--ffn", "8192"),  # 3.37B parameters
    "7b": ("--dim", "4096", "--layers", "32", "--heads", "32", "--ffn", "11008"),  # 6.74B parameters (Llama-7B's shape)
    "tiny": ("--dim", "64", "--layers", "2", "--heads", "2", "--ffn", "128", "--vocab", "256", "--seq", "32",
             "--batch", "2"),  # CPU smoke runs
}

# Every launch runs with NVLink SHARP / multicast off, as the published figures were measured.
BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHARE_CORES = {"OMP_NUM_THREADS": "{threads}"}

# Columns of the table printed (and stored) at the end of a JSON-lines results file.
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "step_time": ("arm", "link", "world_size", "params_M", "step_s_median", "peak_alloc_GiB_per_rank",
                  "floor_s_median", "over_floor_median"),
    "step_time_scale": ("arm", "params_M", "tokens_per_step", "step_s_median", "tokens_per_s", "mfu",
                        "peak_alloc_GiB_per_rank", "peak_reserved_GiB_per_rank", "host_bytes_per_param"),
    "step_time_compile_floor": ("arm", "step_s_median", "peak_alloc_GiB_per_rank", "peak_reserved_GiB_per_rank",
                                "compile_s"),
    "checkpoint_time": ("arm", "world_size", "checkpoint_GiB", "save_s", "blocked_s", "load_s"),
    "step_time_offload_floor": ("arm", "step_s_median", "floor_s_median", "over_floor_median", "peak_alloc_GiB_per_rank"),
    "step_time_fabric": ("mode", "stage", "step_s_median", "fabric_over_trainer"),
    "step_time_activations": ("arm", "round", "params_M", "tokens_per_step", "step_s_median", "tokens_per_s",
                              "peak_alloc_GiB_per_rank", "peak_reserved_GiB_per_rank", "host_rss_GiB_per_rank",
                              "act_pinned_GiB", "error"),
    "host_adam": ("arm", "numel", "threads", "median_s", "GB_per_s"),
    "host_muon": ("arm", "numel", "threads", "median_s", "GB_per_s", "of_triad", "bitwise_equal"),
    "largest_model": ("arm", "deepest_layers", "params_B", "tokens_per_s", "mfu", "peak_reserved_GiB", "host_rss_GiB",
                      "next_fails_because"),
    "quant_accuracy": ("stage", "steps", "final_loss_plain", "final_loss_int8", "final_loss_rel_diff"),
    "eps_noise": ("stage", "eps", "step", "ddp_reversed_vs_ddp", "zeroq_vs_ddp"),
}


@dataclass(frozen=True)
class Launch:
    """One command: ``python ARGV`` (``world_size`` None) or ``torchrun --nproc-per-node WORLD_SIZE ARGV``.

    ``bench`` names the results file (``<bench>_<hardware>_<date>``); ``output`` says what it keeps:
    ``jsonl`` the JSON lines the script prints (the rest goes to a ``.log`` beside it), ``text`` all of it.
    ``requires`` names modules without which the launch is skipped (e.g. DeepSpeed for its arms)."""

    bench: str
    argv: tuple[str, ...]
    world_size: int | None = None
    link: str | None = None
    timeout: int = 600
    env: dict[str, str] = field(default_factory=dict)
    output: str = "jsonl"
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.output not in ("jsonl", "text"):
            raise ValueError(f"Launch output={self.output!r}: use 'jsonl' or 'text'")
        if self.link is not None and self.link not in LINKS:
            raise ValueError(f"Launch link={self.link!r}: use one of {', '.join(LINKS)}")


@dataclass(frozen=True)
class Suite:
    """What a suite measures (``about``), whether the CUDA extension is built first, and its launches."""

    about: str
    launches: tuple[Launch, ...]
    build: bool = False
    gpu: bool = True


def step_time(arms: str, links=("nvlink",), models=("953m",), world_sizes=(2,), timeout: int = 300,
              extra: tuple[str, ...] = (), env: dict[str, str] | None = None, requires=(),
              bench: str = "step_time") -> list[Launch]:
    """One launch of step_time.py per link x model x world size, with all ``arms`` in it, one after another."""
    return [Launch(bench, ("benchmarks/step_time.py", "--arms", arms, *MODELS[model], *extra), world_size=ws,
                   link=link, timeout=timeout, env=dict(SHARE_CORES if env is None else env), requires=tuple(requires))
            for link in links for model in models for ws in world_sizes]


FIVE = "ddp,zeroq2,zeroq2+int8,zeroq3,zeroq3+int8"
OFFLOAD_TABLE = ("zeroq3+offload_params,fsdp2+offload_optimizer,zeroq2+offload_optimizer,zeroq2,"
                 "zeroq2+offload_optimizer+ratio25,zeroq2+offload_optimizer+ratio50,zeroq2+offload_optimizer+ratio75,"
                 "zeroq2+offload_optimizer+auto,zeroq3+offload_optimizer+ratio50,zeroq3+offload_optimizer+auto,"
                 "zeroq3+offload_params,fsdp2+offload_optimizer,zeroq2+offload_optimizer+spec,zeroq3+offload_params+spec")
OFFLOAD_FLOOR = ("zeroq2+offload_optimizer,zeroq2+offload_optimizer+async,zeroq2+offload_optimizer+spec,"
                 "zeroq2+offload_optimizer+spec+async,zeroq3+offload_params,zeroq3+offload_params+async,"
                 "zeroq3+offload_params+spec+async,fsdp2+offload_optimizer,zeroq2+offload_optimizer,"
                 "zeroq2+offload_optimizer+async")
DS_OFFLOAD = "ds2+offload_optimizer,ds3+offload_optimizer+offload_params"
OFFLOAD = ("zeroq2,zeroq2+offload_optimizer,zeroq2+offload_optimizer+ratio75,zeroq2+offload_optimizer+ratio50,"
           "zeroq2+offload_optimizer+ratio25,zeroq3,zeroq3+offload_params,zeroq3+int8+offload_params")
PEERS = "ddp,fsdp2,fsdp2+keep,ds2,ds3,ds3+int8,zeroq2,zeroq2+int8,zeroq3,zeroq3+int8,zeroq3+keep"
PEERS_OFFLOAD = ("zeroq2,zeroq2+offload_optimizer,ds2+offload_optimizer,fsdp2+offload_optimizer,"
                 "zeroq2+offload_optimizer+ratio25,zeroq2+offload_optimizer+ratio50,zeroq2+offload_optimizer+ratio75,"
                 "zeroq3,zeroq3+offload_params,ds3+offload_optimizer+offload_params")
HYBRID = "ddp,zeroq2,zeroq2+group1,zeroq2+group1+crossq,zeroq3,zeroq3+group1,zeroq3+group1+crossq"
# The scale suites' arms: no offload, the optimizer on the host (synchronous; speculative and asynchronous),
# parameters and optimizer on the host; FSDP2 without and with CPUOffloadPolicy (its gradients reduce in fp32,
# ours in bf16: one rank reduces nothing, the step's arithmetic is the same); no offload again at the end.
SCALE = ("zeroq2,zeroq2+offload_optimizer,zeroq2+offload_optimizer+spec+async,zeroq3+offload_params,"
         "zeroq3+offload_params+spec+async,fsdp2,fsdp2+offload_optimizer,zeroq2")
SCALE_BIG = "zeroq3+offload_params,fsdp2+offload_optimizer,zeroq3+offload_params+spec+async"  # no room for state on the GPU
SCALE_TOKENS = {"4k": ("--batch", "4", "--seq", "1024"), "16k": ("--batch", "16", "--seq", "1024"),
                "32k": ("--batch", "32", "--seq", "1024"), "32k_seq4096": ("--batch", "8", "--seq", "4096")}


PLAN_953M = ("zeroq3,zeroq1,zeroq2,zeroq2+checkpointing,zeroq3+optimizer_half_cpu,zeroq2+optimizer_half_cpu,"
             "zeroq1+optimizer_cpu,zeroq2+optimizer_cpu,zeroq3+optimizer_cpu,zeroq3+optimizer_cpu+checkpointing,"
             "zeroq3+params_optimizer_cpu+checkpointing,zeroq3+params_optimizer_cpu")
PLAN_2GPU = ("zeroq1,zeroq2,zeroq3,zeroq2+optimizer_half_cpu,zeroq3+optimizer_half_cpu,zeroq2+optimizer_cpu,"
             "zeroq3+optimizer_cpu,zeroq3+params_optimizer_cpu,zeroq3+params_optimizer_cpu+checkpointing")
PLAN_3370M = ("zeroq3,zeroq2+optimizer_half_cpu,zeroq3+optimizer_half_cpu,zeroq2+optimizer_cpu,"
              "zeroq3+params_optimizer_cpu")


def _scale(arms: str, model: str, tokens: str, timeout: int) -> list[Launch]:
    extra = ("--steps", "4", "--warmup", "2", *SCALE_TOKENS[tokens])
    return [*step_time(arms, models=(model,), world_sizes=(1,), timeout=timeout, bench="step_time_scale", extra=extra),
            *step_time(DS_OFFLOAD, models=(model,), world_sizes=(1,), timeout=timeout, bench="step_time_scale",
                       requires=("deepspeed",), extra=extra)]


# Stages 2 and 3 against the floor (one GPU: the same model and optimizer with no data parallelism at all,
# ``single``), compiled per block and eager, every arm twice, alternating, so no arm is only a launch's first.
COMPILE_FLOOR = ",".join(2 * ["single+compile", "zeroq2+compile", "zeroq3+compile", "single", "zeroq2", "zeroq3"])
# The peers beside it: DDP with compiled blocks, FSDP2 reducing in bf16 as zeroq does (``+bf16reduce``) and,
# labelled, in fp32 as torchtitan does, the whole model compiled; every arm twice, alternating.
COMPILE_PEERS = ",".join(2 * ["ddp+compile", "zeroq3+compile", "fsdp2+compile+bf16reduce", "zeroq3",
                               "fsdp2+bf16reduce", "zeroq3+compile_whole", "fsdp2+compile_whole+bf16reduce",
                               "fsdp2+compile"])


# At 2 ranks: compiled stage 3 against compiled FSDP2 (bf16 reduction both), eager beside; twice, alternating.
COMPILE_2GPU = ",".join(2 * ["zeroq3+compile", "fsdp2+compile+bf16reduce", "zeroq3", "fsdp2+bf16reduce",
                             "zeroq2+compile"])
MUON = "zeroq2,zeroq2+muon,zeroq3,zeroq3+muon,zeroq2+muon,zeroq2"  # AdamW beside Muon, alternating
DS_MUON = "ds2,ds2+muon,ds3+muon,ds2+muon"  # DeepSpeed's own Muon (reduce_scatter off, as it requires)
# Muon against AdamW with the optimizer on the host (stage 2; stage 3 with the parameters there too), twice each,
# alternating, so that neither is only a launch's first arm.
MUON_OFFLOAD = ",".join(2 * ["zeroq2+offload_optimizer", "zeroq2+offload_optimizer+muon", "zeroq3+offload_params",
                             "zeroq3+offload_params+muon"])


GPU_TESTS = ("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rf", "-s", "tests")


def _memory_account(arm: str, timeout: int, requires=(), world_size: int = 2, bench: str = "memory_account",
                    extra: tuple[str, ...] = ("--snapshot-mib", "10")) -> Launch:
    return Launch(bench, ("benchmarks/memory_account.py", "--arms", arm, "--out", "{scratch}/memory_account", *extra),
                  world_size=world_size, timeout=timeout, output="text", requires=tuple(requires))


# Activations with the optimizer on the host: every block recomputing, the plan's mix of kept, offloaded and
# recomputed blocks under the peak of recomputing them all (+actauto, --act-budget recompute), every activation
# kept; alternating, two rounds. 4 x 4,096 and 8 x 4,096 tokens per step for the 953M GPT, 8 x 4,096 for a
# Llama-7B-shaped GPT (built on the meta device: its fp32 weights would not fit the host beside the optimizer).
ACTIVATIONS = "{stage}+offload_optimizer+recompute,{stage}+offload_optimizer+actauto,{stage}+offload_optimizer"
ACTIVATION_RUNS = {"953m_16k": ("953m", ("--batch", "4", "--seq", "4096"), 400),
                   "953m_32k": ("953m", ("--batch", "8", "--seq", "4096"), 500),
                   "7b_32k": ("7b", ("--batch", "8", "--seq", "4096", "--meta", "--steps", "3", "--warmup", "2"), 590)}


def _activations(run: str, stage: str = "zeroq2") -> Launch:
    model, extra, timeout = ACTIVATION_RUNS[run]
    steps = () if "--steps" in extra else ("--steps", "6", "--warmup", "3")
    return step_time(ACTIVATIONS.format(stage=stage), models=(model,), world_sizes=(1,), timeout=timeout,
                     bench="step_time_activations", extra=(*extra, *steps, "--repeat", "2"))[0]


SUITES: dict[str, Suite] = {
    "activations": Suite(
        "Activation offload on one GPU, optimizer on the host: every block recomputing, the plan's mix of kept, "
        "offloaded and recomputed blocks at the same peak, every activation kept (953M GPT at 16K and 32K tokens, "
        "a 7B GPT at 32K); tokens/s, peak allocated and reserved, host RSS; arms alternating, two rounds",
        tuple(_activations(run) for run in ACTIVATION_RUNS), build=True),
    "scale": Suite(
        "Throughput at the batch offload exists for (953M GPT, one GPU): tokens/s and MFU of no offload, optimizer "
        "offload and parameter + optimizer offload at 4K, 16K and 32K tokens per step (micro-batches of 1,024-token "
        "sequences), beside FSDP2 with and without CPUOffloadPolicy and, where installed, DeepSpeed's ZeRO-2/3 "
        "offload; peak reserved and host bytes per parameter in every row",
        tuple(launch for tokens in ("4k", "16k", "32k") for launch in _scale(SCALE, "953m", tokens, 300)),
        build=True),
    "scale-3800m": Suite(
        "The same for a 3.82B GPT with parameters and optimizer on the host (zeroq3, synchronous and speculative + "
        "asynchronous, beside FSDP2's CPUOffloadPolicy and DeepSpeed's ZeRO-3 offload) at 4K and 32K tokens",
        tuple(launch for tokens in ("4k", "32k") for launch in _scale(SCALE_BIG, "3800m", tokens, 600)), build=True),
    "largest": Suite(
        "The largest GPT each engine trains on one GPU and this host (benchmarks/fits.py largest: a search over "
        "depth at a Llama-7B-like width, 4,096 tokens per step, activation checkpointing): zeroq3 with parameters "
        "and optimizer on the host, FSDP2's CPUOffloadPolicy, DeepSpeed ZeRO-3 offload (where installed); then "
        "with NVMe (zeroq3, DeepSpeed) in the --scratch folder, all of the optimizer state there or half of it",
        (Launch("largest_model", ("benchmarks/fits.py", "largest", "--arms",
                                  "zeroq3+offload_params,fsdp2+offload_optimizer", "--checkpoint", "--start", "24"),
                timeout=3600),
         Launch("largest_model", ("benchmarks/fits.py", "largest", "--arms", "ds3+offload_optimizer+offload_params",
                                  "--checkpoint", "--start", "24"), timeout=3600, requires=("deepspeed",)),
         Launch("largest_model", ("benchmarks/fits.py", "largest", "--arms", "zeroq3+offload_params+nvme",
                                  "--checkpoint", "--start", "24", "--nvme-path", "{scratch}"), timeout=3600),
         # the optimizer state of half the parameters on NVMe, the rest (and the parameters) in host memory
         Launch("largest_model", ("benchmarks/fits.py", "largest", "--arms", "zeroq3+offload_params+spill50",
                                  "--checkpoint", "--start", "32", "--nvme-path", "{scratch}"), timeout=3600)),
        build=True),
    "plan-953m": Suite(
        "zeroq-plan's prediction beside the measured peaks (allocated, reserved, host) and step, one process per "
        "configuration, the rates calibrated in the same command: the 953M GPT in 12 configurations, 4 x 1,024 "
        "tokens (docs/plan.md's table); --json rows for --against",
        (Launch("plan_calibrated_953m", ("-m", "lightning_zeroq.cli.plan", "--batch", "4", "--seq", "1024",
                                         "--host-gib", "120", "--calibrate", "--measure", "--only", PLAN_953M,
                                         "--steps", "6", "--warmup", "3", "--json", "{out}/plan_953m.json"),
                timeout=540, output="text"),)),
    "plan-3370m": Suite(
        "The same for the 3.37B GPT (dim 3072, 28 layers) in 5 configurations",
        (Launch("plan_calibrated_3370m", ("-m", "lightning_zeroq.cli.plan", *MODELS["3370m"], "--batch", "4",
                                          "--seq", "1024", "--host-gib", "120", "--calibrate", "--measure",
                                          "--only", PLAN_3370M, "--steps", "5", "--warmup", "2",
                                          "--json", "{out}/plan_3370m.json"), timeout=540, output="text"),)),
    "plan-2gpu": Suite(
        "zeroq-plan at world size 2 beside measured (2 GPUs of one node, the largest peaks of either rank): the "
        "953M GPT, stages 1-3 without offload, with half and all of the optimizer on the host, parameters too",
        (Launch("plan_calibrated_953m_ws2", ("-m", "lightning_zeroq.cli.plan", "--batch", "4", "--seq", "1024",
                                             "--world-size", "2", "--ranks-per-node", "2", "--host-gib", "240",
                                             "--calibrate", "--measure", "--only", PLAN_2GPU, "--steps", "6",
                                             "--warmup", "3", "--json", "{out}/plan_953m_ws2.json"),
                timeout=560, output="text"),)),
    "auto-offload": Suite(
        "offload=\"auto\" under 90/70/50/35% of the no-offload peak against the best of 12 hand-picked points (the "
        "share of the optimizer on the host x recomputing none or every block, parameters on the host), stage 3, "
        "the 953M GPT at 16 x 1,024 tokens, one process per run (docs/plan.md's table)",
        (Launch("auto_offload_953m", ("benchmarks/fits.py", "auto-offload", "--batch", "16", "--seq", "1024",
                                      "--stage", "3", "--steps", "3", "--warmup", "2"), timeout=3600),)),
    "compile-floor": Suite(
        "Stages 2 and 3 at the floor (953M GPT, one GPU, 4 x 1,024 tokens): the same model and optimizer with no "
        "data parallelism at all, zeroq2 and zeroq3, each with compiled blocks and eager; every arm twice, "
        "alternating; peak allocated and reserved",
        tuple(step_time(COMPILE_FLOOR, world_sizes=(1,), timeout=500, bench="step_time_compile_floor",
                        extra=("--steps", "10", "--warmup", "5")))),
    "compile-peers": Suite(
        "Compiled stage 3 beside its peers at one GPU (953M GPT, 4 x 1,024 tokens): DDP with compiled blocks, "
        "zeroq3 eager, compiled per block and whole, FSDP2 alike with bf16 gradient reduction (as zeroq) and, "
        "compiled blocks, fp32 reduction (torchtitan's); every arm twice, alternating; peak allocated and reserved",
        tuple(step_time(COMPILE_PEERS, world_sizes=(1,), timeout=560, bench="step_time_compile_peers",
                        extra=("--steps", "10", "--warmup", "5")))),
    "compile-floor-profile": Suite(
        "Where the compiled arms' step goes on one GPU: two profiled steps each of the floor (no data "
        "parallelism, compiled blocks), zeroq2, zeroq3 and FSDP2 with compiled blocks, the whole model compiled with TORCH_LOGS for "
        "recompiles and graph breaks; the device's busy time and its largest kernels per arm in the .log",
        tuple(step_time("single+compile,zeroq3+compile,zeroq2+compile,fsdp2+compile+bf16reduce,zeroq3+compile_whole",
                        world_sizes=(1,), timeout=500, bench="step_time_compile_floor_profile",
                        env={**SHARE_CORES, "TORCH_LOGS": "recompiles,graph_breaks"},
                        extra=("--steps", "4", "--warmup", "3", "--profile", "{out}/compile_floor_traces")))),
    "memory-compile": Suite(
        "Where compiled stage 3's reserved memory goes beside compiled FSDP2's (953M GPT, one GPU, bf16 gradient "
        "reduction both): the reserved peak per CUDA stream's pool and the allocations that made its segments",
        tuple(_memory_account(arm, 90, world_size=1, bench="memory_account_compile_953m",
                              extra=("--snapshot-ranks", "", "--warmup", "3", "--steps", "1"))
              for arm in ("zeroq3+compile", "fsdp2+compile+bf16reduce"))),
    "compile-2gpu": Suite(
        "Compiled stage 3 against compiled FSDP2 at 2 GPUs (953M GPT, 4 x 1,024 tokens per rank, bf16 gradient "
        "reduction both), eager beside, every arm twice, alternating; over NVLink and loopback sockets",
        tuple(step_time(COMPILE_2GPU, links=("nvlink", "socket"), timeout=450, bench="step_time_compile",
                        extra=("--steps", "8", "--warmup", "4")))),
    "muon-2gpu": Suite(
        "Muon (torch.optim.Muon for the blocks' matrices, AdamW for the rest) against AdamW under ZeroQ stages 2 "
        "and 3 at 2 GPUs (953M GPT), alternating; DeepSpeed's own Muon beside its AdamW where DeepSpeed is installed",
        (*step_time(MUON, timeout=400, bench="step_time_muon", extra=("--steps", "6", "--warmup", "3")),
         *step_time(DS_MUON, timeout=400, bench="step_time_muon", requires=("deepspeed",),
                    extra=("--steps", "6", "--warmup", "3")))),
    "muon-offload": Suite(
        "Muon against AdamW with the optimizer on the host on one GPU (953M GPT, 4 x 1,024 tokens; stage 3 with the "
        "parameters on the host too), every arm twice, alternating; host RSS and pinned bytes in every line; first "
        "Muon's host parts alone at that size beside the host's triad",
        (Launch("host_muon", ("benchmarks/kernels.py", "host-muon", "--numel", "953223168", "--threads", "{cores}",
                              "--steps", "3", "--rounds", "2", "--triad"), timeout=240),
         *step_time(MUON_OFFLOAD, world_sizes=(1,), timeout=500, bench="step_time_muon",
                    extra=("--steps", "5", "--warmup", "2"))), build=True),
    "host-step-3800m": Suite(
        "The host step against the host's memory bandwidth, and what it makes of a full-offload step: the STREAM "
        "triad and the host kernel's AdamW over 953M elements, then the 3.82B GPT with parameters and optimizer on "
        "the host (one GPU, 4K tokens), its host step by torch's fused CPU AdamW (+torchhost, as before the kernel) "
        "and by the host kernel, twice each, alternating",
        (Launch("host_adam", ("benchmarks/kernels.py", "host-adam", "--numel", "953223168", "--threads", "{cores}",
                              "--steps", "3", "--rounds", "2", "--triad"), timeout=150),
         *step_time(",".join(2 * ["zeroq3+offload_params+torchhost", "zeroq3+offload_params"]), models=("3800m",),
                    world_sizes=(1,), timeout=420, bench="step_time_host_step",
                    extra=("--steps", "4", "--warmup", "2", *SCALE_TOKENS["4k"]))), build=True),
    "scale-3800m-2gpu": Suite(
        "The 3.82B GPT with parameters and optimizer on the host at 2 GPUs (each rank's host step over half the "
        "elements with half the threads), beside FSDP2's CPUOffloadPolicy, 4K tokens per rank",
        tuple(step_time(SCALE_BIG, models=("3800m",), timeout=560, bench="step_time_scale",
                        extra=("--steps", "4", "--warmup", "2", *SCALE_TOKENS["4k"]))), build=True),
    "links": Suite(
        "Step time and peak memory of DDP and ZeroQ stages 2 and 3, with and without INT8 weights, over NVLink, "
        "host memory and loopback sockets (953M GPT, 2 GPUs); offload arms on NVLink",
        (*step_time(FIVE + ",zeroq2+offload_optimizer,zeroq3+offload_params", timeout=240),
         *step_time(FIVE, links=("shm",), timeout=150),
         *step_time(FIVE, links=("socket",), timeout=200)), build=True),
    "offload": Suite(
        "CPU offload on one GPU: the host's floor (fused AdamW over all 953M fp32 elements: torch's kernel and "
        "lightning_zeroq's), full, partial and automatic (budget 13 GiB) optimizer offload in stages 2 and 3, "
        "parameter offload, speculative host steps, FSDP2's CPU offload, DeepSpeed's ZeRO-2 and ZeRO-3 offload "
        "(where DeepSpeed is installed), stage 2 at 50M-element units, with what is live at each arm's peak",
        (Launch("host_adam", ("benchmarks/kernels.py", "host-adam", "--numel", "953223168", "--threads", "{cores}",
                              "--steps", "3", "--rounds", "2", "--arms", "torch_fused,zeroq_kernel,zeroq_kernel_out"),
                timeout=120),
         *step_time(OFFLOAD_TABLE, world_sizes=(1,), timeout=480,
                    extra=("--steps", "4", "--warmup", "2", "--budget", "13", "--memory-peak", "--floor")),
         *step_time("zeroq2+offload_optimizer", world_sizes=(1,), timeout=90,
                    extra=("--steps", "4", "--warmup", "2", "--bucket", "5e7")),
         *step_time(DS_OFFLOAD, world_sizes=(1,), timeout=300, requires=("deepspeed",),
                    extra=("--steps", "4", "--warmup", "2"))), build=True),
    "offload-floor": Suite(
        "Full CPU offload on one GPU beside the host's floor (step_time.py --floor: blocks of 3 steps, each "
        "followed by a fused AdamW step over the model's 953M elements): zeroq2 optimizer offload and zeroq3 "
        "parameter offload, synchronous, asynchronous and speculative host steps, FSDP2's CPU offload; the "
        "first two arms again at the end (a launch's first arm runs slow)",
        (*step_time(OFFLOAD_FLOOR, world_sizes=(1,), timeout=480, bench="step_time_offload_floor",
                    extra=("--steps", "9", "--warmup", "2", "--floor")),), build=True),
    "offload-2gpu": Suite(
        "CPU offload at 2 GPUs: full and partial optimizer offload, stage-3 parameter offload (also with INT8 "
        "weights); the host step with one thread per rank; the host AdamW step over one rank's share",
        (*step_time(OFFLOAD, timeout=400),
         *step_time("zeroq2+offload_optimizer", timeout=150, env={"OMP_NUM_THREADS": "1"}),
         Launch("host_adam", ("benchmarks/kernels.py", "host-adam", "--threads", "{cores}", "--numel", "476000000"),
                timeout=280)), build=True),
    "memory": Suite(
        "Peak memory: stage 3 on a 1.005B GPT, and every GiB of the peaks by tensor class (memory_account.py) for "
        "ZeroQ stages 2 and 3, FSDP2 and, where DeepSpeed is installed, DeepSpeed stages 2 and 3",
        (*step_time("zeroq3,zeroq3+int8", models=("1b",), timeout=120),
         _memory_account("zeroq2", 100), _memory_account("zeroq3", 100), _memory_account("fsdp2", 100),
         _memory_account("ds2", 170, requires=("deepspeed",)), _memory_account("ds3", 110, requires=("deepspeed",))),
        build=True),
    "options": Suite(
        "Stage-3 options: reshard_after_forward=False, prefetch depth 2, INT8 gradients, over NVLink and sockets",
        (*step_time("zeroq3,zeroq3+keep,zeroq3+prefetch2,zeroq3+int8+qgrad,zeroq2+qgrad", timeout=200),
         *step_time("zeroq3,zeroq3+keep,zeroq3+int8,zeroq3+int8+qgrad", links=("socket",), timeout=200)), build=True),
    "peers": Suite(
        "ZeroQ beside FSDP2 and DeepSpeed (step time, peak memory) on every link, with offload and gradient "
        "clipping; sockets three times (they vary between launches); needs DeepSpeed",
        (*step_time(PEERS, timeout=300, requires=("deepspeed",)),
         *step_time("fsdp2,ds3,zeroq3,zeroq3+int8", links=("shm",), timeout=300, requires=("deepspeed",)),
         *3 * step_time("ds3,zeroq3,ds3+int8,zeroq3+int8,zeroq3+int8+qgrad", links=("socket",), timeout=200,
                        requires=("deepspeed",)),
         *step_time(PEERS_OFFLOAD, timeout=400, requires=("deepspeed",)),
         *step_time("zeroq2+clip,zeroq2+offload_optimizer+clip,ds2+offload_optimizer+clip", timeout=200,
                    requires=("deepspeed",))), build=True),
    "checkpoint": Suite(
        "Checkpoint save and load time, time the training loop is blocked by an async save, and peak host memory "
        "per rank: ZeroQ (pinned staging, pageable, async) against FSDP2 + DCP (sync, async), 953M GPT, 2 GPUs",
        (Launch("checkpoint_time", ("benchmarks/checkpoints.py", "save-load", "--dir", "{scratch}/checkpoint",
                                    "--repeats", "3", "--verify",
                                    "--arms", "zeroq,zeroq_pageable,fsdp2,zeroq_async,fsdp2_async"),
                world_size=2, timeout=540, env=dict(SHARE_CORES)),)),
    "fabric": Suite(
        "Step time of ZeroQ through Fabric against the Trainer, stages 2 and 3, alternating in one launch",
        tuple(Launch("step_time_fabric", ("benchmarks/step_time.py", "--arms", f"zeroq{stage}", "--loops",
                                          "fabric,trainer,fabric,trainer", "--steps", "20", "--warmup", "5"),
                     world_size=2, timeout=280)
              for stage in (2, 3))),
    "hybrid": Suite(
        "Hybrid sharding (shard_group_size) at 2 GPUs, each GPU its own group (what 2 nodes of one GPU would do): "
        "ZeRO 2 and 3 sharded over both against one group per GPU, with INT8 gradients across groups only, over "
        "NVLink and over loopback sockets (the slow link between nodes)",
        (*step_time(HYBRID, timeout=300), *step_time(HYBRID, links=("socket",), timeout=300)), build=True),
    "kernels": Suite(
        "Effective bandwidth of the INT8 quantize/dequantize kernels against a device-to-device copy",
        (Launch("quant_kernels", ("benchmarks/kernels.py", "int8", "--numel", "268435456"), timeout=120,
                output="text"),), build=True),
    "accuracy": Suite(
        "Accuracy of INT8 weights: final loss of the same 300-step training with and without, stages 2 and 3 "
        "(135M byte-level GPT, 2 GPUs)",
        tuple(Launch("quant_accuracy", ("benchmarks/accuracy.py", "int8-weights", "--steps", "300", "--stage",
                                        str(stage)), world_size=2, timeout=150) for stage in (2, 3)), build=True),
    "gpu-tests": Suite(
        "The GPU tests (pytest -m gpu): engine parity with DDP on CUDA, offload, the CUDA kernels",
        (Launch("gpu_tests", GPU_TESTS, timeout=420, output="text"),), build=True),
    "eps-noise": Suite(
        "ZeRO vs DDP at AdamW's default eps against DDP vs itself with the ranks summed in reverse order (CUDA)",
        tuple(Launch("eps_noise", ("benchmarks/accuracy.py", "eps-noise", "--world-size", "2", "--stage", str(stage),
                                   "--device", "cuda"), timeout=120) for stage in (2, 3)), build=True),
    "host": Suite(
        "The host side on this machine's CPUs: torch's CPU optimizers' update throughput, the NVMe swap space "
        "against dd with O_DIRECT (in the --scratch folder)",
        (Launch("cpu_optimizer", ("benchmarks/kernels.py", "cpu-optimizers"), timeout=300, output="text"),
         Launch("nvme_swap", ("-m", "benchmarks.nvme_swap", "--dir", "{scratch}"), timeout=300, output="text")),
        gpu=False),
    "smoke": Suite(
        "Every CPU-capable benchmark once with a tiny model on gloo, to check the scripts run (figures mean nothing)",
        (*step_time("ddp,zeroq2,zeroq3+int8", models=("tiny",), timeout=120, extra=("--steps", "2", "--warmup", "1"),
                    env={"OMP_NUM_THREADS": "1"}),
         Launch("checkpoint_time", ("benchmarks/checkpoints.py", "save-load", *MODELS["tiny"], "--repeats", "1",
                                    "--arms", "zeroq,fsdp2", "--dir", "{scratch}/checkpoint"),
                world_size=2, timeout=120),
         Launch("step_time_fabric", ("benchmarks/step_time.py", *MODELS["tiny"], "--steps", "2", "--warmup", "1",
                                     "--arms", "zeroq2", "--loops", "fabric,trainer"), world_size=2, timeout=120),
         *step_time(ACTIVATIONS.format(stage="zeroq3") + ",zeroq2+actoff", models=("tiny",), world_sizes=(1,),
                    timeout=120, bench="step_time_activations", env={"OMP_NUM_THREADS": "1"},
                    extra=("--steps", "2", "--warmup", "1", "--repeat", "2", "--act-offload", "1")),
         Launch("eps_noise", ("benchmarks/accuracy.py", "eps-noise", "--world-size", "2", "--stage", "3", "--steps",
                              "2"), timeout=120),
         Launch("host_adam", ("benchmarks/kernels.py", "host-adam", "--numel", "100000", "--threads", "1", "--steps",
                              "1", "--rounds", "1"), timeout=60),
         Launch("cpu_optimizer", ("benchmarks/kernels.py", "cpu-optimizers", "--params", "1e5", "--steps", "1",
                                  "--warmup", "1"), timeout=60, output="text")),
        gpu=False),
}
