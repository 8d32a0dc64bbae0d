"""What checkpoints cost: save and load time and host memory against FSDP2 + DCP, what checksums add to the
I/O, and the host memory of loading pretrained weights into a stage-3 engine. One command each (``--help`` after
it says what it measures and how)::

    torchrun --nproc-per-node 2 benchmarks/checkpoints.py save-load --dir $SCRATCH/ckpt_bench
    python benchmarks/checkpoints.py checksum-io --dir $SCRATCH/checksum_io --gib 4 --repeats 3
    python benchmarks/checkpoints.py pretrained-rss --dir $SCRATCH/pretrained --out $OUT/pretrained_rss.jsonl

(``save-load`` was ``checkpoint_time.py``, ``checksum-io`` ``checksum_io.py`` and ``pretrained-rss``
``pretrained_rss.py``; their stored results keep those names.)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import queue as queues
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import commands  # noqa: E402
from benchmarks.commands import Command  # noqa: E402
from benchmarks.step_time import GPT  # noqa: E402
from lightning_zeroq.checkpoint import checksum  # noqa: E402

# ---------------------------------------------------------------------------------------------- save-load

SAVE_LOAD = """Checkpoint save and load time and peak host memory per rank: ZeroQ (sync and async) against FSDP2 +
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

    torchrun --nproc-per-node 2 benchmarks/checkpoints.py save-load --dir $SCRATCH/ckpt_bench
    torchrun --nproc-per-node 1 benchmarks/checkpoints.py save-load --dir $SCRATCH/ckpt_bench   # one GPU
    torchrun --nproc-per-node 2 benchmarks/checkpoints.py save-load --dim 64 --layers 2 --heads 2 --ffn 128 \
        --vocab 256 --seq 32 --batch 2     # CPU smoke run (gloo)
    torchrun --nproc-per-node 1 benchmarks/checkpoints.py save-load --arms zeroq --checksum-ab --repeats 3 --verify \
        --dir $SCRATCH/ckpt_bench              # the cost of checksums: saves and loads alternated with and without
"""

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


def save_load_arguments(parser: argparse.ArgumentParser) -> None:
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


def save_load(args: argparse.Namespace) -> int:
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
    return 0


# ---------------------------------------------------------------------------------------------- checksum-io

CHECKSUM_IO = """What checksums add to checkpoint I/O, without a model: one file of ``--gib`` GiB written and read back
through the same paths a save and a load take (``checksum.HashingWriter`` around the file, as ``torch.save``
writes a tensor; ``checksum.read_hashed`` into a buffer), each with and without hashing, alternating, plus
``xxh3_64`` and a plain memory copy alone. On page-cache I/O (no fsync) this is the largest relative cost
a save or load can see::

    python benchmarks/checkpoints.py checksum-io --dir $SCRATCH/checksum_io --gib 4 --repeats 3
