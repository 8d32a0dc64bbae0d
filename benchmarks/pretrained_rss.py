"""Peak host memory per rank while ``load_pretrained`` loads a checkpoint into a stage-3 engine, against
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

    python benchmarks/pretrained_rss.py --dir $SCRATCH/pretrained --out $OUT/pretrained_rss.jsonl
    python benchmarks/pretrained_rss.py --dim 64 --layers 2 --ffn 128 --vocab 256 --heads 4   # smoke run
"""

from __future__ import annotations

import argparse
import queue as queues
import gc
import json
import os
import shutil
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

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


def save(args: argparse.Namespace, root: Path) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args()
    import tempfile

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pretrained_rss_"))
    info = save(args, root)
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


if __name__ == "__main__":
    main()
