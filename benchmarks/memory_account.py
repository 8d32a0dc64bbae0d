"""Where every GiB of an arm's peak goes: the CUDA caching allocator's own trace, replayed.

Per arm of ``--arms`` (``step_time.py``'s, built by its ``build_arm``): record the allocator's history with
Python stacks from before the model is built, run ``--warmup`` + ``--steps`` steps (the last: the measured
step), take ``torch.cuda.memory._snapshot()`` and replay its trace (``alloc`` adds a block,
``free_requested`` removes it, as the allocated-bytes counter does; ``segment_*`` move the reserved bytes)
to the peak after the build (step_time's ``peak_alloc_GiB`` window) and to the measured step's peak. A
block live then is classed by who still holds it at the end (ZeroQ: ``memory_report``'s kinds; peers:
parameters, optimizer state, DeepSpeed's flat buffers) or held it as the optimizer's ``.grad`` when the
measured step's optimizer step began, else by the innermost Python frame of its allocation stack that a
rule of ``RULES`` matches. Rank 0 prints per arm the classes at both peaks beside the formula
(``memory_report``; the largest transient unit twice for the gathered units; autograd's saved bytes for
the activations), the top frames, the allocator's peak allocated and reserved bytes (reserved -
allocated: the cache's fragmentation) on every rank, and a JSON line. Every rank writes
``ARM_rankR_peak.json.gz`` (both accounts, each live block with its stack) into ``--out``, the ranks of
``--snapshot-ranks`` ``ARM_rankR.pickle.gz`` too: the snapshot with its trace cut to the steps, or nearer
the peak, to stay under ``--snapshot-mib`` (gunzip it for https://pytorch.org/memory_viz)::

    torchrun --nproc-per-node 2 benchmarks/memory_account.py --arms zeroq2,zeroq3,fsdp2,ds2 --out /tmp/mem
    torchrun --nproc-per-node 1 benchmarks/memory_account.py --arms zeroq2,zeroq3 --out /tmp/mem  # one GPU

``python benchmarks/suite.py memory`` runs zeroq2, zeroq3, fsdp2 (and ds2, ds3 with DeepSpeed) at world
size 2. The trace holds requested bytes; the allocator counts blocks (512-byte multiples; a large block
keeps up to 1 MiB not worth splitting off), so its peak is a little higher. What the autograd engine's
device thread allocates has no Python frame (``--stacks all`` adds C++ frames, naming ``AccumulateGrad``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import pickle
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import SavedBytes, add_model_arguments, build_arm, memory_bound, parse_arm  # noqa: E402

GIB = 2**30
ACTIVATIONS, AUTOCAST = "activations (forward)", "autocast copies (bf16 weights)"
NO_FRAME = "no Python frame (backward: activation grads, .grad)"
BEFORE = "allocated before recording"
GATHERED, GRAD_STAGING = "gathered units", "gradient staging (reduce buckets)"
# (path fragment, function names or None for any, class or None: "ask the caller"). A block's class is
# that of the innermost Python frame some rule matches, by the first rule (in this order) matching it.
RULES = [
    ("benchmarks/memory_account.py", {"_mark_steps", "_mark_measured", "_mark_optimizer_step"}, "markers"),
    ("lightning_zeroq/zero/offload/", {"adopt_master"}, "masters"),
    ("lightning_zeroq/zero/offload/", {"put", "__init__"}, "stored_shards"),
    ("lightning_zeroq/zero/offload/", None, "shard casts, host-copy staging (offload/)"),
    ("lightning_zeroq/zero/unit.py", {"restore_storage", "release_storage"}, GATHERED),
    ("lightning_zeroq/zero/unit.py", None, "unit build (full fp32, working flat)"),
    ("lightning_zeroq/zero/wire.py", None, "gather staging (wire: payloads, receive buffers)"),
    ("lightning_zeroq/zero/reducer.py", {"begin_backward"}, "gradient accumulation (fp32 local sums)"),
    ("lightning_zeroq/zero/reducer.py", None, GRAD_STAGING),
    ("lightning_zeroq/zero/grad_wire.py", None, GRAD_STAGING),
    ("lightning_zeroq/cli/gpt.py", None, ACTIVATIONS),  # the benchmarks' model
    ("lightning_zeroq/", None, "zeroq other"),
    ("torch/optim/", {"_init_group"}, "optimizer_state"),
    ("torch/optim/", None, "optimizer step temporaries"),
    ("torch/distributed/tensor/", None, None),  # DTensor dispatch
    ("torch/distributed/fsdp/", {"allocate"}, None),
    ("torch/distributed/fsdp/", {"_init_sharded_param"}, "masters"),
    ("torch/distributed/fsdp/", {"foreach_reduce", "foreach_reduce_scatter_copy_in"}, GRAD_STAGING),
    ("torch/distributed/fsdp/", {"foreach_all_gather", "foreach_all_gather_copy_out", "all_gather_copy_in_cuda",
                                 "alloc_all_gather_outputs", "init_all_gather_outputs"}, GATHERED),
    ("torch/distributed/fsdp/", None, "fsdp other"),
    ("torch/distributed/", None, "collectives (torch.distributed)"),
    ("deepspeed/ops/", None, "optimizer step temporaries"),
    ("deepspeed/runtime/zero/partition", None, GATHERED),  # partition_parameters.py, partitioned_param_coordinator.py
    ("deepspeed/runtime/zero/stage", None, "deepspeed ZeRO (buckets, flat buffers)"),
    ("deepspeed/", None, "deepspeed other"),
    ("torch/nn/parallel/", None, GRAD_STAGING),  # DDP's buckets
    ("torch/nn/utils/", None, "clip temporaries"),
    ("torch/nn/", None, ACTIVATIONS),
    ("benchmarks/step_time.py", {"forward"}, ACTIVATIONS),
    ("torch/autograd/", None, "backward (autograd, Python)"),
    ("benchmarks/", None, "benchmark loop (tokens, loss)"),
]
ALLOC, FREE, GROW, SHRINK = "alloc", "free_requested", ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")


def describe(frame: dict) -> str:
    f = frame["filename"].replace("\\", "/")
    i = min((j for j in (f.find(r) for r in ("lightning_zeroq/", "benchmarks/", "deepspeed/", "torch/")) if j >= 0), default=0)
    return f"{f[i:]}:{frame['line']} {frame['name']}"


def _mine(frame: dict) -> bool:
    return any(r in frame["filename"].replace("\\", "/") for r in ("lightning_zeroq/", "benchmarks/"))


def classify(frames: list, size: int = 0, autocast_sizes: frozenset = frozenset()) -> tuple[str, str]:
    """(class, key) of a block from its allocation stack (innermost frame first); the key is the frame
    that decided, with its nearest caller in this repository where that frame is outside it."""
    py = [f for f in frames if f["filename"].endswith(".py")]
    for i, frame in enumerate(py):
        path = frame["filename"].replace("\\", "/")
        rule = next((r for r in RULES if r[0] in path and (r[1] is None or frame["name"] in r[1])), None)
        if rule is None or rule[2] is None:
            continue
        caller = next((f for f in py[i + 1:] if _mine(f)), None)
        key = describe(frame) + (f" < {describe(caller)}" if caller is not None and not _mine(frame) else "")
        return (AUTOCAST if rule[2] == ACTIVATIONS and size in autocast_sizes else rule[2]), key
    if py:
        return "other", describe(py[0])
    if any("AccumulateGrad" in f["name"] for f in frames):
        return "parameter .grad (AccumulateGrad)", "AccumulateGrad"
    return NO_FRAME, NO_FRAME


def end_state(snapshot: dict, device: int) -> tuple[dict, int]:
    """The blocks allocated at the snapshot on ``device`` ({address: (requested bytes, frames)}) and its reserved bytes."""
    blocks, reserved = {}, 0
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        reserved += seg["total_size"]
        addr = seg["address"]
        for b in seg["blocks"]:
            addr = b.get("address", addr)
            if b["state"] == "active_allocated":
                blocks[addr] = (b.get("requested_size", b["size"]), b.get("frames", []))
            addr += b["size"]
    return blocks, reserved


def _walk(trace: list, live: dict, reserved: int):
    """Apply each event to ``live`` in place; yield (index, allocated, reserved): first before any, then after each."""
    allocated = sum(b[1] for b in live.values())
    yield -1, allocated, reserved
    for i, e in enumerate(trace):
        action = e["action"]
        if action == ALLOC:
            old = live.get(e["addr"])
            live[e["addr"]] = (i, e["size"], e.get("frames", []))
            allocated += e["size"] - (old[1] if old else 0)
        elif action == FREE and e["addr"] in live:
            allocated -= live.pop(e["addr"])[1]
        elif action in GROW:
            reserved += e["size"]
        elif action in SHRINK:
            reserved -= e["size"]
        yield i, allocated, reserved


def replay(trace: list, end_blocks: dict, end_reserved: int, start: int = 0, moments=()) -> dict:
    """The peak of allocated bytes from just before event ``start`` on (the first if several): its event
    ``index`` (-1: before any), ``bytes``, ``reserved`` bytes, the blocks ``live`` then ({address: (ident,
    bytes, frames)}) and the idents of the blocks live at the end (``final``). A block's ident is its alloc
    event's index, or ("pre", address) where it predates the trace: freed in it before any alloc at its
    address, or allocated at the end with no event at its address. ``at``: the idents live after each
    event of ``moments``. ``mismatch``: addresses allocated at the end by the replay or by the snapshot
    but not both (0 unless events were lost)."""
    initial, seen = {}, set()
    for e in trace:
        if e["action"] in (ALLOC, FREE, "free_completed") and e["addr"] not in seen:
            seen.add(e["addr"])
            if e["action"] == FREE:
                initial[e["addr"]] = (("pre", e["addr"]), e["size"], e.get("frames", []))  # the alloc's, if recorded
    initial.update({a: (("pre", a), s, f) for a, (s, f) in end_blocks.items() if a not in seen})
    reserved = end_reserved - sum(e["size"] for e in trace if e["action"] in GROW) \
        + sum(e["size"] for e in trace if e["action"] in SHRINK)
    index, peak, at_reserved = max((s for s in _walk(trace, dict(initial), reserved) if s[0] >= start - 1),
                                   key=lambda s: s[1])
    live, at_peak, at = dict(initial), None, {}
    for i, _, _ in _walk(trace, live, reserved):
        if i == index:
            at_peak = dict(live)
        if i in moments:
            at[i] = {b[0] for b in live.values()}
    return {"index": index, "bytes": peak, "reserved": at_reserved, "live": at_peak, "at": at,
            "final": {b[0] for b in live.values()}, "mismatch": len(live.keys() ^ end_blocks.keys())}


def reserved_account(trace: list, end_reserved: int, start: int = 0, top: int = 8) -> dict:
    """Where the reserved bytes are at their highest point from event ``start`` on: per CUDA stream (a block
    freed on one stream's pool serves only allocations on that stream), the segments' bytes, the bytes
    allocated in them then, and the segments grouped by the allocation that made the allocator reserve them."""
    reserved = end_reserved - sum(e["size"] for e in trace if e["action"] in GROW) \
        + sum(e["size"] for e in trace if e["action"] in SHRINK)
    segments: dict = {}
    blocks: dict = {}
    best, at = -1, None
    for i, e in enumerate(trace):
        action = e["action"]
        if action in GROW:
            reserved += e["size"]
            segments[e["addr"]] = (e["size"], e.get("stream", 0), e.get("frames", []))
        elif action in SHRINK:
            reserved -= e["size"]
            segments.pop(e["addr"], None)
        elif action == ALLOC:
            blocks[e["addr"]] = (e["size"], e.get("stream", 0))
        elif action == FREE:
            blocks.pop(e["addr"], None)
        if i >= start and reserved > best:
            best, at = reserved, (dict(segments), dict(blocks), i)
    if at is None:
        return {}
    segs, live, index = at
    streams: dict = {}
    makers: Counter = Counter()
    for size, stream, frames in segs.values():
        row = streams.setdefault(stream, {"reserved": 0, "allocated": 0, "segments": 0})
        row["reserved"] += size
        row["segments"] += 1
        makers[f"stream {stream}: " + classify(frames, size)[1]] += size
    for size, stream in live.values():
        streams.setdefault(stream, {"reserved": 0, "allocated": 0, "segments": 0})["allocated"] += size
    return {"index": index, "reserved_bytes": best, "streams": streams, "makers": makers.most_common(top),
            "traced_segments_bytes": sum(s[0] for s in segs.values())}


def find_marker(trace: list, name: str) -> int:
    for i, e in enumerate(trace):
        if e["action"] == ALLOC and any(f["name"] == name for f in e.get("frames", [])):
            return i
    raise ValueError(f"no allocation by {name}() in the trace: were its first events dropped (raise --max-entries)?")


def account(snapshot: dict, device: int, marker: str | None = None, owners=(),
            autocast_sizes: frozenset = frozenset(), top: int = 15) -> dict:
    """Classify the blocks live at the peak of ``device``'s trace from the ``marker`` allocation on (the
    whole trace without one). ``owners``: [(moment, {storage address: class})], each table taken right
    after the allocation by the function named ``moment`` (None: at the end); the first table naming a
    block's address while that very block was live classes it. Else its stack does; a block from
    before the trace is ``BEFORE``."""
    trace = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    end_blocks, end_reserved = end_state(snapshot, device)
    start = find_marker(trace, marker) if marker else 0
    moments = {m: find_marker(trace, m) for m, _ in owners if m}
    r = replay(trace, end_blocks, end_reserved, start, set(moments.values()))
    classes, keys, blocks = Counter(), Counter(), []
    for addr, (ident, size, frames) in r["live"].items():
        cls, key = classify(frames, size, autocast_sizes)
        if isinstance(ident, tuple):
            cls = BEFORE
        cls = next((t[addr] for m, t in owners if addr in t and ident in (r["at"][moments[m]] if m else r["final"])), cls)
        classes[cls] += size
        keys[key] += size
        blocks.append({"addr": addr, "bytes": size, "class": cls,
                       "frames": [describe(f) for f in frames if f["filename"].endswith(".py")][:12]})
    return {"peak_bytes": r["bytes"], "reserved_bytes": r["reserved"], "index": r["index"], "start": start,
            "moments": moments, "events": len(trace), "mismatch": r["mismatch"], "classes": dict(classes.most_common()),
            "top": keys.most_common(top), "blocks": blocks}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield getattr(obj, "_local_tensor", obj)  # a DTensor's shard
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v)


def owner_map(groups: list, device_type: str = "cuda") -> dict[int, str]:
    """{storage address: class} of the device's tensors in ``groups`` ([(class, tensors, nested)]); a storage's first class wins."""
    owners: dict[int, str] = {}
    for cls, obj in groups:
        for t in _tensors(obj):
            if t.device.type == device_type and t.untyped_storage().nbytes():
                owners.setdefault(t.untyped_storage().data_ptr(), cls)
    return owners


def arm_owners(arm, device_type: str = "cuda") -> dict[int, str]:
    """Who holds which block at the end: ZeroQ by ``memory_report``'s kinds, a peer by what it keeps."""
    engine, opt, params = arm.engine, arm.optimizer, list(arm.model.parameters())
    if engine is not None:
        store = engine.parts.gatherer.store
        return owner_map([("masters", [u.master for u in engine.parts.units]),
                          ("gradient_shards", [u.grad for u in engine.parts.units if u.has_grad_storage]),  # only in a window
                          ("optimizer_state", list(engine.optimizer.state.values()) if engine.optimizer else []),
                          ("persistent_units", [u.flat for u in engine.parts.units if u.persistent]),
                          ("stored_shards", store.device_tensors() if store is not None else [])], device_type)
    inner = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO optimizer wraps the one that holds the state

    def ds(*names):
        return [getattr(opt, n, None) for n in names]
    return owner_map([("masters", ds("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")),
                      ("gradient_shards", ds("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")),
                      ("optimizer_state", list(inner.state.values())),
                      ("working parameters (bf16 flat)", ds("bit16_groups_flat", "fp16_partitioned_groups_flat")),
                      ("masters", [p for p in params if hasattr(p, "_local_tensor")]),  # FSDP2's sharded fp32 parameters
                      ("parameters", params), ("gradients (.grad)", [p.grad for p in params])], device_type)


