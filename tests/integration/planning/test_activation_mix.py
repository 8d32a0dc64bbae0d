"""The plan of activation offload (``planning/estimate.py``, ``planning/choose.py``, ``zeroq-plan``): the bytes
it plans to send to the host are what the engine sends; which blocks a mix offloads and recomputes; copies cost
only the time they take beyond the compute they overlap; ``activation_offloading_policy="auto"`` with
``activation_checkpointing_policy="auto"`` chooses a mix under a budget, written as the config the engine
builds with; ``zeroq-plan`` prints the fastest mix of a configuration that fits with its arguments; and the
check before launch stops offloaded activations the host cannot hold, in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zeroq import ZeroConfig, ZeroEngine, choose
from lightning_zeroq.cli.gpt import GPTConfig, GPTModel
from lightning_zeroq.planning.choose import check_fits
from lightning_zeroq.planning.estimate import Activations, Machine, _cuda_kernels, estimate_config, trace_activations
from lightning_zeroq.zero.memory.host import activations_host_bytes
from lightning_zeroq.zero.policies import activation_mix
from lightning_zeroq.zero.unit_plan import repeated_blocks

CFG = GPTConfig(vocab_size=96, block_size=64, n_layer=8, n_head=2, n_embd=64, ffn_hidden=160, norm="rmsnorm",
                mlp="swiglu", bias=False, learned_positions=False, tie_embeddings=False, init="torch")
TOKENS = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=torch.Generator().manual_seed(0))
# rates to plan with (no GPU to measure them): a block's forward 1 ms, forward and backward 3 ms
MACHINE = Machine(device_workspace_bytes=0, pcie_bytes_per_s=3e9, block_seconds=(1e-3, 3e-3), matmul_flops=1e12)


def _forward(model: torch.nn.Module) -> torch.Tensor:
    tokens = TOKENS.to(next(model.parameters()).device)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def _meta(dtype: torch.dtype = torch.float32) -> GPTModel:
    with torch.device("meta"):
        return GPTModel(CFG).to(dtype)


def test_the_mix_spreads_the_offloaded_blocks_and_recomputes_the_first_of_the_rest():
    assert activation_mix(16, 0.25, 0.5) == ([0, 4, 8, 12], [1, 2, 3, 5, 6, 7, 9, 10])
    assert activation_mix(8, 0.375, 0.0) == ([0, 2, 5], [])
    assert activation_mix(4, 0.0, 1.0) == ([], [0, 1, 2, 3]) and activation_mix(4, 1.0, 0.0) == ([0, 1, 2, 3], [])
    a = Activations(total=1000, in_blocks=800, block_inputs=80, largest_block=100, blocks=8)
    assert a.mixed(0.5) == (a.with_checkpointing(0.5), 0, 0)
    # 2 blocks offloaded (200 moved), 4 recompute (each keeps its input, 10), one block in flight
    assert a.mixed(0.5, 0.25) == (1000 - 4 * 90 - 200, 200, 100)
    assert a.mixed(0.5, 0.25, inputs_on_host=True) == (1000 - 4 * 90 - 240, 240, 100)
    assert a.mixed(1.0, 0.0, inputs_on_host=True) == (1000 - 8 * 90 - 80, 80, 10)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_bytes_planned_to_the_host_are_what_the_engine_sends(stage):
    """Every block offloaded, with the CUDA kernels' saved tensors: the engine copies out exactly what the plan
    traced inside the blocks, into host buffers within the plan's 1/8."""
    meta = _meta()
    traced = trace_activations(meta, _forward, repeated_blocks(meta))
    torch.manual_seed(0)
    model = GPTModel(CFG)
    engine = ZeroEngine(model, ZeroConfig(stage=stage, activation_offloading_policy=["Block"],
                                          activation_offloading_min_bytes=0,
                                          **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})))
    with _cuda_kernels():
        loss = _forward(model)
    offload = engine.parts.activations
    moved = sum(s.nbytes for e in offload._sequence for s in e.group.stored if s.host is not None)
    need = estimate_config(meta, engine.config, traced, name="all", offloading=1.0, machine=MACHINE,
                           param_dtype=torch.float32, world_size=1, tokens=TOKENS.numel())
    assert moved == traced.in_blocks == traced.mixed(0.0, 1.0)[1]
    assert traced.in_blocks <= offload.pool.held <= need.host["offloaded activations"] == activations_host_bytes(moved)
    loss.backward()
    engine.close()


