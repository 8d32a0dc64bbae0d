"""DeepSpeed ZeRO checkpoints read without DeepSpeed (``checkpoint/deepspeed.py``), from checkpoints the
real DeepSpeed wrote (``tests/data/deepspeed/make_fixtures.py``; stages 1-3, fp32 and bf16, 2 and 3 ranks,
frozen and tied parameters, two parameter groups in sub-groups): every parameter and Adam moment bitwise
what DeepSpeed's own API gave whole at save time, and what its ``zero_to_fp32`` makes of the checkpoint;
converted by ``zeroq-convert`` into files that a plain model and torch's AdamW load; damaged, mixed-up or
incomplete checkpoints named in one line, nothing in them run and nothing outside their directory read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zeroq.checkpoint import deepspeed
from lightning_zeroq.cli.convert import main
from lightning_zeroq.ranks import LOCAL

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "deepspeed"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.pt").is_file())


class Net(nn.Module):  # the model make_fixtures.py trains
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)


FEATURED = ["stage1_frozen_tied", "stage2_frozen_tied_3ranks", "stage3_frozen_tied_subgroups_3ranks"]
"""Frozen parameters, the head tied to the embedding; at stage 3 two parameter groups split into sub-groups."""


def _net(reference: dict) -> Net:
    """The model the fixture trained: its head tied and parameters frozen as ``reference`` says."""
    net = Net()
    if reference.get("tied"):
        net.head.weight = net.embed.weight
    for n, p in net.named_parameters():
        p.requires_grad_(n not in reference.get("frozen", {}))
    return net


def _groups(reference: dict) -> list[dict]:
    """The fixture's parameter groups: names, lr and weight decay."""
    return reference.get("groups") or [{"names": list(reference["params"]), "lr": 0.01, "weight_decay": 0.1}]


def test_the_fixtures_cover_every_stage_and_every_dtype():
    assert {"stage1_fp32", "stage2_bf16", "stage2_fp16", "stage3_bf16", "stage3_fp32", "stage2_bf16_offload",
            "stage3_bf16_offload", *FEATURED} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_and_moment_is_bitwise_deepspeeds_own(name):
    reference = torch.load(FIXTURES / name / "reference.pt", weights_only=True)
    state = deepspeed.read(FIXTURES / name)
    ranks = json.loads((FIXTURES / "VERSIONS.json").read_text())["fixtures"][name]["ranks"]
    assert state.stage == int(name[5]) and state.world_size == ranks and state.global_steps == reference["global_steps"] == 3
    assert sorted(state.params) == sorted(n for n, _ in Net().named_parameters())  # frozen and tied ones too
    for n, value in reference["params"].items():
        assert state.params[n].dtype == torch.float32 and torch.equal(state.params[n], value), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state.state[n][key], reference[key][n]), (n, key)
        assert float(state.state[n]["step"]) == 3.0
    for n, value in reference.get("frozen", {}).items():  # as DeepSpeed's module held them (bf16 in bf16 runs)
        assert state.params[n].dtype == torch.float32 and torch.equal(state.params[n], value.float()), n
        assert n not in state.state and n in state.frozen
    for alias, source in reference.get("tied", {}).items():
        assert state.tied[alias] == source and torch.equal(state.params[alias], reference["params"][source])
    assert state.groups == [g["names"] for g in _groups(reference)]
    for hyper, group in zip(state.hyperparameters, _groups(reference)):
        assert (hyper["lr"], hyper["weight_decay"], tuple(hyper["betas"])) == (group["lr"], group["weight_decay"],
                                                                               (0.9, 0.95))


@pytest.mark.parametrize("name", NAMES)
def test_zeroq_convert_writes_what_a_plain_model_and_adamw_load(name, tmp_path):
    reference = torch.load(FIXTURES / name / "reference.pt", weights_only=True)
    frozen = reference.get("frozen", {})
    assert main([str(FIXTURES / name), str(tmp_path / "model.pt")]) == 0
    model = _net(reference)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, reference["params"][n] if n in reference["params"] else frozen[n].float()), n
    assert main([str(FIXTURES / name / "global_step3"), str(tmp_path / "full.ckpt"), "--optimizer"]) == 0  # the tag too
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert full["global_step"] == 3
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [params[n] for n in g["names"]]} for g in _groups(reference)], lr=1.0)
    optimizer.load_state_dict(full["optimizer_states"][0])
    for mine, group in zip(optimizer.param_groups, _groups(reference), strict=True):
        assert (mine["lr"], mine["weight_decay"]) == (group["lr"], group["weight_decay"])
    for n in reference["params"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[params[n]][key], reference[key][n]), (n, key)