def autocast_sizes(model) -> frozenset:
    """Bytes of a bf16 copy of each fp32 matrix the forward multiplies by (DDP: autocast casts them)."""
    return frozenset(p.numel() * 2 for p in model.parameters()
                     if p.dtype == torch.float32 and p.dim() == 2 and p.is_cuda and not hasattr(p, "_local_tensor"))


def write_snapshot(snapshot: dict, device: int, start: int, peak: int, path: str, limit: int) -> int | None:
    """Write the snapshot gzipped for the viewer, its trace on ``device`` from event ``start`` on, or later
    (never past ``peak``) until it fits ``limit`` bytes; returns the first event kept, None if nothing fits."""
    trace, k = snapshot["device_traces"][device], max(start, 0)
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    while True:
        cut = {**snapshot, "segments": segments,
               "device_traces": [trace[k:] if d == device else [] for d in range(len(snapshot["device_traces"]))]}
        data = gzip.compress(pickle.dumps(cut), 6)
        if len(data) <= limit:
            with open(path, "wb") as f:
                f.write(data)
            return k
        if k >= peak:
            return None
        k = min(peak, max(k + 1, len(trace) - int((len(trace) - k) * 0.9 * limit / len(data))))


# Allocations whose stacks name the moments: the steps begin, the measured step begins, its optimizer step begins.
def _mark_steps(dev): torch.empty(1, device=dev)  # noqa: E704
def _mark_measured(dev): torch.empty(1, device=dev)  # noqa: E704
def _mark_optimizer_step(dev): torch.empty(1, device=dev)  # noqa: E704


