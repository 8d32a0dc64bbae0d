"""``zeroq-plan --measure``: each planned configuration trained for a few steps, each in a process of its
own (so one configuration's memory, pinned host buffers and allocator state never meet the next's), and
its measured peaks and step time printed beside the plan's.

One run: the package's GPT of the plan's shape built on the meta device and materialized by the engine
unit by unit (as ``configure_model()`` does), the plan's ``ZeroConfig`` (with checkpointing: every
``Block`` through ``activation_checkpointing_policy``), AdamW, random tokens of the plan's micro-batch;
``warmup`` steps, then ``steps`` timed ones (each to the end of its host work: the host worker's ``wait`` and a
device synchronization). Measured: peak device memory allocated and reserved over the whole run
(``torch.cuda.max_memory_*``), host memory as the process's peak resident size less its size before the
model was built (``VmHWM`` less ``VmRSS``), and the median step. A run that fails (out of memory, a check
before launch) is reported with its one-line error, and the others go on.

At a world size above one (``zeroq-plan --world-size N --measure``) a configuration runs as N processes of
one node (``torch.distributed.run``; NCCL on GPUs, gloo on the CPU), each rank on its own micro-batch;
the peaks reported are the largest of any rank (what the plan gives per rank), the step rank 0's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lightning_zeroq.cli.gpt import GPTConfig, GPTModel

GIB = 2**30


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the configuration of ``spec`` (``gpt``: ``GPTConfig`` fields; ``config``: ``ZeroConfig``
    fields; ``checkpointing``, ``batch``, ``seq``, ``warmup``, ``steps``, ``dtype``) in this process."""
    import torch.distributed as dist

    from lightning_zeroq import ZeroConfig, ZeroEngine
    from lightning_zeroq.planning.choose import choose
    from lightning_zeroq.zero.policies import auto_request

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # the ranks of this node (shard_group_size='node')
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    dtype = torch.bfloat16 if spec.get("dtype", "bf16") == "bf16" else torch.float32
    rss_before = _status_kib("VmRSS")
    cfg = GPTConfig(**spec["gpt"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPTModel(cfg).to(dtype)
    torch.manual_seed(dist.get_rank() if world > 1 else 0)  # each rank its own micro-batch
    fields = dict(spec["config"])
    if spec["checkpointing"] and not fields.get("activation_checkpointing_policy"):  # a mixed row names its blocks
        fields["activation_checkpointing_policy"] = ["Block"]
    config, chosen = ZeroConfig(**fields), None
    tokens = torch.randint(cfg.vocab_size, (spec["batch"], spec["seq"] + 1), device=device)
    if auto_request(config) is not None:  # offload="auto": decided here, as the strategies decide it
        sample = tokens.to("meta")

        def forward(m: torch.nn.Module) -> torch.Tensor:
            logits = m(sample[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), sample[:, 1:].reshape(-1))

        choice = choose(model, config, forward, device=device, param_dtype=dtype, ranks_per_node=local)
        config, chosen = choice.config, choice
    engine = ZeroEngine(model, config, param_dtype=dtype, device=device, ranks_per_node=local)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = []
    try:
        for _ in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
            del logits
            engine.backward(loss, boundary=True)
            engine.step()
            engine.zero_grad()
            engine.parts.worker.wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    finally:
        engine.close()
    out: dict[str, Any] = {
        "step_s": statistics.median(times[spec["warmup"] :]),
        "host_bytes": max(0, _status_kib("VmHWM") - rss_before) * 1024,
        "loss": float(loss),
    }
    if chosen is not None and chosen.need is not None:
        out.update(
            chosen=chosen.need.name,
            chosen_line=chosen.line,
            predicted_allocated_bytes=chosen.need.device_total,
            predicted_step_s=chosen.need.step_s,
        )
    if device.type == "cuda":
        out["allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if world > 1:  # the largest peaks of any rank (the plan's are per rank), rank 0's step
        peaks = [k for k in ("allocated_bytes", "reserved_bytes", "host_bytes") if k in out]
        mine = torch.tensor([float(out[k]) for k in peaks], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out.update({k: int(v) for k, v in zip(peaks, mine.tolist())})
        out["world_size"] = world
        dist.destroy_process_group()
    return out


def measure(spec: dict[str, Any], timeout: Optional[float] = None, world_size: int = 1) -> dict[str, Any]:
    """``run_one`` in a fresh Python process (``world_size`` of them, one node); ``{"error": one line}``
    where it fails."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "lightning_zeroq.cli.measure", json.dumps(spec)]
    if world_size > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world_size}",
            *command[1:],
        ]
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    why = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else f"exit {done.returncode}")
    return {"error": why.strip()[:300]}


def main() -> int:
    spec = json.loads(sys.argv[1])
    first = os.environ.get("RANK", "0") == "0"  # at several ranks, rank 0 prints the one line
    try:
        result = run_one(spec)
    except torch.cuda.OutOfMemoryError as error:
        if first:
            print(json.dumps({"error": "out of device memory: " + str(error).splitlines()[0][:200]}))
        return 0
    if first:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
