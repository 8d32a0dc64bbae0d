"""The plan before launch (``planning/estimate.py``, ``zeroq-plan``) against the engine it predicts: the
device bytes by kind are what the engine's ``memory_report`` holds after a step, at world sizes 1 and
2, in stages 1-3; the host bytes are what the engine's host check counts, in every offload mode; the
activations traced on the meta device are what a real forward saves with the same kernels. The
command plans a 70B model on this CPU machine within its time, and says when nothing fits."""

from __future__ import annotations

import json
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

from lightning_zeroq import ZeroConfig, ZeroEngine
from lightning_zeroq.cli import plan as plan_cli
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel
from lightning_zeroq.planning.estimate import Machine, _cuda_kernels, estimate_config, estimate_training, trace_activations

CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=3, n_head=2, n_embd=32, ffn_hidden=80, norm="rmsnorm",
                mlp="swiglu", bias=False, learned_positions=False, tie_embeddings=False, init="torch")
CONFIGS = {
    "s1": dict(stage=1, reduce_bucket_size=3000),
    "s2": dict(stage=2, reduce_bucket_size=3000),
    "s3": dict(stage=3, stage3_param_persistence_threshold=40),
    "s2_half": dict(stage=2, reduce_bucket_size=3000, offload_optimizer=True, offload_optimizer_ratio=0.5),
    "s3_half": dict(stage=3, stage3_param_persistence_threshold=40, offload_optimizer=True, offload_optimizer_ratio=0.5),
    "s2_cpu": dict(stage=2, reduce_bucket_size=3000, offload_optimizer=True),
    "s3_params": dict(stage=3, stage3_param_persistence_threshold=40, offload_optimizer=True, offload_parameters=True),
    "s3_nvme_spill": dict(stage=3, stage3_param_persistence_threshold=40, offload_optimizer=True,
                          offload_optimizer_device="nvme", offload_optimizer_nvme_ratio=0.5),
    # INT8 weights (the stored payload: INT8 groups and their scales) and hybrid sharding (shards within
    # groups of shard_group_size ranks; with INT8 gradients, shards aligned to whole groups per group)
    "s3_int8": dict(stage=3, stage3_param_persistence_threshold=40, quantized_weights=True),
    "s2_hybrid": dict(stage=2, reduce_bucket_size=3000, shard_group_size=1),
    "s3_hybrid_int8": dict(stage=3, stage3_param_persistence_threshold=40, shard_group_size=1, quantized_weights=True,
                           quantized_gradients=True),
    "s3_params_int8": dict(stage=3, stage3_param_persistence_threshold=40, offload_optimizer=True,
                           offload_parameters=True, quantized_weights=True),
    "s3_hybrid_half": dict(stage=3, stage3_param_persistence_threshold=40, shard_group_size=1, offload_optimizer=True,
                           offload_optimizer_ratio=0.5),
}
ON_DEVICE = ("s1", "s2", "s3", "s3_int8", "s2_hybrid", "s3_hybrid_int8")  # on CPU the "device" is the host:
# device kinds compare without offload
TOKENS = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(0))


def _forward(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    tokens = tokens.to(next(model.parameters()).device)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def _meta_model() -> GPTModel:
    with torch.device("meta"):
        return GPTModel(CFG).to(torch.bfloat16)


def _planned_and_held(name: str, world_size: int) -> tuple[dict, dict, dict, dict]:
    import torch.distributed as dist

    fields = dict(CONFIGS[name])
    if "nvme" in name:
        fields["nvme_path"] = tempfile.gettempdir()
    config = ZeroConfig(**fields)
    meta = _meta_model()
    activations = trace_activations(meta, _forward, list(meta.blocks))
    rank = dist.get_rank() if dist.is_initialized() else 0
    need = estimate_config(meta, config, activations, name=name, world_size=world_size, rank=rank)
    torch.manual_seed(0)
    model = GPTModel(CFG).to(torch.bfloat16)
    engine = ZeroEngine(model, config, param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.backward(_forward(model))
    engine.step()
    held = engine.memory_report()
    steps = [s["step"] for s in engine.optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)]
    held["optimizer_state"] -= sum(t.numel() * t.element_size() for t in steps)  # CPU scalars on a GPU
    held["gathered_units"] = 2 * held.pop("largest_transient_unit")
    held.pop("gradient_shards")  # made at finalize, dropped after the step
    counted = dict(engine.parts.host_memory.need.parts)
    engine.close()
    assert set(held) <= set(need.device), (held, need.device)
    planned = {k: need.device[k] for k in held}  # the engine's kinds (the plan adds activations and the like)
    return planned, held, dict(need.host), counted


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", ON_DEVICE)
def test_planned_device_bytes_are_what_the_engine_holds(dist_pool, name, world_size):
    for planned, held, _, _ in dist_pool(world_size).run(_planned_and_held, name, world_size):
        assert planned == held, (planned, held)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in ON_DEVICE])