def run_one(name: str, args: argparse.Namespace, dev: torch.device) -> dict:
    rank, device = dist.get_rank(), dev.index or 0
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks=args.stacks, max_entries=args.max_entries,
                                             clear_history=True)
    arm = build_arm(name, args, dev)
    saved, g = SavedBytes(arm.model), torch.Generator(device=dev).manual_seed(rank)
    inner = getattr(arm.optimizer, "optimizer", arm.optimizer)  # DeepSpeed's wraps a torch optimizer
    grads, fired, measured = {}, [], False
    units = list(arm.engine.parts.units) if arm.engine is not None else None

    def pre_step(opt, *_):  # the measured step's gradients the optimizer steps with
        if measured and not fired:
            fired.append(_mark_optimizer_step(dev))
            # ZeroQ: the fp32 shards, held from finalize to the end of the step (the views the optimizer
            # reads are set after the hooks); a peer: the .grad of its parameters
            held = [u.grad for u in units if u.has_grad_storage] if units is not None else \
                [p.grad for group in opt.param_groups for p in group["params"]]
            grads.update(owner_map([("gradient_shards", held)]))
    hook = inner.register_step_pre_hook(pre_step)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _mark_steps(dev)
    for i in range(args.warmup + args.steps):
        measured = i == args.warmup + args.steps - 1
        if measured:
            _mark_measured(dev)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev, generator=g)
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if measured else contextlib.nullcontext()
        with torch.autocast("cuda", dtype=torch.bfloat16), hooks:
            loss = arm.forward(tokens)
        arm.finish(loss)
    torch.cuda.synchronize()
    allocator = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    hook.remove()
    owners = [(None, arm_owners(arm))] + ([("_mark_optimizer_step", grads)] if fired else [])
    sizes = autocast_sizes(arm.model)
    steps, step = (account(snapshot, device, m, owners, sizes) for m in ("_mark_steps", "_mark_measured"))
    trace = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    steps["reserved_peak"] = reserved_account(trace, end_state(snapshot, device)[1], steps["start"])
    formula = {ACTIVATIONS: saved.gib}
    bound = {}
    if arm.engine is not None:
        bound, report = memory_bound(arm.engine), arm.engine.memory_report()
        formula[GATHERED] = 2 * report.pop("largest_transient_unit") / GIB
        formula.update({k: v / GIB for k, v in report.items()})
        arm.engine.close()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{name.replace('+', '_')}_rank{rank}")
    with gzip.open(stem + "_peak.json.gz", "wt") as f:
        json.dump({"arm": name, "rank": rank, "steps_peak": steps, "measured_step_peak": step, "allocator": allocator}, f)
    kept = None
    if args.snapshot_ranks == "all" or str(rank) in args.snapshot_ranks.split(","):
        kept = write_snapshot(snapshot, device, steps["start"], steps["index"], stem + ".pickle.gz", int(args.snapshot_mib * 2**20))
    wrapped = len(snapshot["device_traces"][device]) >= args.max_entries
    units = None  # the hook is removed: nothing reads it again
    del arm, loss, tokens, snapshot, saved
    gc.collect()
    torch.cuda.empty_cache()
    return {"steps": steps, "step": step, "allocator": allocator, "formula": formula, "bound": bound,
            "snapshot_from_event": kept, "wrapped": wrapped}