def test_copies_cost_only_what_they_take_beyond_the_compute_they_overlap():
    meta = _meta(torch.bfloat16)
    traced = trace_activations(meta, _forward, repeated_blocks(meta))
    config = ZeroConfig(stage=2)

    def step(offload: float, pcie: float, recompute: float = 0.0) -> float:
        machine = Machine(device_workspace_bytes=0, pcie_bytes_per_s=pcie, block_seconds=(1e-3, 3e-3))
        return estimate_config(meta, config, traced, name="x", tokens=TOKENS.numel(), machine=machine,
                               offloading=offload, checkpointing=recompute).step_s

    plain = step(0.0, 1e9)
    assert step(1.0, 1e12) == plain  # fast copies hide behind the compute
    # Slow copies outlast forward and backward: each way costs what it takes beyond them, so halving the rate
    # adds the copies' time once more each way.
    moved = traced.in_blocks
    assert step(1.0, 1e6) - step(1.0, 2e6) == pytest.approx(2 * moved * (1 / 1e6 - 1 / 2e6))
    assert step(1.0, 1e6) > step(0.0, 1e6, recompute=1.0) > plain  # slower than recomputing every block


def test_auto_chooses_a_mix_under_a_budget_and_the_engine_builds_it():
    """Between the peaks of keeping every block and of recomputing every one, with copies fast enough to hide
    behind a few blocks' compute: some blocks offload (spread, by name); a tighter budget moves more blocks
    off; a budget that holds everything offloads nothing."""

    def chosen(budget: float):
        torch.manual_seed(0)
        model = GPTModel(CFG)
        config = ZeroConfig(stage=2, activation_checkpointing_policy="auto", activation_offloading_policy="auto",
                            offload_memory_budget=budget)
        return model, choose(model, config, lambda m: _forward_meta(m), machine=MACHINE)

    model, roomy = chosen(1.0)
    assert roomy.config.activation_offloading_policy is None and not roomy.recompute
    model, mixed = chosen(0.014)
    offloaded = mixed.config.activation_offloading_policy
    assert offloaded and all(name.startswith("blocks.") for name in offloaded) and len(offloaded) < CFG.n_layer
    assert mixed.need is not None and mixed.need.host["offloaded activations"] > 0
    engine = ZeroEngine(model, mixed.config)  # the config as written builds: the blocks named exist
    assert [m for m in engine.parts.activations.modules] == [dict(model.named_modules())[n] for n in offloaded]
    engine.close()
    _, tight = chosen(0.0095)
    assert len(tight.config.activation_offloading_policy or ()) + len(tight.recompute) > len(offloaded)


def _forward_meta(model: torch.nn.Module) -> torch.Tensor:
    logits = model(TOKENS.to("meta"))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), TOKENS.to("meta").reshape(-1))


def test_zeroq_plan_prints_the_fastest_mix_that_fits_with_its_arguments(capsys):
    from lightning_zeroq.cli import plan as plan_cli

    rc = plan_cli.main(["--dim", "2048", "--layers", "16", "--heads", "16", "--ffn", "5632", "--batch", "4",
                        "--seq", "4096", "--device-gib", "30", "--host-gib", "500", "--pcie-gbs", "50",
                        "--block-ms", "5,15", "--show-args"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("| zeroq3+offload")]
    assert rows, out
    name = rows[0].split(" | ")[0].strip("| ")
    args = next(line for line in out.splitlines() if line.strip().startswith(name + ":"))
    assert "activation_offloading_policy=['blocks." in args
    plain = next(line for line in out.splitlines() if line.startswith("| zeroq3+checkpointing |"))
    seconds = lambda row: float(row.split(" | ")[6])  # noqa: E731
    assert seconds(rows[0]) < seconds(plain)  # faster than recomputing every block, where both fit


def test_the_check_before_launch_stops_offloaded_activations_the_host_cannot_hold():
    torch.manual_seed(0)
    model = GPTModel(CFG)
    config = ZeroConfig(stage=2, activation_offloading_policy=["Block"], host_memory_budget="1MiB")
    with pytest.raises(ValueError, match=r"needs about .* of host memory on this node \(.* of it offloaded "
                                         r"activations\) and 1\.0 MiB is available; offload the activations of "
                                         r"fewer blocks") as info:
        check_fits(model, config, _forward_meta, device=torch.device("cpu"), param_dtype=torch.float32,
                   device_bytes=1 << 40)
    assert "\n" not in str(info.value)
    check_fits(model, config.replace(host_memory_budget=None), _forward_meta, device=torch.device("cpu"),
               param_dtype=torch.float32, device_bytes=1 << 40)  # the host holds it
