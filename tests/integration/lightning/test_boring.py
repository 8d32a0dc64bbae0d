"""Lightning's own ``BoringModel`` (one ``Linear``, plain SGD without momentum: an optimizer whose
state stays empty, and a ``StepLR``) with ``ModelCheckpoint`` saving every step, on 2 gloo ranks.

Each case fits 6 steps in one stage, resumes from the step-4 checkpoint in another stage (and
another offload) for steps 5 to 8, and matches DDP doing the same fit-and-resume step by step (every
parameter after every step, at 1e-5). Stage 3 runs with its unit really freed between uses
(``stage3_wrap_classes=["Linear"]``, threshold 0).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401  (registers the strategy names)

TOL = 1e-5
FIRST_STEPS, RESUME_AT, LAST_STEP = 6, 4, 8
FREED = {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0}
S1, S2, S3 = {"stage": 1}, {"stage": 2}, {"stage": 3, **FREED}
CPU = {"offload_optimizer": True}
NVME = {"offload_optimizer": True, "offload_optimizer_device": "nvme"}


def _boring(strategy, max_steps: int, dirpath: str, ckpt_path=None) -> list[dict]:
    """Fit ``BoringModel`` for ``max_steps`` with a checkpoint every step; every parameter after
    every step (full values, on every rank)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Record(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if hasattr(trainer.strategy, "full_state_dict"):
                params = trainer.strategy.full_state_dict()
            else:
                params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.steps.append({"step": trainer.global_step, "params": params})

    L.seed_everything(1, verbose=False)
    model = BoringModel()
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))  # the same samples in every run
    record = Record()
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                        callbacks=[record, saver], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    return record.steps


def _zeroq(kind: dict, tmp: str) -> dict:
    from lightning_zeroq import ZeroQStrategy

    return ZeroQStrategy(**{**kind, **({"nvme_path": tmp} if kind.get("offload_optimizer_device") == "nvme" else {})})


def _dance(first, second, tmp: str) -> list[dict]:
    """Fit ``FIRST_STEPS`` steps with ``first``, then resume from the step-4 checkpoint with ``second``."""
    dirpath = os.path.join(tmp, "ckpts")
    steps = _boring(first if isinstance(first, str) else _zeroq(first, tmp), FIRST_STEPS, dirpath)
    ckpt = os.path.join(dirpath, f"epoch=0-step={RESUME_AT}.ckpt")
    resumed = _boring(second if isinstance(second, str) else _zeroq(second, tmp), LAST_STEP,
                      os.path.join(tmp, "again"), ckpt_path=ckpt)
    return steps + resumed


@pytest.fixture(scope="module")
def ddp_reference(dist_pool, tmp_path_factory):
    return dist_pool(2).run(_dance, "ddp", "ddp", str(tmp_path_factory.mktemp("ddp")))[0]