@pytest.mark.parametrize("name", FEATURED)
def test_zeroq_convert_gives_what_deepspeeds_zero_to_fp32_gives(name, tmp_path):
    """Every tensor DeepSpeed's own ``zero_to_fp32`` makes of the checkpoint, bitwise (in fp32), in the
    torch and the safetensors output; at stage 1 the frozen parameters too, which DeepSpeed keeps only in
    its module states there and ``zero_to_fp32`` leaves out."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    theirs = torch.load(FIXTURES / name / "zero_to_fp32.pt", weights_only=True)
    frozen = torch.load(FIXTURES / name / "reference.pt", weights_only=True)["frozen"]
    assert main([str(FIXTURES / name), str(tmp_path / "model.pt")]) == 0
    assert main([str(FIXTURES / name), str(tmp_path / "model.safetensors")]) == 0
    for ours in (torch.load(tmp_path / "model.pt", weights_only=True), load_file(str(tmp_path / "model.safetensors"))):
        assert set(ours) == set(theirs) | set(frozen)
        assert all(ours[n].dtype == torch.float32 and torch.equal(ours[n], v.float()) for n, v in theirs.items())
        assert torch.equal(ours["head.weight"], ours["embed.weight"])
    assert set(frozen) <= set(theirs) or name.startswith("stage1")


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
    # what was refused and why, not torch's advice to load it anyway
    assert "refers to print," in captured.err and "cannot be loaded safely" in captured.err
    assert "weights_only" not in captured.err and "trust" not in captured.err, captured.err


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeroq-convert: error: "), err
    return err


def _swap(tag: Path, a: str, b: str) -> None:
    (tag / a).rename(tag / "swap")
    (tag / b).rename(tag / a)
    (tag / "swap").rename(tag / b)


OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
MIXED = [  # fixture, what is done to its tag directory, the file the error names, what it says
    ("stage2_bf16", lambda t: _swap(t, OPTIM.format(0), OPTIM.format(1)), OPTIM.format(0),
     "param_slice_mappings describe rank 1's part"),
    ("stage2_frozen_tied_3ranks", lambda t: _swap(t, OPTIM.format(1), OPTIM.format(2)), OPTIM.format(1),
     "param_slice_mappings describe rank 2's part"),
    ("stage3_bf16", lambda t: _swap(t, OPTIM.format(0), OPTIM.format(1)), OPTIM.format(0), "saved as rank 1's file"),
    ("stage3_frozen_tied_subgroups_3ranks", lambda t: _swap(t, MODEL.format(0), MODEL.format(2)), MODEL.format(0),
     "saved as rank 2's file"),
    ("stage3_bf16", lambda t: shutil.copy(t / OPTIM.format(1), t / OPTIM.format(2)), OPTIM.format(2),
     "one optimizer state file too many"),
    ("stage3_bf16", lambda t: [shutil.copy(t / f.format(1), t / f.format(2)) for f in (OPTIM, MODEL)], OPTIM.format(2),
     "one optimizer state file too many"),
    ("stage2_frozen_tied_3ranks", lambda t: (t / OPTIM.format(2)).unlink(), OPTIM.format(2), "missing"),
    ("stage3_frozen_tied_subgroups_3ranks", lambda t: (t / MODEL.format(2)).unlink(), MODEL.format(2), "missing"),
]


@pytest.mark.parametrize("fixture, change, named, says", MIXED)
def test_rank_files_mixed_up_missing_or_left_over_are_one_line_naming_the_file(tmp_path, capsys, fixture, change,
                                                                               named, says):
    """The number of ranks each file records, the part of each parameter it records holding (stages 1-2)
    and the name it was saved under are checked against the files: never another rank's values."""
    broken = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fixture, broken)
    change(broken / "global_step3")
    assert main([str(broken), str(tmp_path / "out.pt")]) == 1
    err = _error(capsys)
    assert f"{broken / 'global_step3' / named}: " in err and says in err, err
    assert "param_shapes and the partitions disagree" not in err and not (tmp_path / "out.pt").exists()


