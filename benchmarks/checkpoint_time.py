"""Checkpoint save and load time and peak host memory per rank: ZeroQ (sync and async) against FSDP2 +
DCP on the same model, in the same launch (GPU, NCCL; or a CPU/gloo smoke run with a tiny model).

The model is the GPT of ``step_time.py`` (953M parameters by default), AdamW, one training step
first so the optimizer has its state; every arm saves fp32 parameters and both Adam moments (about
11.4 GB for 953M), each rank writing its own part:

- ``zeroq``: ``trainer.save_checkpoint``'s path without Lightning (``save_engine``), ZeRO stage 2;
  then ``load_engine`` into a fresh engine (resharding machinery included). Device tensors go to
  the host through the checkpointer's pinned staging ring (``--staging-mib``, the default 512).
- ``zeroq_pageable``: the same with the ring off (``staging_bytes=0``): a pageable
  ``tensor.to("cpu")`` per item.
- ``zeroq_async``: the same through ``torch.distributed.checkpoint.async_save``: ``blocked_s`` is
  what the training loop waits for (staging to pinned host memory), ``total_s`` until the checkpoint
  is in place. The first async save allocates the pinned buffers; the figures are from the last.
- ``fsdp2``: ``fully_shard`` per block and root, ``get_state_dict`` + ``dcp.save`` (stock
  ``FileSystemWriter``, one file per rank, fsync); load into a fresh model and optimizer (as a
  resume does, and as the zeroq arm loads into a fresh engine) with ``get_state_dict`` (which creates
  the optimizer's state), ``dcp.load`` + ``set_state_dict``.
- ``fsdp2_async``: ``dcp.async_save`` of the same (its default stager).

Times are medians over ``--repeats`` (each rank's max across ranks); ``peak_rss_GiB`` is the rise of
each rank's resident memory above its level before the operation, sampled every 5 ms. Rank 0 prints
one JSON line per arm::

    torchrun --nproc-per-node 2 benchmarks/checkpoint_time.py --dir /tmp/ckpt_bench
    torchrun --nproc-per-node 1 benchmarks/checkpoint_time.py --dir /tmp/ckpt_bench   # one GPU
    torchrun --nproc-per-node 2 benchmarks/checkpoint_time.py --dim 64 --layers 2 --heads 2 --ffn 128 \\
        --vocab 256 --seq 32 --batch 2     # CPU smoke run (gloo)
    torchrun --nproc-per-node 1 benchmarks/checkpoint_time.py --arms zeroq --checksum-ab --repeats 3 --verify \\
        --dir /tmp/ckpt_bench              # the cost of checksums: saves and loads alternated with and without
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step_time import GPT  # noqa: E402
from lightning_zeroq.checkpoint import checksum  # noqa: E402

ON_GPU = torch.cuda.is_available()


class RssPeak:
    """Peak resident memory of this process above its level at ``__enter__``, sampled in a thread."""

    def __enter__(self) -> "RssPeak":
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def gib(self) -> float:
        return (self.peak - self.base) / 2**30


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()
    dist.barrier()


def timed(fn) -> tuple[float, float]:
    sync()
    with RssPeak() as rss:
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
    return elapsed, rss.gib


def gathered(values: list[float]) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather_object(out, t)
    return [o.tolist() for o in out]


def build(args, dev):
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.ffn).to(dev)


def one_step(model, loss_fn, step_fn, args, dev) -> None:
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = loss_fn(tokens)
    step_fn(loss)


def arm_zeroq(args, dev, path: Path, asynchronous: bool, staging_mib: Optional[float] = None) -> dict:
    from lightning_zeroq import ZeroConfig, ZeroEngine
    from lightning_zeroq.checkpoint.checkpointer import Checkpointer
    from lightning_zeroq.checkpoint.engine_io import load_engine, save_engine

    model = build(args, dev)
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=int(args.bucket)), param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ON_GPU))

    def step(loss):
        engine.backward(loss, boundary=True)
        engine.step()

    one_step(model, model, step, args, dev)
    staging_mib = args.staging_mib if staging_mib is None else staging_mib
    # --checksum-ab: the same saves and loads with and without checksums, alternating in this run
    variants = {"": True, "_no_checksum": False} if args.checksum_ab else {"": True}
    checkpointers = {v: Checkpointer(async_save=asynchronous, staging_bytes=int(staging_mib * 2**20), checksums=c)
                     for v, c in variants.items()}
    paths = {v: path.with_name(path.name + v) for v in variants}
    saves, blocked, peaks = {v: [] for v in variants}, {v: [] for v in variants}, {v: [] for v in variants}
    hashing: dict[str, list[float]] = {v: [] for v in variants}  # seconds the I/O waited for checksums
    if args.checksum_ab:  # a process's first save pays one-time costs (staging ring, threads): not in the A/B
        for v, checkpointer in checkpointers.items():
            save_engine(engine, paths[v], checkpointer=checkpointer)
            checkpointer.wait()
    for r in range(args.repeats):
        for v, checkpointer in _alternating(checkpointers, r):
            shutil.rmtree(paths[v], ignore_errors=True)
            sync()
            waited = checksum.waited_s
            t, peak = timed(lambda: (save_engine(engine, paths[v], checkpointer=checkpointer), checkpointer.wait()))
            saves[v].append(t)
            hashing[v].append(checksum.waited_s - waited)
            blocked[v].append(checkpointer.last.blocked_s)
            peaks[v].append(peak)
    reference = engine.full_state_dict() if args.verify else None
    del engine, model
    gc.collect()
    model = build(args, dev)
    torch.nn.init.zeros_(model.head.weight)
    engine = ZeroEngine(model, ZeroConfig(stage=2, reduce_bucket_size=int(args.bucket)), param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ON_GPU))
    loads = {v: [] for v in variants}
    load_hashing: list[float] = []
    load_peak = 0.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*saved without checksums")
        for r in range(args.repeats if args.checksum_ab else 1):
            for v, _ in _alternating(variants, r):
                waited = checksum.waited_s
                t, peak = timed(lambda: load_engine(engine, paths[v]))
                loads[v].append(t)
                load_hashing.append(checksum.waited_s - waited) if v == "" else None
                load_peak = max(load_peak, peak)
                if reference is not None:
                    got = engine.full_state_dict()
                    assert all(torch.equal(got[k], reference[k]) for k in reference), "loaded state differs"
    for v in variants:
        checkpointer = checkpointers[v]
        checkpointer.release()
        if v:
            shutil.rmtree(paths[v], ignore_errors=True)
    engine.close()
    out = {"save_s": saves[""], "blocked_s": blocked[""], "save_peak": peaks[""], "load_s": statistics.median(loads[""]),
           "load_peak": load_peak, "staging_MiB": 0 if asynchronous else staging_mib,
           "checksum_wait_s": round(statistics.median(hashing[""]), 3),
           "checksum_wait_pct_of_save": round(100 * statistics.median(hashing[""]) / statistics.median(saves[""]), 2),
           "checksum_load_wait_s": round(statistics.median(load_hashing), 3) if load_hashing else None}
    if args.checksum_ab:
        out.update(save_s_no_checksum=saves["_no_checksum"], load_s_no_checksum=statistics.median(loads["_no_checksum"]),
                   save_s_all_no_checksum=saves["_no_checksum"], load_s_all=loads[""],
                   load_s_all_no_checksum=loads["_no_checksum"])
    return out


def arm_fsdp2(args, dev, path: Path, asynchronous: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    model = build(args, dev)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ON_GPU)

    def step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    one_step(model, model, step, args, dev)
    group = dist.new_group(backend="gloo") if asynchronous else None
    saves, blocked, peaks = [], [], []
    for _ in range(args.repeats):
        shutil.rmtree(path, ignore_errors=True)
        sync()

        def save():
            start = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            state = {"state_dict": msd, "optimizer_0": osd}
            if asynchronous:
                future = dcp.async_save(state, checkpoint_id=str(path), process_group=group)
                blocked.append(time.perf_counter() - start)
                future.result()
            else:
                dcp.save(state, checkpoint_id=str(path))
                blocked.append(time.perf_counter() - start)

        t, peak = timed(save)
        saves.append(t)
        peaks.append(peak)

    # Load into a fresh model and optimizer, as a resume does (and as the zeroq arm does): its optimizer
    # has no state yet, so get_state_dict creates it inside the timed load.
    del model, opt
    gc.collect()
    model = build(args, dev)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ON_GPU)

    def load():
        msd, osd = get_state_dict(model, opt)
        dcp.load({"state_dict": msd, "optimizer_0": osd}, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    load_s, load_peak = timed(load)
    del model, opt
    return {"save_s": saves, "blocked_s": blocked, "save_peak": peaks, "load_s": load_s, "load_peak": load_peak}


ARMS = {"zeroq": (arm_zeroq, False), "zeroq_pageable": (functools.partial(arm_zeroq, staging_mib=0), False),
        "zeroq_async": (arm_zeroq, True), "fsdp2": (arm_fsdp2, False), "fsdp2_async": (arm_fsdp2, True)}


def _alternating(variants: dict, repeat: int) -> list:
    """--checksum-ab: with and without checksums in ABBA order, so that neither always goes first."""
    pairs = list(variants.items())
    return pairs[::-1] if repeat % 2 else pairs


def _checksum_ab(result: dict) -> dict:
    """--checksum-ab: this rank's medians with and without checksums and the cost in percent."""
    if "save_s_no_checksum" not in result:
        return {}
    save, bare = statistics.median(result["save_s"]), statistics.median(result["save_s_no_checksum"])
    load, bare_load = result["load_s"], result["load_s_no_checksum"]
    from lightning_zeroq.checkpoint.checksum import ALGORITHM

    return {"checksum": ALGORITHM, "save_s_rank0": round(save, 3), "save_s_no_checksum_rank0": round(bare, 3),
            "checksum_save_cost_pct": round(100 * (save - bare) / bare, 2),
            "load_s_rank0": round(load, 3), "load_s_no_checksum_rank0": round(bare_load, 3),
            "checksum_load_cost_pct": round(100 * (load - bare_load) / bare_load, 2),
            "save_s_all_no_checksum": [round(x, 3) for x in result["save_s_no_checksum"]],
            "load_s_all": [round(x, 3) for x in result["load_s_all"]],
            "load_s_all_no_checksum": [round(x, 3) for x in result["load_s_all_no_checksum"]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", default="zeroq,zeroq_pageable,zeroq_async,fsdp2,fsdp2_async")
    parser.add_argument("--dir", default="/tmp/zeroq_checkpoint_bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--bucket", type=float, default=2e8)
    parser.add_argument("--verify", action="store_true", help="zeroq: check the loaded state bit for bit")
    parser.add_argument("--checksum-ab", action="store_true",
                        help="zeroq arms: alternate every save and load with and without checksums in this run "
                             "(Checkpointer(checksums=False)) and report both and the cost in percent")
    parser.add_argument("--staging-mib", type=float, default=512,
                        help="zeroq: pinned staging ring of synchronous saves, MiB (0: pageable copies)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {sorted(ARMS)}")
    dist.init_process_group("cpu:gloo,cuda:nccl" if ON_GPU else "gloo")
    if ON_GPU:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    root = Path(args.dir)
    for arm in arms:
        fn, asynchronous = ARMS[arm]
        path = root / arm
        result = fn(args, dev, path, asynchronous)
        per_rank = gathered([statistics.median(result["save_s"]), result["blocked_s"][-1], max(result["save_peak"]),
                             result["load_s"], result["load_peak"]])
        size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else 0
        if dist.get_rank() == 0:
            print(json.dumps({
                "arm": arm, "world_size": dist.get_world_size(), "torch": torch.__version__,
                "checkpoint_GiB": round(size / 2**30, 2),
                "save_s": round(max(r[0] for r in per_rank), 3),
                "blocked_s": round(max(r[1] for r in per_rank), 3),
                "save_peak_rss_GiB_per_rank": [round(r[2], 2) for r in per_rank],
                "load_s": round(max(r[3] for r in per_rank), 3),
                "load_peak_rss_GiB_per_rank": [round(r[4], 2) for r in per_rank],
                "save_s_all": [round(s, 3) for s in result["save_s"]],
                **({"staging_MiB": result["staging_MiB"]} if "staging_MiB" in result else {}),
                **{k: result[k] for k in ("checksum_wait_s", "checksum_wait_pct_of_save", "checksum_load_wait_s")
                   if k in result},  # rank 0's: seconds its save's and load's I/O waited for the checksums
                **_checksum_ab(result),
            }), flush=True)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        gc.collect()
        if ON_GPU:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