"""

def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checksum_io_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="folder for the test file (removed at the end)")
    parser.add_argument("--gib", type=float, default=4.0, help="size of the file")
    parser.add_argument("--item-mib", type=int, default=256, help="bytes per write (a tensor item)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-chunk-mib", type=int, nargs="*", default=[],
                        help="also time checked reads with these chunk sizes")


def checksum_io(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "data.bin"
    item = torch.randint(0, 255, (args.item_mib << 20,), dtype=torch.uint8).numpy().tobytes()
    items = max(1, int(args.gib * 1024 / args.item_mib))
    total = items * len(item)
    buffer = memoryview(bytearray(total))
    h = checksum.hasher()
    hash_s = _timed(lambda: [h.update(item) for _ in range(items)])
    copy_s = _timed(lambda: [buffer.__setitem__(slice(i * len(item), (i + 1) * len(item)), item) for i in range(items)])

    def write(algorithm):
        with open(path, "wb") as f:
            out = checksum.HashingWriter(f, algorithm)
            for _ in range(items):
                out.write(item)

    def read(algorithm):
        with open(path, "rb") as f:
            fd = f.fileno()
            if algorithm is None:
                got = 0
                while got < total:
                    got += os.preadv(fd, [buffer[got:got + (1 << 30)]], got)
            else:
                checksum.read_hashed(lambda at, view: os.preadv(fd, [view], at), buffer, algorithm)

    rows: dict[str, list[float]] = {k: [] for k in ("write", "write_hashed", "read", "read_hashed")}
    write(None)
    for r in range(args.repeats):
        for name, fn in ([("write", lambda: write(None)), ("write_hashed", lambda: write(checksum.ALGORITHM))]
                         [:: -1 if r % 2 else 1]):
            rows[name].append(_timed(fn))
        for name, fn in ([("read", lambda: read(None)), ("read_hashed", lambda: read(checksum.ALGORITHM))]
                         [:: -1 if r % 2 else 1]):
            rows[name].append(_timed(fn))
    chunks = {}
    for mib in args.read_chunk_mib:
        checksum.READ_CHUNK = mib << 20
        chunks[f"read_hashed_chunk{mib}MiB_s"] = round(statistics.median(
            _timed(lambda: read(checksum.ALGORITHM)) for _ in range(args.repeats)), 3)
    path.unlink()
    med = {k: statistics.median(v) for k, v in rows.items()}
    gib = total / 2**30
    print(json.dumps({
        "GiB": round(gib, 2), "algorithm": checksum.ALGORITHM, "hash_GiB_s": round(gib / hash_s, 2),
        "copy_GiB_s": round(gib / copy_s, 2),
        **{f"{k}_s": round(v, 3) for k, v in med.items()},
        "write_cost_pct": round(100 * (med["write_hashed"] / med["write"] - 1), 1),
        "read_cost_pct": round(100 * (med["read_hashed"] / med["read"] - 1), 1),
        **chunks, **{f"{k}_all": [round(x, 3) for x in v] for k, v in rows.items()},
    }))
    return 0


# ---------------------------------------------------------------------------------------------- pretrained-rss

PRETRAINED_RSS = """Peak host memory per rank while ``load_pretrained`` loads a checkpoint into a stage-3 engine, against
the rank's own share of the weights and the whole checkpoint (CPU, gloo; no GPU needed).

A Llama (``transformers.LlamaForCausalLM``, 271M parameters by default) is saved once, in ``--dtype``, as a
sharded Hugging Face checkpoint (``save_pretrained``, ``--shard-mb`` per file), a ``lit_model.pth``
(``torch.save``) and a DCP directory (``dcp.save`` from the full state dict, one process). Then, for each
format, ``--world`` fresh processes each build the model under stage 3's meta-device context (the engine
materializes it unit by unit: no rank ever holds the whole model) and load it; each rank measures, around the
load alone:

- ``peak_rise_MiB``: the peak resident set (``VmHWM``, reset with ``/proc/self/clear_refs`` just before the
  load; anonymous and file-backed pages both: a touched page of a memory-mapped file counts) minus the
  resident set before it. The engine's master shards exist before the load, so this is what the load itself
  brings in: pages of the mapped files it touched and whatever it allocates on the way;
- ``rss_file_after_MiB`` / ``rss_anon_rise_MiB``: file-backed pages still mapped after the load (the reader
  has closed its files by then) and the rise of anonymous memory;
- ``share_MiB``: the rank's own part of the weights in the checkpoint's dtype (its ranges and the tensors it
  holds whole), ``bytes_read_MiB``: what it read from the files, ``largest_tensor_MiB``: the largest tensor.

Arms: ``safetensors``, ``torch``, ``dcp``: ``load_pretrained`` of each format. For comparison, ``get_slice``:
the rank's boxes read with ``safetensors.safe_open(...).get_slice`` (the file memory-mapped) into its master
shards, nothing else (no publish); ``torch_keep``: the ``torch`` arm with the read pages left mapped (what
``load_pretrained`` drops after each tensor); ``publish``: the engine's side of a load alone, every unit
published from its masters as a load does (``ShardedView.load``, nothing read): stage 3 gathers each unit once,
so its largest unit's full working buffer is the floor of every arm; ``whole``: every rank reads the whole
``lit_model.pth`` into memory (``torch.load`` without ``mmap``) and hands it to
``ZeroEngine.load_full_state_dict``.

