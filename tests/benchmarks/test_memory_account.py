"""benchmarks/memory_account.py without a GPU: the allocator-trace replay and the classification are pure
functions over a snapshot dict (torch.cuda.memory._snapshot()'s format), checked on synthetic snapshots;
the script itself parses its arguments and says why it cannot run without CUDA."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import memory_account as ma

REPO = Path(__file__).resolve().parents[2]
SITE = "/venv/lib/python3.12/site-packages/"


def frame(path: str, name: str, line: int = 1) -> dict:
    return {"filename": path, "name": name, "line": line}


STEP = frame(f"{REPO}/benchmarks/step_time.py", "forward", 66)
LOOP = frame(f"{REPO}/benchmarks/memory_account.py", "run_one", 200)
MASTER = [frame(f"{REPO}/lightning_zeroq/zero/offload/device.py", "adopt_master", 67),
          frame(f"{REPO}/lightning_zeroq/zero/unit.py", "build_units", 175), LOOP]
BUILD = [frame(f"{REPO}/lightning_zeroq/zero/unit.py", "build_units", 169), LOOP]
GATHER = [frame(f"{REPO}/lightning_zeroq/zero/unit.py", "restore_storage", 133),
          frame(f"{REPO}/lightning_zeroq/zero/gather.py", "gather", 80), STEP, LOOP]
LINEAR = [frame(SITE + "torch/nn/modules/linear.py", "forward", 134),
          frame(SITE + "torch/nn/modules/module.py", "_call_impl", 1790), STEP, LOOP]
OPTIM = [frame(SITE + "torch/optim/adamw.py", "_init_group", 120),
         frame(f"{REPO}/lightning_zeroq/zero/step.py", "run", 80), LOOP]
TOKENS = [LOOP]
MARK = [frame(f"{REPO}/benchmarks/memory_account.py", "_mark_steps", 250), LOOP]


def alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames}


def free(addr, size):
    return [{"action": a, "addr": addr, "size": size, "stream": 0, "frames": []}
            for a in ("free_requested", "free_completed")]


def block(addr, size, frames, state="active_allocated"):
    return {"address": addr, "size": -(-size // 512) * 512, "requested_size": size, "state": state, "frames": frames}


P, Q, T, A, M, B, C, E, F, G = (0x1000 * i for i in range(1, 11))


def synthetic() -> dict:
    """P: allocated before recording, live throughout; Q: before recording, freed first thing; T: a build
    temporary, the largest peak (with A), before the marker; the marker; B: a gathered unit freed before the
    peak; the peak after the marker is after F's alloc (event 13); C's address is reused by G."""
    trace = [*free(Q, 50),                                      # 0, 1
             {"action": "segment_alloc", "addr": 0, "size": 1 << 20, "stream": 0, "frames": []},  # 2
             alloc(T, 5000, BUILD), alloc(A, 1000, MASTER), *free(T, 5000),  # 3, 4, 5, 6
             alloc(M, 8, MARK), *free(M, 8),                    # 7, 8, 9
             alloc(B, 400, GATHER), alloc(C, 300, LINEAR),      # 10, 11
             *free(B, 400),                                     # 12, 13
             alloc(E, 700, []), alloc(F, 50, OPTIM),            # 14, 15 <- the peak (2150 bytes)
             *free(C, 300), *free(E, 700),                      # 16-19
             alloc(C, 10, TOKENS)]                              # 20: G, at C's address
    live = [block(P, 100, []), block(A, 1000, MASTER), block(F, 50, OPTIM), block(C, 10, TOKENS)]
    segment = {"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
               "allocated_size": 0, "active_size": 0, "blocks": [*live, {"address": 0x100000, "size": 512, "state": "inactive"}]}
    other = {**segment, "device": 1, "total_size": 7 << 20, "blocks": [block(G, 12345, [])]}
    return {"segments": [segment, other], "device_traces": [trace, []]}


def test_replay_finds_the_peak_after_the_marker_and_its_live_blocks():
    snap = synthetic()
    trace = snap["device_traces"][0]
    end_blocks, reserved = ma.end_state(snap, 0)
    assert end_blocks == {P: (100, []), A: (1000, MASTER), F: (50, OPTIM), C: (10, TOKENS)} and reserved == 2 << 20
    whole = ma.replay(trace, end_blocks, reserved)
    assert (whole["index"], whole["bytes"]) == (4, 100 + 5000 + 1000)  # the build temporary beside A
    start = ma.find_marker(trace, "_mark_steps")
    assert start == 7
    r = ma.replay(trace, end_blocks, reserved, start)
    assert (r["index"], r["bytes"], r["reserved"]) == (15, 2150, 2 << 20)
    assert {a: (ident, size) for a, (ident, size, _) in r["live"].items()} == {
        P: (("pre", P), 100), A: (4, 1000), C: (11, 300), E: (14, 700), F: (15, 50)}
    assert r["final"] == {("pre", P), 4, 15, 20} and r["mismatch"] == 0
    before = ma.replay(trace[:3], {P: (100, [])}, 1 << 20)  # no event after the start: the state before any
    assert (before["index"], before["bytes"], before["reserved"]) == (-1, 150, 0)


def test_account_classes_at_the_peak_exactly():
    snap = synthetic()
    owners = {A: "owned masters", C: "owned tokens"}  # C's address: the owner holds G, not the activation
    acc = ma.account(snap, 0, "_mark_steps", [(None, owners)])
    assert acc["peak_bytes"] == 2150 and acc["index"] == 15 and acc["start"] == 7
    assert acc["classes"] == {"owned masters": 1000, ma.NO_FRAME: 700, ma.ACTIVATIONS: 300,
                              ma.BEFORE: 100, "optimizer_state": 50}
    keys = dict(acc["top"])
    assert keys["torch/nn/modules/linear.py:134 forward < benchmarks/step_time.py:66 forward"] == 300
    assert keys["lightning_zeroq/zero/offload/device.py:67 adopt_master"] == 1000
    assert sum(b["bytes"] for b in acc["blocks"]) == 2150
    # without owners, by stack; the linear's output counted as an autocast copy when its size is one
    acc = ma.account(snap, 0, "_mark_steps", autocast_sizes=frozenset({300}))
    assert acc["classes"] == {"masters": 1000, ma.NO_FRAME: 700, ma.AUTOCAST: 300, ma.BEFORE: 100, "optimizer_state": 50}
    # the whole trace: the build temporary's peak
    acc = ma.account(snap, 0)
    assert acc["classes"] == {"unit build (full fp32, working flat)": 5000, "masters": 1000, ma.BEFORE: 100}
    with pytest.raises(ValueError, match="_mark_measured"):
        ma.account(snap, 0, "_mark_measured")


def test_owners_taken_at_a_moment_class_only_the_blocks_live_then():
    snap = synthetic()
    moment = frame(f"{REPO}/benchmarks/memory_account.py", "_mark_optimizer_step")
    snap["device_traces"][0][15:15] = [alloc(M + 16, 8, [moment, LOOP]), *free(M + 16, 8)]  # after E's alloc, before F's
    at_step = {E: "gradient_shards", F: "not yet allocated", A: "second"}
    acc = ma.account(snap, 0, "_mark_steps", [(None, {A: "first"}), ("_mark_optimizer_step", at_step)])
    assert (acc["index"], acc["moments"]) == (18, {"_mark_optimizer_step": 15})
    assert acc["classes"] == {"first": 1000, "gradient_shards": 700, ma.ACTIVATIONS: 300, ma.BEFORE: 100, "optimizer_state": 50}
    with pytest.raises(ValueError, match="_mark_other"):
        ma.account(snap, 0, "_mark_steps", [("_mark_other", {})])


def test_classify_rules():
    zeroq = f"{REPO}/lightning_zeroq/zero/"
    assert ma.classify(GATHER)[0] == ma.GATHERED
    assert ma.classify([frame(zeroq + "reducer.py", "_reduce"), LOOP])[0] == ma.GRAD_STAGING
    assert ma.classify([frame(zeroq + "wire.py", "_gather_chunk"), LOOP])[0].startswith("gather staging")
    assert ma.classify([frame(SITE + "torch/optim/adamw.py", "_fused_adamw"), LOOP])[0] == "optimizer step temporaries"
    fsdp = SITE + "torch/distributed/fsdp/_fully_shard/"
    alloc_rs = [frame(fsdp + "_fsdp_collectives.py", "allocate"), frame(fsdp + "_fsdp_collectives.py", "foreach_reduce")]
    assert ma.classify(alloc_rs) == (ma.GRAD_STAGING, "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:1 foreach_reduce")
    dtensor = [frame(SITE + "torch/distributed/tensor/_dispatch.py", "dispatch"), *OPTIM]
    assert ma.classify(dtensor)[0] == "optimizer_state"
    assert ma.classify([frame(SITE + "deepspeed/runtime/zero/partition_parameters.py", "_allgather_params")])[0] == ma.GATHERED
    assert ma.classify([frame(SITE + "torch/nn/parallel/distributed.py", "__init__"), LOOP])[0] == ma.GRAD_STAGING
    assert ma.classify([frame(SITE + "torch/nn/utils/clip_grad.py", "_clip_grads_with_norm_")])[0] == "clip temporaries"
    assert ma.classify(TOKENS)[0] == "benchmark loop (tokens, loss)"
    assert ma.classify([frame("/usr/lib/python3.12/threading.py", "run")]) == ("other", "/usr/lib/python3.12/threading.py:1 run")
    assert ma.classify([]) == (ma.NO_FRAME, ma.NO_FRAME)
    cpp = [frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", "malloc"),
           frame("/pytorch/torch/csrc/autograd/functions/accumulate_grad.h", "torch::autograd::AccumulateGrad::apply")]
    assert ma.classify(cpp)[0] == "parameter .grad (AccumulateGrad)"  # --stacks all: C++ frames only
    assert ma.classify([cpp[0], *LINEAR])[0] == ma.ACTIVATIONS  # C++ frames are skipped, never matched


def test_owner_map_first_class_wins_and_views_share_their_storage():
    t = torch.zeros(1024)
    assert ma.owner_map([("a", {"s": [t[10:]]}), ("b", t), ("c", [None, torch.zeros(0)])], "cpu") == {
        t.untyped_storage().data_ptr(): "a"}
    assert ma.owner_map([("a", t)]) == {}  # host tensors are not the GPU's


def _owners_after_a_step(name: str) -> tuple[list, bool]:
    """On CPU (gloo): build a tiny arm, take a step; the owners' classes, and whether each ZeroQ unit's
    master, gradient shard and working buffer are owned by the kind memory_report counts them as."""
    import argparse

    from step_time import build_arm

    args = argparse.Namespace(vocab=64, dim=32, layers=2, heads=2, ffn=64, bucket=2e8, batch=2)
    arm = build_arm(name, args, torch.device("cpu"))
    arm.finish(arm.forward(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))))
    owners = ma.arm_owners(arm, "cpu")
    units = arm.engine.parts.units if arm.engine is not None else []
    exact = all(owners[u.master.untyped_storage().data_ptr()] == "masters"
                and not u.has_grad_storage  # the gradient shard is released with the window (held during a step)
                and (not u.persistent or owners[u.flat.untyped_storage().data_ptr()] == "persistent_units") for u in units)
    if arm.engine is not None:
        arm.engine.close()
    return sorted(set(owners.values())), exact


def test_arm_owners_name_what_each_arm_keeps(dist_pool):
    pool = dist_pool(2)
    # ZeroQ's gradient shards exist only within a window: classed at the optimizer step (run_one's hook)
    expected = {"zeroq2": ["masters", "optimizer_state", "persistent_units"],
                "zeroq3": ["masters", "optimizer_state", "persistent_units"],
                "fsdp2": ["masters", "optimizer_state"], "ddp": ["optimizer_state", "parameters"]}
    for name, classes in expected.items():
        assert pool.run(_owners_after_a_step, name) == [(classes, True)] * 2, name


def test_write_snapshot_cuts_the_trace_to_fit(tmp_path):
    snap = synthetic()
    path = tmp_path / "s.pickle.gz"
    assert ma.write_snapshot(snap, 0, 7, 15, str(path), 1 << 20) == 7
    saved = pickle.loads(gzip.decompress(path.read_bytes()))
    assert saved["device_traces"] == [snap["device_traces"][0][7:], []] and len(saved["segments"]) == 1
    big = {**snap, "device_traces": [[alloc(i, 8, [frame(f"/f{i}.py", f"n{i}")]) for i in range(20000)]]}
    size = len(gzip.compress(pickle.dumps(big), 6))
    first = ma.write_snapshot(big, 0, 0, 19000, str(path), size // 3)
    assert 0 < first <= 19000 and path.stat().st_size <= size // 3
    assert ma.write_snapshot(big, 0, 0, 10, str(tmp_path / "none.gz"), 100) is None


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_account.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_script_parses_its_arguments_and_needs_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:  # the parser and the arms, in this process
        ma.main(["--help"])
    assert done.value.code == 0 and "--snapshot-mib" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown arm 'zeroq9'"):
        ma.main(["--arms", "zeroq9"])
    out = _script("--arms", "zeroq2,zeroq3+keep,fsdp2,ds2", "--out", str(tmp_path / "m"))  # as a script, no GPU
    assert out.returncode != 0 and "needs CUDA" in out.stderr and not (tmp_path / "m").exists()


def _run_one_with_a_faked_allocator(out: str) -> tuple:
    """run_one and report on CPU for a tiny zeroq3, every torch.cuda call faked, the snapshot synthetic."""
    import argparse
    import contextlib
    import io
    from unittest import mock

    snap = synthetic()
    here = f"{REPO}/benchmarks/memory_account.py"
    snap["device_traces"][0][15:15] = [alloc(M + 16, 8, [frame(here, "_mark_optimizer_step")]), *free(M + 16, 8)]
    snap["device_traces"][0][12:12] = [alloc(M + 8, 8, [frame(here, "_mark_measured")]), *free(M + 8, 8)]
    fakes = {"memory._record_memory_history": None, "memory._snapshot": snap, "synchronize": None,
             "reset_peak_memory_stats": None, "max_memory_allocated": 2560, "max_memory_reserved": 3 << 20, "empty_cache": None}
    args = argparse.Namespace(vocab=64, dim=32, layers=2, heads=2, ffn=64, bucket=2e8, batch=2, seq=8, warmup=1, steps=1,
                              stacks="python", max_entries=1000, out=out, snapshot_ranks="0", snapshot_mib=1.0)
    with contextlib.ExitStack() as stack:
        for name, value in fakes.items():
            stack.enter_context(mock.patch(f"torch.cuda.{name}", return_value=value))
        r = ma.run_one("zeroq3", args, torch.device("cpu"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = ma.report("zeroq3", r, [(r["steps"]["peak_bytes"], *r["allocator"])] * 2)
    return summary, printed.getvalue(), r["step"]["start"]


def test_run_one_and_report_end_to_end_with_a_faked_allocator(dist_pool, tmp_path):
    (summary, printed, measured_start), _ = dist_pool(2).run(_run_one_with_a_faked_allocator, str(tmp_path))
    assert measured_start == 12 and set(summary["classes_GiB"]) == {"masters", ma.NO_FRAME, ma.ACTIVATIONS, ma.BEFORE,
                                                                     "optimizer_state"}
    assert {ma.ACTIVATIONS, ma.GATHERED, "masters", "persistent_units"} <= set(summary["formula_GiB"]) and "bound_GiB" in summary
    assert "total (formula: memory_bound + activations)" in printed and "top frames" in printed, printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zeroq3_rank0.pickle.gz", "zeroq3_rank0_peak.json.gz",
                                                          "zeroq3_rank1_peak.json.gz"]
    peak = json.loads(gzip.decompress((tmp_path / "zeroq3_rank1_peak.json.gz").read_bytes()))
    assert peak["steps_peak"]["classes"] == {"masters": 1000, ma.NO_FRAME: 700, ma.ACTIVATIONS: 300, ma.BEFORE: 100,
                                             "optimizer_state": 50}
    assert (peak["measured_step_peak"]["index"], peak["allocator"]) == (21, [2560, 3 << 20])
    assert peak["steps_peak"]["moments"] == {"_mark_optimizer_step": 18}  # the hook fired in the measured step