def _outside(tmp_path: Path) -> tuple[Path, Path]:
    """A DeepSpeed checkpoint ``ckpt`` and, outside it, a whole valid copy of its tag (``outside/global_step3``):
    whatever reads from there would load without an error."""
    shutil.copytree(FIXTURES / "stage2_bf16", tmp_path / "ckpt")
    shutil.copytree(FIXTURES / "stage2_bf16" / "global_step3", tmp_path / "outside" / "global_step3")
    return tmp_path / "ckpt", tmp_path / "outside" / "global_step3"


def _latest_up(ckpt: Path, outside: Path) -> str:
    (ckpt / "latest").write_text("../outside/global_step3")
    return "not a directory inside"


def _latest_absolute(ckpt: Path, outside: Path) -> str:
    (ckpt / "latest").write_text(str(outside))
    return "not a directory inside"


def _latest_link(ckpt: Path, outside: Path) -> str:
    (outside.parent / "latest").write_text("global_step3")
    (ckpt / "latest").unlink()
    (ckpt / "latest").symlink_to(outside.parent / "latest")
    return "symbolic link"


def _tag_link(ckpt: Path, outside: Path) -> str:
    shutil.rmtree(ckpt / "global_step3")
    (ckpt / "global_step3").symlink_to(outside)
    return "symbolic link"


def _rank_file_link(ckpt: Path, outside: Path) -> str:
    (ckpt / "global_step3" / OPTIM.format(1)).unlink()
    (ckpt / "global_step3" / OPTIM.format(1)).symlink_to(outside / OPTIM.format(1))
    return "symbolic link"


@pytest.mark.parametrize("plant", [_latest_up, _latest_absolute, _latest_link, _tag_link, _rank_file_link])
def test_nothing_outside_the_checkpoint_directory_is_read(tmp_path, capsys, plant):
    """``latest`` naming ``..`` or an absolute path, a link for ``latest``, the tag directory or a rank file:
    refused in one line, by zeroq-convert and by the reader fit and fabric.load use, though a valid
    checkpoint waits at the other end."""
    ckpt, outside = _outside(tmp_path)
    says = plant(ckpt, outside)
    assert main([str(ckpt), str(tmp_path / "out.pt")]) == 1
    err = _error(capsys)
    assert says in err and str(ckpt) in err, err
    with pytest.raises(deepspeed.CheckpointError, match=says):
        deepspeed.load_agreed(ckpt, True, LOCAL)


def test_a_zeroq_directory_with_a_planted_latest_is_read_as_zeroqs(tmp_path, capsys):
    """A directory with ``zeroq.json`` is ZeroQ's: a ``latest`` file and a DeepSpeed tag planted in it are
    not what is loaded; the manifest is read (here a damaged one, so the load stops on it)."""
    from lightning_zeroq.checkpoint import api
    from lightning_zeroq.checkpoint.store import classify

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2_bf16", ckpt)
    (ckpt / "zeroq.json").write_text("{}")
    assert classify(ckpt).kind.name == "ZEROQ" and not deepspeed.is_deepspeed(ckpt)
    assert main([str(ckpt), str(tmp_path / "out.pt")]) == 1
    err = _error(capsys)
    assert "zeroq.json" in err and not (tmp_path / "out.pt").exists(), err
    read = []  # the Trainer's and Fabric's door: the DeepSpeed reader is never asked
    with pytest.raises(deepspeed.CheckpointError):
        api.load(None, ckpt, optimizer=True, strict=True, checkpointer=SimpleNamespace(wait=lambda: None),
                 read_file=lambda path, group: read.append(path))
    assert read == []


def _latest_missing_tag(ckpt: Path) -> tuple[str, ...]:
    (ckpt / "latest").write_text("global_step9")
    return "DeepSpeed", "global_step9", str(ckpt / "latest")


def _latest_not_utf8(ckpt: Path) -> tuple[str, ...]:
    (ckpt / "latest").write_bytes(b"global_step\xff\xfe")
    return "not UTF-8", str(ckpt / "latest")