The files are in the page cache (just written), so ``seconds`` is a warm read. One JSON line per arm::

    python benchmarks/checkpoints.py pretrained-rss --dir $SCRATCH/pretrained --out $OUT/pretrained_rss.jsonl
    python benchmarks/checkpoints.py pretrained-rss --dim 64 --layers 2 --ffn 128 --vocab 256 --heads 4   # smoke run
"""

MIB = 2**20


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Peak:
    """The peak resident set during a block: ``VmHWM`` reset by ``clear_refs`` (where the kernel allows it; else
    ``VmRSS`` sampled), and the peaks of anonymous and file-backed pages apart, sampled every millisecond."""

    def __enter__(self) -> "Peak":
        gc.collect()
        self.before = _status()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.sampled = False
        except OSError:
            self.sampled = True
        self._stop = threading.Event()
        self.maxima = dict(self.before)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            for key, value in _status().items():
                self.maxima[key] = max(self.maxima[key], value)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = self.maxima["VmRSS"] if self.sampled else _status()["VmHWM"]
        gc.collect()
        self.after = _status()


def _config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                    num_key_value_heads=args.heads, tie_word_embeddings=False)


def _rms_norm_reset() -> None:
    """Llama's RMSNorm has no ``reset_parameters``, which stage 3's meta-device build calls for each module."""
    from transformers.models.llama import modeling_llama

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    modeling_llama.LlamaRMSNorm.reset_parameters = reset_parameters


def save_formats(args: argparse.Namespace, root: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    import transformers

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(args)).to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    model.save_pretrained(root / "hf", max_shard_size=f"{args.shard_mb}MB")
    torch.save(state, root / "lit_model.pth")
    dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    info = {"params": sum(v.numel() for v in state.values()),
            "checkpoint_MiB": round(sum(v.numel() * v.element_size() for v in state.values()) / MIB, 1),
            "largest_tensor_MiB": round(max(v.numel() * v.element_size() for v in state.values()) / MIB, 1),
            "files": len(list((root / "hf").glob("*.safetensors")))}
    del model, state
    gc.collect()
    return info


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, arm: str, path: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import transformers

        import lightning_zeroq
        from lightning_zeroq.config import ZeroConfig
        from lightning_zeroq.zero.engine import ZeroEngine
        from lightning_zeroq.zero.materialize import parameters_on_meta

        from lightning_zeroq.checkpoint import pretrained

        if arm == "torch_keep":
            pretrained._Mapped.drop = lambda self, tensor: None  # type: ignore[method-assign]
        _rms_norm_reset()
        with parameters_on_meta():
            model = transformers.LlamaForCausalLM(_config(args))
        engine = ZeroEngine(model, ZeroConfig(stage=3))
        lightning_zeroq.load_pretrained(model, path)  # the code paths warmed (imports, first use)
        dist.barrier()
        with Peak() as peak:
            start = time.perf_counter()
            report = None
            if arm == "whole":
                state = torch.load(path, map_location="cpu", weights_only=True)
                engine.load_full_state_dict(state)
                del state
            elif arm == "publish":
                from lightning_zeroq.zero.state_dict import ShardedView

                for _ in ShardedView(engine.parts, None).load(optimizer=False):
                    pass
            elif arm == "get_slice":
                _get_slice(engine, Path(path))
            else:
                report = lightning_zeroq.load_pretrained(model, path)
            seconds = time.perf_counter() - start
        dist.barrier()
        queue.put({
            "rank": rank, "seconds": round(seconds, 2), "sampled": peak.sampled,
            "peak_rise_MiB": round((peak.peak - peak.before["VmRSS"]) / MIB, 1),
            "rss_before_MiB": round(peak.before["VmRSS"] / MIB, 1),
            "rss_anon_rise_MiB": round((peak.after["RssAnon"] - peak.before["RssAnon"]) / MIB, 1),
            "sampled_anon_peak_rise_MiB": round((peak.maxima["RssAnon"] - peak.before["RssAnon"]) / MIB, 1),
            "sampled_file_peak_rise_MiB": round((peak.maxima["RssFile"] - peak.before["RssFile"]) / MIB, 1),
            "rss_file_after_MiB": round(peak.after["RssFile"] / MIB, 1),
            "share_MiB": round(report.share_bytes / MIB, 1) if report else None,
            "bytes_read_MiB": round(report.bytes_read / MIB, 1) if report else None,
            "largest_read_MiB": round(report.largest_read / MIB, 2) if report else None,
        })
        del engine, model
    finally:
        dist.destroy_process_group()


def _get_slice(engine, path: Path) -> None:
    """The rank's boxes of every parameter through ``safe_open(...).get_slice`` into its master shards."""
    from safetensors import safe_open

    from lightning_zeroq.checkpoint.boxes import flat_range_boxes
    from lightning_zeroq.zero.state_dict import ShardedView

    index = path / "model.safetensors.index.json"
    placed = json.loads(index.read_text())["weight_map"] if index.exists() else defaultdict(lambda: "model.safetensors")
    handles = {name.name: safe_open(str(name), framework="pt") for name in path.glob("*.safetensors")}
    with torch.no_grad():
        for pv in ShardedView(engine.parts, None).params:
            if pv.part is None:
                continue
            whole, flat = handles[placed[pv.name]].get_slice(pv.name), pv.part.buffer()
            for box in flat_range_boxes(pv.shape, pv.part.offset, pv.part.offset + pv.part.numel):
                at = box.flat_start - pv.part.offset
                flat[at:at + box.numel].view(box.sizes).copy_(whole[tuple(slice(o, o + n) for o, n in
                                                                           zip(box.offsets, box.sizes))])
    handles.clear()


