"""DeepSpeed ZeRO checkpoints read without DeepSpeed (``checkpoint/deepspeed.py``), from checkpoints the
real DeepSpeed wrote (``tests/data/deepspeed/make_fixtures.py``; stages 1-3, fp32 and bf16, 2 ranks):
every parameter and Adam moment bitwise what DeepSpeed's own API gave whole at save time; converted by
``zeroq-convert`` into files that a plain model and torch's AdamW load; damaged checkpoints named in one
line, and nothing in them run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zeroq.checkpoint import deepspeed
from lightning_zeroq.cli.convert import main

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "deepspeed"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.pt").is_file())


class Net(nn.Module):  # the model make_fixtures.py trains
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)


def test_the_fixtures_cover_every_stage_and_every_dtype():
    assert {"stage1_fp32", "stage2_bf16", "stage2_fp16", "stage3_bf16", "stage3_fp32", "stage2_bf16_offload",
            "stage3_bf16_offload"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_and_moment_is_bitwise_deepspeeds_own(name):
    reference = torch.load(FIXTURES / name / "reference.pt", weights_only=True)
    state = deepspeed.read(FIXTURES / name)
    ranks = json.loads((FIXTURES / "VERSIONS.json").read_text())["fixtures"][name]["ranks"]
    assert state.stage == int(name[5]) and state.world_size == ranks and state.global_steps == reference["global_steps"] == 3
    assert list(state.params) == [n for n, _ in Net().named_parameters()]
    for n, value in reference["params"].items():
        assert state.params[n].dtype == torch.float32 and torch.equal(state.params[n], value), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state.state[n][key], reference[key][n]), (n, key)
        assert float(state.state[n]["step"]) == 3.0
    assert state.hyperparameters[0]["lr"] == 0.01 and tuple(state.hyperparameters[0]["betas"]) == (0.9, 0.95)


@pytest.mark.parametrize("name", NAMES)
def test_zeroq_convert_writes_what_a_plain_model_and_adamw_load(name, tmp_path):
    reference = torch.load(FIXTURES / name / "reference.pt", weights_only=True)
    assert main([str(FIXTURES / name), str(tmp_path / "model.pt")]) == 0
    model = Net()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert all(torch.equal(p, reference["params"][n]) for n, p in model.named_parameters())
    assert main([str(FIXTURES / name / "global_step3"), str(tmp_path / "full.ckpt"), "--optimizer"]) == 0  # the tag too
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert full["global_step"] == 3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    optimizer.load_state_dict(full["optimizer_states"][0])
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["weight_decay"] == 0.1
    for n, p in model.named_parameters():
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], reference["exp_avg_sq"][n]), n


def test_safetensors_output_holds_the_weights_and_the_state(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file

    reference = torch.load(FIXTURES / "stage3_bf16" / "reference.pt", weights_only=True)
    assert main([str(FIXTURES / "stage3_bf16"), str(tmp_path / "model.safetensors"), "--optimizer"]) == 0
    flat = load_file(str(tmp_path / "model.safetensors"))
    for n, value in reference["params"].items():
        assert torch.equal(flat[n], value) and torch.equal(flat[f"optimizer.state.{n}.exp_avg"], reference["exp_avg"][n])
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        groups = json.loads(f.metadata()["optimizer_param_groups"])
    assert groups[0]["params"] == [n for n, _ in Net().named_parameters()] and groups[0]["lr"] == 0.01


def test_a_missing_rank_or_a_foreign_object_is_one_line_naming_the_file(tmp_path, capsys):
    broken = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2_bf16", broken)
    (broken / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert main([str(broken), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "optimizer state file of rank 0 is missing" in err and str(broken) in err, err
    assert not (tmp_path / "out.pt").exists()

    class Payload:  # a pickled object whose class is no stand-in: refused, never constructed
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"optimizer_state_dict": Payload()}, broken / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert main([str(broken), str(tmp_path / "out.pt")]) == 1
    captured = capsys.readouterr()
    assert "ran" not in captured.out and "cannot be read as a DeepSpeed checkpoint file" in captured.err
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in captured.err


def test_the_fixtures_say_which_deepspeed_wrote_them():
    versions = json.loads((FIXTURES / "VERSIONS.json").read_text())
    assert versions["deepspeed"].startswith("0.")
    assert set(versions["fixtures"]) == set(NAMES)  # each with the torch, accelerator and ranks that wrote it
    assert all(v["torch"] and v["accelerator"] in ("cpu", "cuda") and v["ranks"] >= 1 for v in versions["fixtures"].values())


def _resume_body(ckpt: str, reference_file: str, strategy: str, stage: int, first_step: int = 0
                 ) -> tuple[float, float, list[float], int]:
    """Fit 20 steps from ``ckpt`` (the checkpoint's loops at ``first_step``) (``strategy``: ``zeroq`` at ``stage``, or ``ddp``). Returns, at the
    start of training (before any step), Adam's step count and the largest difference of the weights and
    both moments from those in ``reference_file`` (zeroq only); every step's loss; and the Trainer's
    ``global_step`` at the start (0 from a DeepSpeed checkpoint, which has no Lightning loop state; the
    saved step from a checkpoint Lightning wrote, whose loops resume)."""
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            for name, module in Net().named_children():  # the parameter names DeepSpeed saved
                self.add_module(name, module)

        def training_step(self, batch, batch_idx):
            tokens = batch[0]
            logits = self.head(self.norm(self.blocks(self.embed(tokens))))
            return nn.functional.cross_entropy(logits.reshape(-1, 32), tokens.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1.0)  # the checkpoint's settings replace these

    reference = torch.load(reference_file, weights_only=True)
    seen: list = []
    losses: list[float] = []
    started: list[int] = []

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            assert trainer.optimizers[0].param_groups[0]["lr"] == 0.01
            started.append(trainer.global_step)
            if strategy != "zeroq":
                return
            weights = trainer.strategy.full_state_dict()
            moments = trainer.strategy.engine.full_optimizer_state()
            worst = max(max((weights[n] - v).abs().max().item(), *((moments[n][k] - reference[k][n]).abs().max().item()
                                                                    for k in ("exp_avg", "exp_avg_sq")))
                        for n, v in reference["params"].items())
            seen.append((float(moments["head.weight"]["step"]), worst))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    options = dict(stage3_wrap_classes=["Linear"], stage3_param_persistence_threshold=0) if stage == 3 else {}
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 32, (24 * 3, 8))), batch_size=2)
    trainer = L.Trainer(strategy=ZeroQStrategy(stage=stage, **options) if strategy == "zeroq" else "ddp",
                        accelerator="cpu", devices=dist.get_world_size(), max_steps=first_step + 20, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Check()])
    trainer.fit(Lit(), data, ckpt_path=ckpt)
    step, worst = seen[0] if seen else (3.0, 0.0)
    return step, worst, losses, started[0]


# Each fixture resumed once, the world sizes and stages in turn (the matrix's diagonals): from the file
# zeroq-convert writes, or from DeepSpeed's directory itself.
RESUMES = [("stage1_fp32", 1, 3, "converted"), ("stage2_bf16", 2, 3, "directory"), ("stage3_bf16", 3, 1, "converted"),
           ("stage3_fp32", 3, 2, "directory"), ("stage2_bf16_offload", 3, 2, "converted"),
           ("stage3_bf16_offload", 1, 2, "directory"), ("stage2_fp16", 2, 2, "directory")]


@pytest.mark.parametrize("fixture, world_size, stage, source", RESUMES)
def test_a_deepspeed_checkpoint_resumes_at_any_world_size_and_stage(dist_pool, tmp_path, fixture, world_size, stage,
                                                                    source):
    """Written by DeepSpeed on 2 ranks; resumed by the Trainer with zeroq at 1, 2 or 3 ranks and stages 1-3:
    DeepSpeed's weights and moments bitwise at the start, and 20 steps' losses within 1e-6 relative of DDP
    resumed from the same fp32 state (the file zeroq-convert writes)."""
    import lightning_zeroq.cli.convert as convert

    assert convert.main([str(FIXTURES / fixture), str(tmp_path / "full.ckpt"), "--optimizer"]) == 0
    ckpt = str(tmp_path / "full.ckpt") if source == "converted" else str(FIXTURES / fixture)
    pool = dist_pool(world_size)
    reference = str(FIXTURES / fixture / "reference.pt")
    ours = pool.run(_resume_body, ckpt, reference, "zeroq", stage)
    ddp = pool.run(_resume_body, str(tmp_path / "full.ckpt"), reference, "ddp", 0)
    for (step, worst, losses, started), (_, _, ref, _) in zip(ours, ddp):
        assert step == 3.0 and worst == 0.0 and started == 0
        assert len(losses) == len(ref) == 20
        # 1e-6 relative: the same fp32 arithmetic but the gradients summed across ranks in another order
        # (reduce-scatter against DDP's all-reduce), a few ulps apart per step
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, ref)), (losses, ref)


def _fabric_body(fixture: str) -> float:
    """``fabric.load(<DeepSpeed directory>, {"model", "optimizer"})`` with ZeroQ's Fabric strategy (stage 3):
    the largest difference from DeepSpeed's own weights and second moments, and Adam's step count."""
    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(),
                      strategy=ZeroQFabricStrategy(stage=3, stage3_wrap_classes=["Linear"],
                                                   stage3_param_persistence_threshold=0))
    fabric.launch()
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1.0))
    reference = torch.load(FIXTURES / fixture / "reference.pt", weights_only=True)
    fabric.load(str(FIXTURES / fixture), {"model": model, "optimizer": optimizer})
    engine = fabric.strategy.engine
    weights, moments = engine.full_state_dict(), engine.full_optimizer_state()
    assert optimizer.param_groups[0]["lr"] == 0.01 and float(moments["head.weight"]["step"]) == 3.0
    return max(max((weights[n] - v).abs().max().item(), (moments[n]["exp_avg"] - reference["exp_avg"][n]).abs().max()
                   .item()) for n, v in reference["params"].items())


def test_fabric_loads_a_deepspeed_checkpoint_into_its_shards(dist_pool):
    assert dist_pool(3).run(_fabric_body, "stage2_bf16") == [0.0, 0.0, 0.0]


def test_an_fp16_checkpoint_brings_its_dynamic_loss_scale():
    """DeepSpeed's dynamic fp16 scaler (scale 2**8 after 3 steps without overflow) becomes ZeroQ's scaler
    state, which ``16-mixed`` resumes from; bf16 and fp32 checkpoints carry none."""
    from lightning_zeroq.checkpoint.store import ENGINE_KEY
    from lightning_zeroq.zero.loss_scaler import DynamicLossScaler

    state = deepspeed.read(FIXTURES / "stage2_fp16")
    assert state.loss_scale == {"scale": 256.0, "good_steps": 3, "skipped_steps": 0}
    scaler = DynamicLossScaler()
    scaler.load_state_dict(deepspeed.as_lightning_checkpoint(state, optimizer=True)[ENGINE_KEY]["loss_scaler"])
    assert scaler.scale == 256.0 and scaler.good_steps == 3
    assert deepspeed.read(FIXTURES / "stage2_bf16").loss_scale is None
    assert ENGINE_KEY not in deepspeed.as_lightning_checkpoint(deepspeed.read(FIXTURES / "stage3_fp32"), optimizer=True)