def test_planned_host_bytes_are_what_the_engine_counts(dist_pool, name):
    for _, _, planned, counted in dist_pool(2).run(_planned_and_held, name, 2):
        assert planned == counted, (planned, counted)


def test_activations_traced_on_meta_are_what_a_real_forward_saves():
    meta = _meta_model()
    traced = trace_activations(meta, _forward, list(meta.blocks))
    torch.manual_seed(0)
    real = GPTModel(CFG).to(torch.bfloat16)
    parameters = {p.untyped_storage().data_ptr() for p in real.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with _cuda_kernels(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward(real)
    assert traced.total == sum(saved.values()) > 0
    assert 0 < traced.block_inputs < traced.in_blocks < traced.total
    assert traced.with_checkpointing() < traced.total


def test_the_planned_rms_norm_saves_what_cudas_fused_kernel_saves():
    """CUDA's RMSNorm is one kernel (``aten::_fused_rms_norm``) that scales by the weight too; its backward
    keeps the input and an fp32 statistic per row (and the weight, a parameter). Decomposed, as on the CPU
    and the meta device, it would also save the normalized input before the weight's product: one more
    activation-sized tensor per norm, 1.3 GiB over a 3.4B model's 57 norms at 4K tokens."""
    rows, width = 24, 32
    norm = torch.nn.RMSNorm(width, device="meta", dtype=torch.bfloat16)
    x = torch.empty(rows, width, device="meta", dtype=torch.bfloat16, requires_grad=True)
    traced = trace_activations(norm, lambda m: m(x.clone()).sum(), [])
    assert traced.total == rows * width * 2 + rows * 4, traced.total


@pytest.mark.parametrize("block", [dict(norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False),
                                   dict(norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)],
                         ids=["llama_like", "gpt2_like"])
def test_the_loss_backward_peak_is_every_activation_and_two_loss_gradients(block):
    """The allocator's peak over a real forward and backward (the CPU's, through the profiler's memory
    timeline; attention and RMSNorm as their CUDA kernels save) is the plan's moment of the loss's
    backward: every activation, and the log-softmax's incoming and outgoing gradients beside its saved
    output. Counting one gradient only, the plan was 47% short here (and 1 GiB at 953M)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    cfg = GPTConfig(vocab_size=2048, block_size=64, n_layer=2, n_head=2, n_embd=16, ffn_hidden=32,
                    learned_positions=False, init="torch", **block)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        meta = GPTModel(cfg).to(torch.bfloat16)
    need = estimate_config(meta, ZeroConfig(stage=1), trace_activations(meta, lambda m: _forward(m, tokens), list(meta.blocks)),
                       name="s1")
    planned = need.device["activations"] + need.device["loss_gradients"]
    real = GPTModel(cfg).to(torch.bfloat16)
    with _cuda_kernels(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                  with_stack=True) as prof:
        _forward(real, tokens).backward()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    assert planned == pytest.approx(peak, rel=0.01), (planned, peak)


def test_the_planned_step_temporaries_are_what_foreach_adamw_makes():
    """The step's peak counts 4 bytes per element stepped on the device: the square roots torch's
    multi-tensor AdamW (its default on a GPU) makes of every second moment at once. Counted here from
    the tensors the step's out-of-place foreach ops return, so a torch that changes its AdamW fails it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name.startswith("_foreach_") and not name.endswith("_"):
                Made.nbytes += sum(t.numel() * t.element_size() for t in out)
            return out

    config = ZeroConfig(**CONFIGS["s2"])
    meta = _meta_model()
    need = estimate_config(meta, config, trace_activations(meta, _forward, list(meta.blocks)), name="s2")
    torch.manual_seed(0)
    model = GPTModel(CFG).to(torch.bfloat16)
    engine = ZeroEngine(model, config, param_dtype=torch.bfloat16)
    engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    engine.backward(_forward(model))
    with Made():
        engine.step()
    engine.close()
    # the plan counts the shards with their alignment padding (an upper bound), torch the parameters
    assert need.device["step_temporaries"] == need.device["masters"] > 0
    assert 0.99 * need.device["step_temporaries"] <= Made.nbytes <= need.device["step_temporaries"], Made.nbytes


def test_the_plan_ranks_what_fits_first_and_names_what_does_not():
    meta = _meta_model()
    machine = Machine(device_bytes=200_000, host_bytes=10**9, nvme_bytes=10**9, reserved_overhead_bytes=0,
                      device_workspace_bytes=0)
    needs = estimate_training(meta, _forward, tokens=TOKENS.numel(), machine=machine, nvme_path="/unused")
    fits = [n for n in needs if n.fits]
    assert fits and fits != needs and needs[: len(fits)] == fits
    assert [n.step_s for n in fits] == sorted(n.step_s for n in fits)
    assert all(n.device_total * 1.2 <= n.reserved + 1 <= machine.device_bytes + 1 for n in fits)
    assert all("device" in n.why and n.reserved > machine.device_bytes for n in needs if not n.fits)
    with pytest.raises(ValueError, match="meta device"):
        estimate_training(GPTModel(CFG), _forward, tokens=1)


def test_zeroq_plan_plans_a_70b_model_on_this_machine_in_time(capsys):
    # CPU seconds of this process, not wall-clock ones: the time other processes take the cores is not the plan's.
    start = time.process_time()
    code = plan_cli.main(["--dim", "8192", "--layers", "80", "--heads", "64", "--ffn", "28672", "--batch", "1",
                          "--seq", "4096", "--world-size", "8", "--ranks-per-node", "8", "--device-gib", "139",
                          "--host-gib", "1000"])
    took = time.process_time() - start
    out = capsys.readouterr().out
    assert code == 0 and "78.37B parameters" in out and "fastest that fits: " in out, out
    assert took < 60, took


def test_zeroq_plan_says_when_nothing_fits_and_refuses_bad_flags(capsys):
    assert plan_cli.main(["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--device-gib", "0.0001",
                          "--host-gib", "0.0001"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_cli.main(["--dim", "0"])
    assert "--dim=0: give a whole number" in capsys.readouterr().err
    for flags, said in ((["--block-ms", "2"], "--block-ms 2: give two numbers"),
                        (["--block-ms", "3,1"], "at most forward+backward"),
                        (["--device-tbs", "0"], "--device-tbs=0.0: give a rate above 0"),
                        (["--runtime-host-gib", "-1"], "--runtime-host-gib=-1.0: give GiB, 0 or more")):
        with pytest.raises(SystemExit):
            plan_cli.main(["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", *flags])
        assert said in capsys.readouterr().err, flags
    with pytest.raises(SystemExit):
        plan_cli.main(["--host-gib", "-1"])
    assert "--host-gib=-1.0: give the memory in GiB" in capsys.readouterr().err
    for flags, said in ((["--world-size", "4", "--shard-group-size", "3"], "does not divide the world size 4"),
                        (["--shard-group-size", "x"], "--shard-group-size x: give a number of ranks or 'node'")):
        with pytest.raises(SystemExit):
            plan_cli.main(["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", *flags])
        assert said in capsys.readouterr().err, flags


def test_zeroq_plan_lays_out_hybrid_groups_and_int8_weights_as_the_engine(tmp_path):
    """``--shard-group-size`` and ``--quantized-weights`` apply to every candidate: at 4 ranks in groups of
    2 each rank holds twice the shard of 4-way sharding; INT8 weights rest about half of stage 3's bf16
    payload on the host (the kinds themselves are checked against the engine above)."""
    shape = ["--dim", "1024", "--layers", "4", "--heads", "8", "--ffn", "2048", "--world-size", "4", "--device-gib", "80",
             "--host-gib", "80", "--runtime-host-gib", "0"]

    def rows(*flags: str) -> dict:
        out = tmp_path / "rows.jsonl"
        assert plan_cli.main([*shape, *flags, "--json", str(out)]) == 0
        return {r["configuration"]: r for r in map(json.loads, out.read_text().splitlines())}

    plain, grouped, int8 = rows(), rows("--shard-group-size", "2"), rows("--quantized-weights")
    name = "zeroq3+params_optimizer_cpu"
    assert grouped[name]["predicted_host_GiB"] == pytest.approx(2 * plain[name]["predicted_host_GiB"], rel=0.05)
    assert 0 < int8[name]["predicted_host_GiB"] < plain[name]["predicted_host_GiB"]


def test_zeroq_plan_plans_a_recipe_with_overrides_and_names_a_missing_one(capsys):
    assert plan_cli.main(["--recipe", "gpt1m_zero3_offload_cpu", "model.n_layer=8", "--host-gib", "8"]) == 0
    out = capsys.readouterr().out
    assert "16 x 128 tokens per micro-batch and rank, world size 2" in out and "fp32 weights" in out, out
    assert "| recipe gpt1m_zero3_offload_cpu |" in out and "| recipe gpt1m_zero3_offload_cpu+checkpointing |" in out
    with pytest.raises(SystemExit):
        plan_cli.main(["--recipe", "no_such_recipe"])
    assert "--recipe no_such_recipe: no such recipe; the recipes are gpt1m_" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["model.n_layer=8"])
    assert "overrides need --recipe NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main(["--recipe", "gpt1m_zero2_cpu", "model.n_layer=0"])
    assert "--recipe gpt1m_zero2_cpu: " in capsys.readouterr().err


def test_zeroq_plan_plans_a_fine_tuning_recipe_as_the_lora_model_it_trains(capsys):
    assert plan_cli.main(["--recipe", "gpt1m_lora_zero3_offload_cpu", "model.n_embd=1024", "model.n_layer=8",
                          "--host-gib", "8"]) == 0
    out = capsys.readouterr().out
    assert "% frozen: stage 3 shards them" in out, out  # the LoRA model: everything but the factors frozen
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "zeroq3+params_optimizer_cpu+frozen_int8" in rows and "zeroq3+frozen_int8" in rows, sorted(rows)
    host = {name: float(line.split("|")[5]) for name, line in rows.items() if name.startswith("zeroq3+params")}
    # INT8 storage of the frozen base (100M fp32 elements, half per rank) holds about a quarter of its host bytes
    assert 0 < host["zeroq3+params_optimizer_cpu+frozen_int8"] < 0.4 * host["zeroq3+params_optimizer_cpu"], host


def test_zeroq_plan_measures_what_it_planned_and_reports_a_failed_run(capsys, tmp_path):
    """``--measure``: each chosen configuration trains in a process of its own; the rows carry the measured
    step and host memory beside the plan's, and a configuration that cannot run names its error."""
    import json

    out = tmp_path / "rows.jsonl"
    shape = ["--dim", "64", "--layers", "2", "--heads", "2", "--ffn", "128", "--vocab", "256", "--batch", "2",
             "--seq", "16", "--steps", "1", "--warmup", "1", "--json", str(out)]
    only = "zeroq3+params_optimizer_cpu+checkpointing"  # one process per configuration: one suffices here
    assert plan_cli.main([*shape, "--measure", "--only", only]) == 0
    rows = {row["configuration"]: row for row in map(json.loads, out.read_text().splitlines())}
    for name in only.split(","):
        row = rows[name]
        assert row["measured_step_s"] > 0 and row["measured_host_GiB"] >= 0, row
        assert row["predicted_host_GiB"] >= 0 and "error" not in row, row
    assert all("measured_step_s" not in row for name, row in rows.items() if name not in only.split(","))
    printed = capsys.readouterr().out
    assert "| zeroq3+params_optimizer_cpu+checkpointing | " in printed and "measured on this machine" in printed
    with pytest.raises(SystemExit):
        plan_cli.main([*shape, "--measure", "--only", "zeroq9"])
    assert "--only zeroq9: no such configuration" in capsys.readouterr().err
    from lightning_zeroq.cli.measure import measure

    failed = measure({"gpt": {"vocab_size": 0}, "config": {}, "checkpointing": False, "batch": 1, "seq": 1,
                      "warmup": 0, "steps": 1})
    assert set(failed) == {"error"} and "\n" not in failed["error"] and failed["error"], failed
    # --calibrate on a GPU measures the runtime's own host memory the same way: a tiny GPT trained in a
    # fresh process, nothing offloaded (here, on the CPU, what such a process holds beyond its start)
    runtime = plan_cli.runtime_host_bytes(timeout=300)
    assert isinstance(runtime, int) and 0 < runtime < 2**30, runtime


@pytest.mark.launch
def test_zeroq_plan_measures_at_two_ranks_with_the_largest_peak_of_any_rank(capsys, tmp_path):
    """``--world-size 2 --measure``: each configuration runs as two processes of this machine (gloo here),
    each rank on its own micro-batch; the row is rank 0's step and the largest peaks of any rank."""
    out = tmp_path / "rows.jsonl"
    shape = ["--dim", "64", "--layers", "2", "--heads", "2", "--ffn", "128", "--vocab", "256", "--batch", "2",
             "--seq", "16", "--steps", "1", "--warmup", "1", "--world-size", "2", "--json", str(out)]
    with pytest.raises(SystemExit):
        plan_cli.main([*shape, "--measure"])
    assert "give --ranks-per-node 2 with --world-size 2" in capsys.readouterr().err
    assert plan_cli.main([*shape, "--ranks-per-node", "2", "--measure", "--only", "zeroq3+optimizer_cpu"]) == 0
    row = next(r for r in map(json.loads, out.read_text().splitlines()) if r["configuration"] == "zeroq3+optimizer_cpu")
    assert row["measured_step_s"] > 0 and row["measured_host_GiB"] >= 0 and "error" not in row, row
    assert "one process per rank, 2 ranks" in capsys.readouterr().out


def test_zeroq_plan_against_stored_measurements_prints_them_beside_the_plan(capsys, tmp_path):
    small = ["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--device-gib", "8", "--host-gib", "4"]
    planned_file = tmp_path / "planned.jsonl"
    assert plan_cli.main([*small, "--json", str(planned_file)]) == 0
    rows = [json.loads(line) for line in planned_file.read_text().splitlines()]
    measured = dict(rows[0], measured_allocated_GiB=rows[0]["predicted_allocated_GiB"] * 2,
                    measured_reserved_GiB=rows[0]["predicted_reserved_GiB"], measured_host_GiB=rows[0]["predicted_host_GiB"],
                    measured_step_s=rows[0]["predicted_step_s"])
    stored = tmp_path / "measured.jsonl"
    stored.write_text(json.dumps(measured) + "\n" + json.dumps(rows[1]) + "\n")  # the second was not measured
    capsys.readouterr()
    assert plan_cli.main([*small, "--against", str(stored)]) == 0
    out = capsys.readouterr().out
    assert f"| {rows[0]['configuration']} | " in out and "(-50%)" in out, out
    assert "within the aim, of 1: allocated (+-5%) 0, reserved (+-10%) 1, host (+-10%) 1, step (+-15%) 1" in out, out
    stored.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(SystemExit):
        plan_cli.main([*small, "--against", str(stored)])
    assert "no measured row in it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main([*small, "--against", str(stored), "--measure"])
    assert "give one of them" in capsys.readouterr().err


def test_zeroq_plan_plans_a_recipe_on_several_nodes_with_node_groups(capsys, tmp_path):
    """A recipe's world is its ranks per node times its nodes, and its ``shard_group_size='node'`` means its
    ranks per node: on 2 nodes of 2 ranks each rank holds the shard of 2, twice that of 4-way sharding."""
    overrides = ["trainer.num_nodes=2", "model.n_embd=1024", "model.n_layer=8", "model.n_head=8"]

    def recipe_row(*extra: str) -> dict:
        out = tmp_path / "rows.jsonl"
        assert plan_cli.main(["--recipe", "gpt1m_zero3_offload_cpu", *overrides, *extra, "--host-gib", "64",
                              "--runtime-host-gib", "0", "--json", str(out)]) == 0
        return next(r for r in map(json.loads, out.read_text().splitlines())
                    if r["configuration"] == "recipe gpt1m_zero3_offload_cpu")

    whole, grouped = recipe_row(), recipe_row("zero.shard_group_size=node")
    assert "world size 4;" in capsys.readouterr().out
    assert whole["predicted_host_GiB"] > 0
    assert grouped["predicted_host_GiB"] == pytest.approx(2 * whole["predicted_host_GiB"], rel=0.05)


OWN_MODELS = '''
import torch, torch.nn.functional as F
import lightning as L
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel

CFG = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=256, norm="rmsnorm", mlp="swiglu",
                bias=False, learned_positions=False, tie_embeddings=False, init="torch")


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = GPTModel(CFG)

    def training_step(self, batch, batch_idx):
        logits = self.net(batch)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.reshape(-1))
        self.log("loss", loss)
        return loss


def sample():
    return torch.randint(0, 512, (4, 128))


def plain():
    return GPTModel(CFG)


def loss_of(model):
    tokens = torch.zeros(4, 128, dtype=torch.long, device="meta")
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def loss_of_16(model):  # 16 x 128 tokens, built on the CPU: the plan moves them to the meta device
    tokens = torch.zeros(16, 128, dtype=torch.long)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def one_block(model):  # feeds no token ids
    return model.blocks[0](torch.zeros(4, 128, 256, device="meta")).float().sum()


def checkpointing():  # checkpoints its own blocks
    from torch.utils.checkpoint import checkpoint

    model = GPTModel(CFG)
    for block in model.blocks:
        block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    return model


def no_parameters():
    return torch.nn.ReLU()


def exits(model):
    import sys

    sys.exit(0)
'''


def test_zeroq_plan_plans_your_own_model_as_it_plans_the_same_gpt(tmp_path, monkeypatch, capsys):
    """``--model MODULE:NAME`` with ``--sample`` (a LightningModule's training_step, ``self.log`` quiet) or
    ``--forward`` (any module's loss): the same network and loss plan as the package's GPT of that shape."""
    (tmp_path / "own_models.py").write_text(OWN_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    machine = ["--device-gib", "8", "--host-gib", "8"]

    def rows(*flags: str) -> dict:
        out = tmp_path / "rows.jsonl"
        assert plan_cli.main([*flags, *machine, "--json", str(out)]) == 0
        return {r["configuration"]: r["predicted_allocated_GiB"] for r in map(json.loads, out.read_text().splitlines())}

    gpt = rows("--dim", "256", "--layers", "4", "--heads", "4", "--ffn", "1024", "--vocab", "512", "--batch", "4",
               "--seq", "128")
    assert rows("--model", "own_models:Lit", "--sample", "own_models:sample") == gpt
    assert "512 tokens per micro-batch" in capsys.readouterr().out  # the sample's token ids
    assert rows("--model", "own_models:plain", "--forward", "own_models:loss_of", "--tokens", "512") == gpt
    for flags, said in ((["--model", "own_models:plain", "--sample", "own_models:sample"], "no training_step"),
                        (["--model", "own_models:plain"], "give --sample"),
                        (["--model", "own_models:nothing", "--forward", "own_models:loss_of"], "--model own_models:nothing"),
                        (["--sample", "own_models:sample"], "go with --model"),
                        (["--model", "own_models:plain", "--forward", "own_models:loss_of", "--tokens", "0"],
                         "--tokens=0: give the tokens per micro-batch")):
        with pytest.raises(SystemExit):
            plan_cli.main([*flags, *machine])
        assert said in capsys.readouterr().err, flags


def _own(tmp_path, monkeypatch) -> None:
    (tmp_path / "own_models.py").write_text(OWN_MODELS)
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))


def _rows(tmp_path, *flags: str) -> dict:
    out = tmp_path / "rows.jsonl"
    assert plan_cli.main([*flags, "--json", str(out)]) == 0
    return {r["configuration"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_zeroq_plan_counts_the_tokens_the_forward_feeds(tmp_path, monkeypatch, capsys):
    """Without ``--tokens`` the step counts the token ids the forward feeds (16 x 128 here, built on the CPU),
    as the package's GPT at that micro-batch; a ``--tokens`` that differs is said; none fed: --tokens asked."""
    _own(tmp_path, monkeypatch)
    machine = ["--device-gib", "8", "--host-gib", "8"]
    gpt = _rows(tmp_path, "--dim", "256", "--layers", "4", "--heads", "4", "--ffn", "1024", "--vocab", "512",
                "--batch", "16", "--seq", "128", *machine)
    capsys.readouterr()
    own = _rows(tmp_path, "--model", "own_models:plain", "--forward", "own_models:loss_of_16", *machine)
    out = capsys.readouterr().out
    assert "2,048 tokens per micro-batch" in out and "note:" not in out, out
    assert {k: (r["predicted_step_s"], r["predicted_allocated_GiB"]) for k, r in own.items()} == \
        {k: (r["predicted_step_s"], r["predicted_allocated_GiB"]) for k, r in gpt.items()}
    _rows(tmp_path, "--model", "own_models:plain", "--forward", "own_models:loss_of_16", "--tokens", "512", *machine)
    assert "note: --tokens 512 counts the step time, and the forward feeds 2,048 token ids" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(["--model", "own_models:plain", "--forward", "own_models:one_block", *machine])
    assert stop.value.code == 2
    assert ("--forward own_models:one_block: the forward calls no module with an integer tensor (token ids) to count "
            "the tokens from; give --tokens") in capsys.readouterr().err
    assert _rows(tmp_path, "--model", "own_models:plain", "--forward", "own_models:one_block", "--tokens", "512",
                 *machine)


def test_zeroq_plan_adds_no_checkpointing_rows_to_a_model_that_checkpoints_its_blocks(tmp_path, monkeypatch, capsys):
    _own(tmp_path, monkeypatch)
    machine = ["--device-gib", "8", "--host-gib", "8"]
    plain = _rows(tmp_path, "--model", "own_models:plain", "--forward", "own_models:loss_of", *machine)
    capsys.readouterr()
    own = _rows(tmp_path, "--model", "own_models:checkpointing", "--forward", "own_models:loss_of", *machine)
    assert "the model recomputes its Block blocks itself" in capsys.readouterr().out
    assert set(own) == {name for name in plain if not name.endswith("+checkpointing")}
    # what it saves is what the planner's checkpointing of every block plans, not more
    for name, row in own.items():
        assert row["predicted_allocated_GiB"] <= plain[name + "+checkpointing"]["predicted_allocated_GiB"], name


@pytest.mark.parametrize("flags, said", [
    (["--dim", "2000000000"], ("--dim 2000000000 --layers 2 --heads 2 --ffn 128 --vocab 32000 --batch 4 --seq 1024: "
                               "building the model on the meta device failed: RuntimeError: Storage size calculation "
                               "overflowed")),
    (["--device-gib", "inf"], "--device-gib=inf: give the memory in GiB, above 0 and finite"),
    (["--host-gib", "nan"], "--host-gib=nan: give the memory in GiB, above 0 and finite"),
    (["--tflops", "inf"], "--tflops=inf: give a rate above 0"),
    (["--nvme-path", "no/such/directory"], "--nvme-path no/such/directory: no such directory"),
    (["--world-size", "2", "--ranks-per-node", "8"], "--ranks-per-node 8 is more than --world-size 2"),
    (["--model", "own_models:no_parameters", "--forward", "own_models:loss_of"],
     "--model own_models:no_parameters: the model has no parameters"),
    (["--model", "../../etc/passwd:x", "--forward", "own_models:loss_of"],
     "--model ../../etc/passwd:x: give MODULE:NAME, a module importable from here by its dotted name (not a path)"),
    (["--model", "exits_on_import:x", "--forward", "own_models:loss_of"],
     "--model exits_on_import:x: importing exits_on_import called sys.exit(0)"),
    (["--model", "own_models:plain", "--forward", "own_models:exits"],
     "--forward own_models:exits: the forward called sys.exit(0)"),
    (["--model", "own_models:plain", "--forward", "own_models:missing"],
     "--forward own_models:missing: module 'own_models' has no attribute 'missing'"),
    (["--precision", "8-mixed"], "argument --precision: invalid choice: '8-mixed'"),
    (["--recipe", "gpt1m_zero2_cpu", "--precision", "32-true"], "--precision 32-true: a recipe plans its own"),
])
def test_zeroq_plan_refuses_a_bad_value_in_one_line_naming_it(tmp_path, monkeypatch, capsys, flags, said):
    _own(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--host-gib", "8", *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("zeroq-plan: error:")]) == 1, err


def test_zeroq_plan_plans_inputs_built_off_the_meta_device_as_on_it(tmp_path, monkeypatch):
    _own(tmp_path, monkeypatch)
    machine = ["--device-gib", "8", "--host-gib", "8", "--tokens", "512"]
    on_meta = _rows(tmp_path, "--model", "own_models:plain", "--forward", "own_models:loss_of", *machine)
    (tmp_path / "own_models.py").write_text(OWN_MODELS.replace('device="meta"', 'device="cpu"'))
    import importlib
    import sys

    importlib.reload(sys.modules["own_models"])
    assert _rows(tmp_path, "--model", "own_models:plain", "--forward", "own_models:loss_of", *machine) == on_meta


def test_zeroq_plan_says_the_device_was_not_checked_without_a_gpu_or_device_gib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape = ["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--batch", "1000000000", "--host-gib",
             "100000000000"]
    rows = _rows(tmp_path, *shape)
    out = capsys.readouterr().out
    assert "| yes |" not in out and "| unchecked (device) |" in out, out
    assert "the device's memory was not checked (no GPU here and no --device-gib)" in out
    assert "pass --device-gib to check the device too" in out and "fastest, the device unchecked: " in out
    assert not any(r["device_checked"] for r in rows.values())
    assert plan_cli.main([*shape, "--device-gib", "80"]) == 1  # checked: a billion sequences fit no device
    out = capsys.readouterr().out
    assert "nothing fits" in out and "unchecked" not in out, out


def test_zeroq_plan_calibrates_only_the_host_without_a_gpu(tmp_path, monkeypatch, capsys, caplog):
    import logging

    from lightning_zeroq.planning import calibrate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calibrate, "host_step_rate", lambda: 1.5e9)  # the host step, measured here (quickly)
    monkeypatch.setattr(logging.getLogger("lightning_zeroq"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="lightning_zeroq"):
        rows = _rows(tmp_path, "--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--host-gib", "8",
                     "--calibrate")
    said = [r.getMessage() for r in caplog.records if "calibrated here" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("calibrated here (no GPU, so the host only): host step 1.50e9 "
                                                 "elements/s; the device's rates are the given ones, not measured"), said
    assert all(r["predicted_step_s"] > 0 for r in rows.values())
    assert "0.000 |" not in capsys.readouterr().out


def test_zeroq_plan_plans_the_precision_given(tmp_path, capsys):
    shape = ["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--device-gib", "8", "--host-gib", "8"]
    bf16, fp32 = _rows(tmp_path, *shape), _rows(tmp_path, *shape, "--precision", "32-true")
    out = capsys.readouterr().out
    assert "per rank, bf16-mixed (bf16 weights)" in out and "per rank, 32-true (fp32 weights)" in out, out
    assert _rows(tmp_path, *shape, "--precision", "bf16-mixed") == bf16
    # fp32 working weights: stage 1's full copy of them is twice bf16's
    assert fp32["zeroq1"]["predicted_allocated_GiB"] > bf16["zeroq1"]["predicted_allocated_GiB"]


def test_zeroq_plan_prints_the_strategy_arguments_of_its_rows(tmp_path, capsys):
    shape = ["--layers", "2", "--dim", "64", "--heads", "2", "--ffn", "128", "--device-gib", "8", "--host-gib", "8"]
    rows = _rows(tmp_path, *shape, "--precision", "16-mixed", "--show-args")
    out = capsys.readouterr().out
    best = out.split("fastest that fits: ")[1].split(" ")[0]
    assert best in rows
    assert "  as Trainer(strategy=ZeroQStrategy(stage=" in out and "precision='16-mixed')" in out, out
    assert ("  zeroq3+params_optimizer_cpu+checkpointing: Trainer(strategy=ZeroQStrategy(stage=3, "
            "offload_optimizer=True, offload_parameters=True, activation_checkpointing_policy=['Block']), "
            "precision='16-mixed')") in out, out
    assert ("  zeroq2+optimizer_half_cpu: Trainer(strategy=ZeroQStrategy(stage=2, offload_optimizer=True, "
            "offload_optimizer_ratio=0.5), precision='16-mixed')") in out, out
    assert sum(line.startswith("  zeroq") for line in out.splitlines()) == len(rows)