def assert_matches(got: list[dict], ref: list[dict]) -> None:
    assert [s["step"] for s in got] == [s["step"] for s in ref] == [*range(1, FIRST_STEPS + 1),
                                                                     *range(RESUME_AT + 1, LAST_STEP + 1)]
    for mine, want in zip(got, ref):
        assert mine["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            diff = (mine["params"][name] - value).abs().max().item()
            assert diff <= TOL, f"step {want['step']}: {name} differs from DDP by {diff}"
    assert not torch.equal(ref[0]["params"]["layer.weight"], ref[-1]["params"]["layer.weight"])  # it trained


@pytest.mark.parametrize("first,second", [
    (S1, S2), (S2, S3), (S3, S1),                                       # every stage saves and resumes
    ({**S1, **CPU}, {**S3, **NVME}), ({**S2, **NVME}, {**S1, **CPU}),   # with CPU and NVMe offload
    ({**S3, **CPU, "offload_parameters": True}, {**S2, **NVME}),
], ids=["1-to-2", "2-to-3", "3-to-1", "1cpu-to-3nvme", "2nvme-to-1cpu", "3cpu-to-2nvme"])
def test_boring_model_sgd_resumes_in_another_stage_as_ddp(dist_pool, tmp_path, ddp_reference, first, second):
    got = dist_pool(2).run(_dance, first, second, str(tmp_path))
    assert_matches(got[0], ddp_reference)
    assert_matches(got[1], ddp_reference)


def test_a_closed_engine_refuses_to_save_and_an_empty_optimizer_state_does_not(tmp_path):
    # The guard against saving state that is gone reads what the engine released (close(): the
    # NVMe swap files holding masters and optimizer state are deleted), not an empty optimizer state.
    from lightning_zeroq import ZeroConfig, ZeroEngine
    from lightning_zeroq.checkpoint.agree import CheckpointError
    from lightning_zeroq.checkpoint.engine_io import save_engine

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine = ZeroEngine(model, ZeroConfig(stage=2, offload_optimizer=True, offload_optimizer_device="nvme",
                                          nvme_path=str(tmp_path)))
    engine.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(model(torch.randn(3, 4)).square().mean())
    engine.step()
    assert not engine.optimizer.state
    save_engine(engine, tmp_path / "stepped")
    assert (tmp_path / "stepped").is_dir()
    engine.close()
    with pytest.raises(CheckpointError, match="the engine that held its state was closed"):
        save_engine(engine, tmp_path / "closed")
    assert not (tmp_path / "closed").exists()


# ---------------------------------------------------------------------- zeroq-convert keeps the trainer state


def _scored_fit(tmp: str) -> dict:
    """Stage 2 fit of a BoringModel that logs its loss and uses SGD with momentum; ModelCheckpoint
    keeps the best two by that loss (its scores are tensors in the trainer state). Then a save, and
    what the in-memory checkpoint holds: the trainer state, full parameters, full optimizer state."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_zeroq import ZeroQStrategy
    from lightning_zeroq.checkpoint.engine_io import sharded_optimizer_state

    class Scored(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"], sync_dist=True)
            return out

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    L.seed_everything(1, verbose=False)
    strategy = ZeroQStrategy(stage=2)
    saver = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), monitor="loss", save_top_k=2, every_n_train_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, callbacks=[saver], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    trainer.fit(Scored(), torch.utils.data.DataLoader(data, batch_size=2))
    trainer.save_checkpoint(os.path.join(tmp, "final.ckpt"))
    memory = trainer._checkpoint_connector.dump_checkpoint()
    names = [n for g in sharded_optimizer_state(strategy.engine)["param_groups"] for n in g["params"]]
    return {"trainer": {k: v for k, v in memory.items() if k not in ("state_dict", "optimizer_states")},
            "params": strategy.full_state_dict(), "names": names,
            "optimizer": strategy.engine.full_optimizer_state()}


@pytest.fixture(scope="module")
def scored(dist_pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scored")
    return tmp, dist_pool(2).run(_scored_fit, str(tmp))[0]


class _Attr(str):
    """A path step that is an attribute (a tensor in an object's ``__dict__``, e.g. a ``Namespace``)."""


def _tensor_at(obj, path: tuple):
    for key in path:
        obj = getattr(obj, key) if isinstance(key, _Attr) else obj[key]
    return obj


def held_tensors(obj, path: tuple = ()):
    """Every tensor in ``obj`` (dicts, lists, tuples, objects' attributes), by path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from held_tensors(value, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from held_tensors(value, path + (index,))
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for key, value in vars(obj).items():
            yield from held_tensors(value, path + (_Attr(key),))


@pytest.mark.parametrize("flags", [{"lightning": True}, {"optimizer": True}], ids=["lightning", "optimizer"])
def test_zeroq_convert_writes_every_tensor_of_the_checkpoint(scored, tmp_path, flags):
    from lightning_zeroq.checkpoint.convert import consolidate

    saved, memory = scored
    out = consolidate(saved / "final.ckpt", tmp_path / "out.ckpt", **flags)
    converted = torch.load(out, weights_only=True)
    trainer_paths = set()
    for path, value in held_tensors(converted):
        if path[0] == "state_dict":
            want = memory["params"][path[1]]
        elif path[0] == "optimizer_states":
            assert flags.get("optimizer") and path[:3] == ("optimizer_states", 0, "state"), path
            want = memory["optimizer"][memory["names"][path[3]]][path[4]]
        else:
            want = _tensor_at(memory["trainer"], path)
            trainer_paths.add(path)
        assert value.dtype == want.dtype and torch.equal(value, want), (path, value, want)
    expected = {path for path, _ in held_tensors(memory["trainer"])}
    assert trainer_paths == expected
    scores = [t for p, t in held_tensors(memory["trainer"]) if "current_score" in p or "best_model_score" in p]
    assert len(scores) == 2 and all(t.item() > 0 for t in scores)  # what the conversion wrote as zeros
    assert set(converted["state_dict"]) == set(memory["params"])
    if flags.get("optimizer"):
        assert len(converted["optimizer_states"][0]["state"]) == len(memory["names"])


# ---------------------------------------------------------------------- one rank reads a checkpoint alone


def _one_rank_reads(tmp: str) -> dict:
    """As Lightning's DeepSpeed tests do: after fit, rank 0 alone consolidates the checkpoint and loads
    it with ``load_from_checkpoint`` while the other rank is already waiting at a barrier."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_zeroq.checkpoint.convert import consolidate

    L.seed_everything(1, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zeroq_stage_2", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    model = BoringModel()
    trainer.fit(model)
    ckpt = os.path.join(tmp, "final.ckpt")
    trainer.save_checkpoint(ckpt)
    full = trainer.strategy.full_state_dict()
    out = {}
    if dist.get_rank() == 0:
        file = consolidate(ckpt, os.path.join(tmp, "model.pt"))
        out["consolidated"] = torch.load(file, weights_only=True)
        out["loaded"] = dict(BoringModel.load_from_checkpoint(ckpt).state_dict())
    dist.barrier()
    return {**out, "full": full}


def test_one_rank_consolidates_and_loads_while_the_others_wait(dist_pool, tmp_path):
    results = dist_pool(2).run(_one_rank_reads, str(tmp_path))
    first = results[0]
    for key in ("consolidated", "loaded"):
        assert first[key].keys() == first["full"].keys()
        assert all(torch.equal(first[key][k], first["full"][k]) for k in first["full"]), key


# ---------------------------------------------------------------------- a checkpoint loaded after fit


def _evaluate_after_fit(kind, tmp: str) -> dict:
    """Fit 4 steps saving every step, then ``test(ckpt_path=step 2)`` with the same trainer; a second
    trainer ``fit(ckpt_path=step 2)`` to step 5, then ``test()`` (Lightning loads its best checkpoint,
    the newest one here). The module's weights and the test loss after each test."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Tested(BoringModel):
        def test_step(self, batch, batch_idx):
            out = super().test_step(batch, batch_idx)
            self.log("test_loss", out["y"], sync_dist=True)
            return out

    def trainer(steps: int, dirpath: str):
        strategy = _zeroq(kind, tmp) if isinstance(kind, dict) else kind
        return L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps,
                         callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)],
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)

    def weights(model) -> dict:
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    os.makedirs(tmp, exist_ok=True)
    L.seed_everything(1, verbose=False)
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model = Tested()
    first = trainer(4, os.path.join(tmp, "a"))
    first.fit(model, loader)
    after_fit = weights(model)
    step2 = os.path.join(tmp, "a", "epoch=0-step=2.ckpt")
    out = {"tested": first.test(model, loader, ckpt_path=step2, verbose=False)[0]["test_loss"],
           "loaded": weights(model), "after_fit": after_fit}
    if hasattr(first.strategy, "full_state_dict"):  # the fit's engine holds what was loaded too (a save writes it)
        out["engine"] = first.strategy.full_state_dict()
    # a single file (weights only) saved now holds the loaded weights, and loads after fit too
    single = first.strategy.broadcast(os.path.join(tmp, "loaded.ckpt"))
    first.save_checkpoint(single, weights_only=True)
    out["from_file"] = first.test(model, loader, ckpt_path=single, verbose=False)[0]["test_loss"]
    out["file_weights"] = weights(model)
    second = trainer(5, os.path.join(tmp, "b"))
    model = Tested()
    second.fit(model, loader, ckpt_path=step2)
    out["tested_again"] = second.test(dataloaders=loader, verbose=False)[0]["test_loss"]
    out["loaded_again"] = weights(model)
    return out


@pytest.fixture(scope="module")
def evaluated_by_ddp(dist_pool, tmp_path_factory):
    done: dict[int, dict] = {}

    def get(ranks: int) -> dict:
        if ranks not in done:
            done[ranks] = dist_pool(ranks).run(_evaluate_after_fit, "ddp", str(tmp_path_factory.mktemp("ddp")))[0]
        return done[ranks]

    return get


@pytest.mark.parametrize("ranks,kind", [
    (2, S1), (2, {**S2, **CPU}), (2, S3), (2, {**S3, **NVME, "offload_parameters": True}), (1, S3), (1, {**S2, **NVME}),
], ids=["2xstage1", "2xstage2-cpu", "2xstage3", "2xstage3-nvme", "1xstage3", "1xstage2-nvme"])
def test_a_checkpoint_loads_for_test_after_fit_as_with_ddp(dist_pool, tmp_path, evaluated_by_ddp, ranks, kind):
    want = evaluated_by_ddp(ranks)
    got = dist_pool(ranks).run(_evaluate_after_fit, kind, str(tmp_path / "zeroq"))[0]
    for key in ("tested", "tested_again", "from_file"):
        assert abs(got[key] - want[key]) <= TOL, key
    assert got["from_file"] == got["tested"]
    for name, value in want["loaded"].items():
        assert (got["loaded"][name] - value).abs().max() <= TOL, name
        assert (got["engine"][name] - value).abs().max() <= TOL, name
        assert (got["file_weights"][name] - value).abs().max() <= TOL, name
        assert (got["loaded_again"][name] - want["loaded_again"][name]).abs().max() <= TOL, name
        assert not torch.equal(value, want["after_fit"][name])  # the step-2 weights, not the fit's last


# ---------------------------------------------------------------------- precision


def _bf16_true_init_module(strategy: str, garbage: bool) -> dict:
    """Lightning's init-module case with ``bf16-true`` and Adam, one step. ``garbage``: the weights built
    under ``init_module(empty_init=True)`` are uninitialized memory; this writes what such memory often
    holds (huge bf16 values) so that the outcome does not depend on the allocator."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = {}

    class Model(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def on_train_start(self):
            seen["dtype"] = self.layer.weight.dtype

    L.seed_everything(1, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true", max_steps=1,
                        barebones=True, enable_checkpointing=False, logger=False)
    with trainer.init_module(empty_init=garbage):
        model = Model()
    if garbage:
        with torch.no_grad():
            model.layer.weight.fill_(3e38)
    out = {"init_dtype": model.layer.weight.dtype}
    try:
        trainer.fit(model)
    except RuntimeError as error:
        out["error"] = str(error)
    out.update(seen, weights={n: p.detach().float().clone() for n, p in model.named_parameters()})
    return out


def test_bf16_true_init_module_first_step_is_ddp_s_and_uninitialized_weights_stop_it(dist_pool):
    # Lightning's init-module test (bf16-true, Adam, one step) ported to stage 1 saw non-finite gradients
    # on both ranks: its second case builds the model with empty_init=True, i.e. uninitialized memory,
    # and DDP steps on the same garbage (rank 0's, as ZeroQ does) into non-finite weights silently.
    # Built normally, the first step is DDP's (ZeroQ keeps fp32 masters: within a bf16 rounding).
    ddp, zeroq = (dist_pool(2).run(_bf16_true_init_module, s, False) for s in ("ddp", "zeroq_stage_1"))
    for got, want in zip(zeroq, ddp):
        assert got["init_dtype"] == got["dtype"] == want["dtype"] == torch.bfloat16 and "error" not in got
        for name, value in want["weights"].items():
            assert torch.isfinite(got["weights"][name]).all()
            torch.testing.assert_close(got["weights"][name], value, rtol=2**-7, atol=2**-7)
    ddp, zeroq = (dist_pool(2).run(_bf16_true_init_module, s, True) for s in ("ddp", "zeroq_stage_1"))
    assert all(not torch.isfinite(r["weights"]["layer.weight"]).all() for r in ddp)  # DDP: garbage in, NaN out
    for r in zeroq:  # ZeroQ: the same garbage, refused on every rank before it reaches the weights
        assert "non-finite gradients" in r["error"] and "rank(s) [0, 1]" in r["error"], r.get("error")
        assert torch.isfinite(r["weights"]["layer.bias"]).all()


def _bf16_mixed_dtypes(kind: dict) -> dict:
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = {}

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            seen.setdefault("training", self.layer.weight.dtype)
            return super().training_step(batch, batch_idx)

        def test_step(self, batch, batch_idx):
            seen.setdefault("testing", self.layer.weight.dtype)
            return super().test_step(batch, batch_idx)

    L.seed_everything(1, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_zeroq(kind, ""), precision="bf16-mixed", max_steps=2,
                        limit_test_batches=1, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    model = Model()
    trainer.fit(model)
    after = {n: p.detach() for n, p in model.named_parameters()}
    full = trainer.strategy.full_state_dict()
    trainer.test(model, verbose=False)
    return {**seen, "after": {n: p.dtype for n, p in after.items()},
            "exact": all(torch.equal(after[n], full[n]) for n in full)}


@pytest.mark.parametrize("kind", [S1, S2, S3], ids=["stage1", "stage2", "stage3"])
def test_bf16_mixed_trains_bf16_working_weights_and_hands_back_fp32_masters(dist_pool, kind):
    for r in dist_pool(2).run(_bf16_mixed_dtypes, kind):
        assert r["training"] == torch.bfloat16  # what the forward reads during fit, as with DeepSpeed
        assert set(r["after"].values()) == {torch.float32} and r["exact"]  # after fit: the fp32 masters
        assert r["testing"] == torch.float32  # evaluation after fit: the plain module under autocast, as DDP
