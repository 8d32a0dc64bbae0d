"""Fabric's ZeroQ strategy: bad input gives the Trainer strategy's errors; names, launchers, misuse."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_zeroq  # noqa: F401  (registers the strategy names)
from lightning_zeroq import ZeroQFabricStrategy, ZeroQStrategy
from lightning_zeroq.checkpoint.agree import CheckpointError
from lightning_zeroq.common.strategy import PRESETS
from tests.models import RichModel, make_batch, param_groups


def _raised(make) -> BaseException:
    with pytest.raises(Exception) as info:
        make()
    return info.value


@pytest.mark.parametrize(
    "options",
    [
        {"stagee": 2},
        {"stage": 4},
        {"stage": 2, "offload_parameters": True},
        {"quantized_weights_group_size": 12},
        {"offload_optimizer": True, "offload_optimizer_device": "nvme"},
        {"stage3_wrap_classes": "Block"},
        {"config": {"zero_optimization": {"stage": 3}}},
    ],
    ids=lambda o: ",".join(o),
)
def test_option_errors_are_the_trainers(options):
    fabric_error = _raised(lambda: ZeroQFabricStrategy(**options))
    trainer_error = _raised(lambda: ZeroQStrategy(**options))
    assert type(fabric_error) is type(trainer_error) and type(fabric_error) in (TypeError, ValueError)
    assert str(fabric_error).replace("ZeroQFabricStrategy", "ZeroQStrategy") == str(trainer_error)


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_precision_errors_are_the_trainers(precision):
    import lightning as L

    fabric_error = _raised(lambda: L.Fabric(strategy="zeroq", accelerator="cpu", devices=1, precision=precision))
    trainer_error = _raised(lambda: L.Trainer(strategy="zeroq", accelerator="cpu", devices=1, precision=precision))
    assert type(fabric_error) is type(trainer_error) is ValueError
    assert str(fabric_error) == str(trainer_error)
    assert f"precision={precision!r}" in str(fabric_error)


def test_presets_are_registered_for_fabric_under_the_trainers_names():
    import lightning as L
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    ZeroQFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # a second registration is a no-op
    for name, options in PRESETS.items():
        fabric_strategy, trainer_strategy = STRATEGY_REGISTRY.get(name), StrategyRegistry.get(name)
        assert type(fabric_strategy) is ZeroQFabricStrategy and type(trainer_strategy) is ZeroQStrategy
        assert fabric_strategy.config == trainer_strategy.config
        assert all(getattr(fabric_strategy.config, k) == v for k, v in options.items())
    fabric = L.Fabric(strategy="zeroq_stage_3_offload", accelerator="cpu", devices=2, precision="bf16-mixed")
    assert isinstance(fabric.strategy, ZeroQFabricStrategy)
    assert fabric.strategy.config.offload_parameters and fabric.strategy.precision.param_dtype == torch.bfloat16


@pytest.fixture
def rank_zero_restored():
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    before = rank_zero_only.rank, utils_rank_zero_only.rank
    yield
    rank_zero_only.rank, utils_rank_zero_only.rank = before


_TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29512"}
_SLURM = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train",
          "SLURM_JOB_ID": "1234", "SLURM_NODEID": "1", "SLURM_LOCALID": "1", "SLURM_PROCID": "3",
          "SLURM_NODELIST": "node[1-2]"}


@pytest.mark.parametrize("env, kind", [(_TORCHRUN, "TorchElasticEnvironment"), (_SLURM, "SLURMEnvironment")],
                         ids=["torchrun", "slurm"])
def test_launchers_of_torchrun_and_slurm(monkeypatch, rank_zero_restored, env, kind):
    """Processes made by torchrun or srun: Fabric finds the cluster environment, the strategy takes
    its ranks, and launching creates no process (only checks the settings)."""
    import lightning as L
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fabric = L.Fabric(strategy="zeroq_stage_3", accelerator="cpu", devices=2, num_nodes=2)
    strategy = fabric.strategy
    assert isinstance(strategy, ZeroQFabricStrategy) and type(strategy.cluster_environment).__name__ == kind
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (3, 1, 1, 4)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}
    assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
    assert strategy.cluster_environment.creates_processes_externally
    assert strategy.launcher.launch(lambda: "ran here") == "ran here"
    assert strategy.launcher.procs == []


def _misuse_body(tmp: str) -> list[str]:
    import lightning as L

    from lightning_zeroq import ZeroQFabricStrategy

    seen = []

    def expect(error: type, pattern: str, call) -> None:
        with pytest.raises(error, match=pattern):
            call()
        seen.append(error.__name__)

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroQFabricStrategy(stage=2))
    fabric.launch()
    loss = torch.ones((), requires_grad=True)
    expect(RuntimeError, r"fabric.backward\(loss\) needs the model set up first", lambda: fabric.backward(loss))
    model = RichModel()
    sgd = [torch.optim.SGD(model.parameters(), lr=1) for _ in range(2)]
    expect(ValueError, r"ZeroQFabricStrategy supports exactly one optimizer, fabric.setup\(\) got 2; put all",
           lambda: fabric.setup(model, *sgd))
    expect(ValueError, r"ZeroQ cannot shard optimizer LBFGS",
           lambda: fabric.setup(model, torch.optim.LBFGS(model.parameters())))
    expect(ValueError, r"shards one model, and one is set up already", lambda: fabric.setup(RichModel()))

    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroQFabricStrategy(stage=2))
    fabric.launch()
    expect(RuntimeError, r"fabric.setup_optimizers\(optimizer\) needs the model set up first",
           lambda: fabric.setup_optimizers(torch.optim.AdamW(RichModel().parameters())))
    net = RichModel()
    model, opt = fabric.setup(net, torch.optim.AdamW(param_groups(net)))
    expect(ValueError, r"exactly one optimizer, one is set up already",
           lambda: fabric.setup_optimizers(torch.optim.AdamW(net.parameters())))
    expect(TypeError, r"needs the model set up by ZeroQFabricStrategy",
           lambda: fabric.strategy._backward_sync_control.no_backward_sync(RichModel(), True))
    tokens, targets, flag = make_batch(0, 0, dist.get_rank())
    fabric.backward(model(tokens, flag).float().mean() * float("nan"))
    expect(ValueError, r"norm_type=1 is not supported",
           lambda: fabric.clip_gradients(model, opt, max_norm=1, norm_type=1))
    expect(RuntimeError, r"non-finite gradients \(inf or NaN\) in optimizer step 1",
           lambda: fabric.clip_gradients(model, opt, max_norm=1.0))  # the engine's check, every rank
    expect(ValueError, r"does not take filter.*full_state_dict",
           lambda: fabric.save(f"{tmp}/ckpt", {"model": model}, filter={"model": lambda k, v: True}))
    expect(ValueError, r"'other' is a module that ZeroQFabricStrategy did not set up",
           lambda: fabric.save(f"{tmp}/ckpt", {"model": model, "other": torch.nn.Linear(2, 2)}))
    expect(ValueError, r"pass the objects to load into", lambda: fabric.load(f"{tmp}/ckpt"))
    expect(CheckpointError, r"weights.pt", lambda: fabric.load_raw(f"{tmp}/weights.pt", model))  # no such file
    return seen


def test_misuse_is_named(dist_pool, tmp_path):
    seen = dist_pool(2).run(_misuse_body, str(tmp_path))
    assert seen[0] == seen[1] and len(seen[0]) == 13


def _other_optimizer_body(tmp: str) -> tuple[str, str]:
    import lightning as L

    def fabric_with(make_optimizer):
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=ZeroQFabricStrategy(stage=2))
        fabric.launch()
        net = RichModel()
        return fabric, *fabric.setup(net, make_optimizer(param_groups(net)))

    fabric, model, opt = fabric_with(torch.optim.AdamW)
    tokens, targets, flag = make_batch(0, 0, dist.get_rank())
    fabric.backward(model(tokens, flag).float().mean())
    opt.step()
    fabric.save(f"{tmp}/adamw", {"model": model, "optimizer": opt, "step": 1})
    fabric, model, opt = fabric_with(torch.optim.SGD)
    with pytest.raises(CheckpointError) as info:
        fabric.load(f"{tmp}/adamw", {"model": model, "optimizer": opt})
    weights_only = fabric.load(f"{tmp}/adamw", {"model": model})  # the weights alone still load
    return str(info.value), repr(sorted(weights_only))


def test_a_checkpoint_of_another_optimizer_kind_is_refused_by_fabric_load(dist_pool, tmp_path):
    results = dist_pool(2).run(_other_optimizer_body, str(tmp_path))
    assert results[0] == results[1], results
    message, rest = results[0]
    assert rest == "['step']", results
    for needle in ("torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", "same optimizer", "weights only"):
        assert needle in message, message