def report(name: str, r: dict, per_rank: list) -> dict:
    """Print rank 0's account of one arm; return its JSON summary."""
    s, m, f, (alloc, reserved) = r["steps"], r["step"], r["formula"], r["allocator"]
    print(f"\n== {name}: world size {len(per_rank)}, torch {torch.__version__}; rank 0: peak after the build (trace, requested"
          f" bytes) {s['peak_bytes'] / GIB:.2f} GiB at event {s['index']} of {s['events']} (steps from {s['start']}, the measured"
          f" step from {m['start']}, its peak {m['peak_bytes'] / GIB:.2f} GiB at {m['index']}, its optimizer step from"
          f" {m['moments'].get('_mark_optimizer_step', '?')}), reserved then"
          f" {s['reserved_bytes'] / GIB:.2f}\nallocator: max allocated {alloc / GIB:.2f}, max reserved {reserved / GIB:.2f},"
          f" reserved - allocated {(reserved - alloc) / GIB:.2f} GiB; per rank (trace peak, max allocated, max reserved) GiB: "
          + "; ".join(" ".join(f"{x / GIB:.2f}" for x in p) for p in per_rank))
    if r["wrapped"] or s["mismatch"]:
        print(f"WARNING: trace wrapped: {r['wrapped']} (raise --max-entries); {s['mismatch']} blocks differ from the end state")
    rows = sorted(s["classes"].keys() | m["classes"].keys() | f.keys(), key=lambda c: -s["classes"].get(c, 0))
    bound = f.get(ACTIVATIONS, 0) + r["bound"]["bound_GiB"] if r["bound"] else None
    print(f"{'GiB':<52}{'steps peak':>11}{'step peak':>11}{'formula':>9}")
    for cls, a, b, c in [(c, s["classes"].get(c), m["classes"].get(c), f.get(c)) for c in rows] \
            + [("total (formula: memory_bound + activations)", s["peak_bytes"], m["peak_bytes"], bound)]:
        print(f"{cls:<52}" + "".join(f"{'-' if x is None else f'{x / k:.2f}':>{w}}" for x, k, w in
                                     ((a, GIB, 11), (b, GIB, 11), (c, 1, 9))))
    rp = s.get("reserved_peak") or {}
    if rp:
        print(f"reserved at its highest point after the build: {rp['reserved_bytes'] / GIB:.2f} GiB at event {rp['index']}"
              f" ({rp['traced_segments_bytes'] / GIB:.2f} in segments the trace saw made); per stream (reserved,"
              " allocated then, segments): " + "; ".join(f"{k}: {v['reserved'] / GIB:.2f} {v['allocated'] / GIB:.2f}"
                                                        f" {v['segments']}" for k, v in rp["streams"].items()))
        print("segments then, by the allocation that made them, GiB:\n"
              + "\n".join(f"  {v / GIB:7.2f}  {k}" for k, v in rp["makers"]))
    print("top frames at the steps peak, GiB:\n" + "\n".join(f"  {v / GIB:7.2f}  {k}" for k, v in s["top"]))
    gb = lambda d: {k: round(v / GIB, 3) for k, v in d.items()}  # noqa: E731
    return {"arm": name, "world_size": len(per_rank), "torch": torch.__version__,
            "per_rank_GiB_trace_alloc_reserved": [[round(x / GIB, 2) for x in p] for p in per_rank],
            "classes_GiB": gb(s["classes"]), "measured_step_classes_GiB": gb(m["classes"]),
            "formula_GiB": {k: round(v, 3) for k, v in f.items()}, **r["bound"],
            "top_frames_GiB": [[k, round(v / GIB, 3)] for k, v in s["top"]],
            "reserved_peak": {k: (v if k not in ("reserved_bytes", "traced_segments_bytes") else round(v / GIB, 3))
                              for k, v in (s.get("reserved_peak") or {}).items()}, "snapshot_from_event": r["snapshot_from_event"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="zeroq2,zeroq3", help="comma-separated step_time.py arms, in this order")
    add_model_arguments(parser, steps=1, warmup=2)
    parser.add_argument("--out", default="memory_account", help="folder for the per-rank files")
    parser.add_argument("--max-entries", type=int, default=1_000_000, help="allocator events kept (a ring)")
    parser.add_argument("--stacks", choices=("python", "all"), default="python")
    parser.add_argument("--snapshot-ranks", default="0", help="ranks writing the snapshot pickle: 0,1 / all / ''")
    parser.add_argument("--snapshot-mib", type=float, default=15.0, help="cap of each gzipped snapshot")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    for arm in arms:
        parse_arm(arm)  # fail before any work
    if not torch.cuda.is_available():
        raise SystemExit("memory_account.py needs CUDA: the allocator trace it replays is the CUDA caching allocator's"
                         " (torch.cuda.is_available() is False here)")
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device())
    for arm in arms:
        r = run_one(arm, args, dev)
        mine = (r["steps"]["peak_bytes"], *r["allocator"])
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        if dist.get_rank() == 0:
            print(json.dumps(report(arm, r, per_rank)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