def run_arm(args: argparse.Namespace, arm: str, path: Path, port: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, arm, str(path), queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + args.timeout
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{arm}: a rank failed or timed out (exit codes {[p.exitcode for p in procs]})") from None
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"{arm}: a rank exited with {p.exitcode}")
    return sorted(results, key=lambda r: r["rank"])


def pretrained_rss_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--arms", default="safetensors,torch,dcp,get_slice,torch_keep,publish,whole")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    parser.add_argument("--timeout", type=float, default=1800)


def pretrained_rss(args: argparse.Namespace) -> int:
    import tempfile

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pretrained_rss_"))
    info = save_formats(args, root)
    paths = {"safetensors": root / "hf", "torch": root / "lit_model.pth", "dcp": root / "dcp",
             "whole": root / "lit_model.pth", "get_slice": root / "hf", "torch_keep": root / "lit_model.pth",
             "publish": root / "hf"}
    for i, arm in enumerate(args.arms.split(",")):
        ranks = run_arm(args, arm, paths[arm], 29600 + i)
        line = {"bench": "pretrained_rss", "arm": arm, "world": args.world, "stage": 3, "dtype": args.dtype,
                "model": f"llama dim={args.dim} layers={args.layers} ffn={args.ffn} vocab={args.vocab}", **info,
                "torch": torch.__version__, "cpus": os.cpu_count(), "ranks": ranks}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


# ---------------------------------------------------------------------------------------------- the commands

COMMANDS: dict[str, Command] = {"save-load": (SAVE_LOAD, save_load_arguments, save_load),
                                "checksum-io": (CHECKSUM_IO, checksum_io_arguments, checksum_io),
                                "pretrained-rss": (PRETRAINED_RSS, pretrained_rss_arguments, pretrained_rss)}


def main(argv: list[str] | None = None) -> int:
    return commands.run(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