def _last_rank_missing(ckpt: Path) -> tuple[str, ...]:
    (ckpt / "global_step3" / OPTIM.format(1)).unlink()
    return str(ckpt / "global_step3" / OPTIM.format(1)), "missing", "partition_count"


@pytest.mark.parametrize("damage", [_latest_missing_tag, _latest_not_utf8, _last_rank_missing])
def test_an_incomplete_checkpoint_names_the_file_and_says_deepspeed(tmp_path, capsys, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2_bf16", ckpt)
    expected = damage(ckpt)
    assert main([str(ckpt), str(tmp_path / "out.pt")]) == 1
    err = _error(capsys)
    assert all(e in err for e in expected) and "param_shapes" not in err, err


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

    options = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0} if stage == 3 else {}
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


def _frozen_body(ckpt: str, reference_file: str, stage: int) -> dict:
    """Fit one step from ``ckpt`` with zeroq at ``stage``, the model frozen, tied and grouped as the
    fixture's (a fresh initialization unlike the checkpoint's): at the start, the largest difference of
    the weights (frozen ones included) and moments from the reference, the tie, and each group's lr and
    weight decay; at the end, whether the frozen parameters are still the checkpoint's."""
    import lightning as L

    from lightning_zeroq import ZeroQStrategy

    reference = torch.load(reference_file, weights_only=True)
    frozen = {n: v.float() for n, v in reference["frozen"].items()}

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            for name, module in _net(reference).named_children():
                self.add_module(name, module)

        def training_step(self, batch, batch_idx):
            logits = self.head(self.norm(self.blocks(self.embed(batch[0]))))
            return nn.functional.cross_entropy(logits.reshape(-1, 32), batch[0].reshape(-1))

        def configure_optimizers(self):
            params = dict(self.named_parameters())
            return torch.optim.AdamW([{"params": [params[n] for n in g["names"]]} for g in _groups(reference)], lr=1.0)

    seen: dict = {}

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            weights = trainer.strategy.full_state_dict()
            moments = trainer.strategy.engine.full_optimizer_state()
            seen["worst"] = max(max((weights[n] - v).abs().max().item(),
                                    *((moments[n][k] - reference[k][n]).abs().max().item() for k in ("exp_avg", "exp_avg_sq")))
                                for n, v in reference["params"].items())
            seen["frozen"] = max((weights[n] - v).abs().max().item() for n, v in frozen.items())
            seen["tied"] = pl_module.head.weight is pl_module.embed.weight
            seen["groups"] = [(g["lr"], g["weight_decay"]) for g in trainer.optimizers[0].param_groups]

        def on_train_end(self, trainer, pl_module) -> None:
            weights = trainer.strategy.full_state_dict()
            seen["frozen_after"] = all(torch.equal(weights[n], v) for n, v in frozen.items())

    torch.manual_seed(1)  # not the seed the fixture's model was made with: the frozen values must come from ckpt
    fresh = _net(reference)
    seen["fresh_differs"] = all(not torch.equal(dict(fresh.named_parameters())[n], v) for n, v in frozen.items())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 32, (8, 8))), batch_size=2)
    options = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    trainer = L.Trainer(strategy=ZeroQStrategy(stage=stage, **options), accelerator="cpu",
                        devices=dist.get_world_size(), max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Check()])
    trainer.fit(Lit(), data, ckpt_path=ckpt)
    return seen


def test_fit_restores_frozen_and_tied_parameters_and_each_groups_settings(dist_pool):
    """``fit(ckpt_path=<DeepSpeed directory>)`` at 2 ranks, stage 3, from DeepSpeed's stage-3 checkpoint of
    3 ranks with frozen parameters, a tied head and two parameter groups in sub-groups: the frozen
    parameters are the checkpoint's (not the fresh initialization) and stay so; the trained ones and
    Adam's moments bitwise DeepSpeed's; each group with its own lr and weight decay."""
    fixture = FIXTURES / "stage3_frozen_tied_subgroups_3ranks"
    for seen in dist_pool(2).run(_frozen_body, str(fixture), str(fixture / "reference.pt"), 3):
        assert seen["fresh_differs"] and seen["frozen"] == 0.0 and seen["frozen_after"], seen
        assert seen["worst"] == 0.0 and seen["tied"] and seen["groups"] == [(0.01, 0.1), (0.005, 0.0)], seen
