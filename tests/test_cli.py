"""``zeroq-train``'s configuration: composition, validation, error messages, ``--cfg`` and ``--multirun``.

Most checks compose in this process with ``lightning_zeroq.cli.compose_config`` (what the command
does before it runs anything); three run the command as ``python -m lightning_zeroq.cli`` in a
temporary directory. The installed console script is exercised by ``tests/test_wheel.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lightning_zeroq import ZeroConfig
from lightning_zeroq.cli import (
    CHILD_ENV,
    RECIPE_HEADER,
    SUMMARY_PREFIX,
    compose_config,
    config_error_line,
    recipe_names,
    resource_dir,
    to_run_config,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("zero", "offload", "quantization", "model", "data", "trainer")


def error_chain(exc: BaseException) -> str:
    """The message of ``exc`` and of every exception it was raised from (Hydra nests the cause)."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return "\n".join(parts)


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; if it hangs, fail with every process's Python stack and kill them."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # faulthandler: each process of the group prints its stacks
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not finish in {timeout} s; stdout:\n{out[-3000:]}\nstderr:\n{err[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_cli(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK", CHILD_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return run_command([sys.executable, "-m", "lightning_zeroq.cli", *args], cwd, env, timeout)


# ---------------------------------------------------------------------------- bad configuration


@pytest.mark.parametrize(
    ("overrides", "names", "key"),
    [
        (["zero.stage=5"], "ZeroConfig.stage=5", "zero.stage"),
        (["offload=optimizer_nvme"], "ZeroConfig.nvme_path=None", "zero.nvme_path"),
        (["zero.reduce_bucket_size=-1"], "ZeroConfig.reduce_bucket_size=-1", "zero.reduce_bucket_size"),
        (["offload=params_optimizer_cpu", "zero.stage=2"], "needs stage=3 (got stage=2)", "zero.offload_parameters"),
        (["model.n_head=3"], "GPTConfig.n_embd=128 is not divisible by n_head=3", "model.n_embd"),
        (["trainer.precision=64-true"], "TrainerConfig.precision='64-true'", "trainer.precision"),
        (["data.seq_len=4096"], "DataConfig.seq_len=4096 exceeds GPTConfig.block_size=128", "data.seq_len"),
        (["+zero.stagee=2"], "ZeroConfig.stagee=2 is not a ZeroConfig field", "zero.stagee"),
    ],
)
def test_semantic_errors_name_the_value_and_the_key(overrides: list[str], names: str, key: str) -> None:
    cfg = compose_config(overrides)  # well-typed: composition succeeds, the dataclass checks reject it
    with pytest.raises(ValueError) as info:
        to_run_config(cfg)
    line = config_error_line(info.value)
    assert names in line
    assert f"[Hydra key: {key}]" in line
    assert line.startswith("zeroq-train: error: ") and "\n" not in line


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["zero.stagee=2"], "Key 'stagee' not in 'ZeroConfig'"),
        (["zero.stage=two"], "Value 'two' of type 'str' could not be converted to Integer"),
        (["model.n_layers=2"], "Key 'n_layers' not in 'GPTConfig'"),
        (["offload=optimizer_gpu"], "Could not find 'offload/optimizer_gpu'"),
        (["recipe=no_such_recipe"], "Could not find 'recipe/no_such_recipe'"),
    ],
)
def test_misspelt_keys_and_wrong_types_fail_at_compose_time(overrides: list[str], expected: str) -> None:
    with pytest.raises(Exception) as info:
        compose_config(overrides)
    assert expected in error_chain(info.value)


def test_a_typo_inside_a_recipe_fails_at_compose_time() -> None:
    compose_config([])  # registers the real recipes
    store = ConfigStore.instance()
    bad = OmegaConf.create({"defaults": [{"override /zero": "stage1"}], "zero": {"reduce_bucket_sise": 1000}})
    store.store(group="recipe", name="_typo_test", node=bad, package="_global_")
    try:
        with pytest.raises(Exception) as info:
            compose_config(["recipe=_typo_test"])
        assert "Key 'reduce_bucket_sise' not in 'ZeroConfig'" in error_chain(info.value)
    finally:
        del store.repo["recipe"]["_typo_test.yaml"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["zero=stage3"],
        ["offload=optimizer_cpu"],
        ["offload=optimizer_nvme", "zero.nvme_path=/tmp"],
        ["zero=stage3", "offload=params_optimizer_nvme", "zero.nvme_path=/tmp"],
        ["quantization=int8_weights"],
    ],
)
def test_options_not_implemented_yet_are_rejected_at_startup(overrides: list[str]) -> None:
    # What is implemented changes release by release; the CLI must agree with ZeroConfig.check_supported.
    zero = ZeroConfig(**OmegaConf.to_container(compose_config(overrides).zero))  # type: ignore[arg-type]
    try:
        zero.check_supported()
    except ValueError as err:
        with pytest.raises(ValueError, match="not supported yet") as info:
            to_run_config(compose_config(overrides))
        assert str(info.value) == str(err)
    else:
        to_run_config(compose_config(overrides))


# ---------------------------------------------------------------------------- composition


def test_default_is_the_default_recipe() -> None:
    run = to_run_config(compose_config([]))
    assert run == to_run_config(compose_config(["recipe=gpt1m_zero2_cpu"]))
    assert (run.zero.stage, run.trainer.accelerator, run.trainer.devices) == (2, "cpu", 2)
    assert run.trainer.max_steps <= 200 and run.model.n_layer * run.model.n_embd**2 * 12 < 2_000_000


def test_overrides_select_and_override() -> None:
    run = to_run_config(compose_config(["recipe=gpt1m_zero1_cpu", "trainer.max_steps=50", "zero.reduce_bucket_size=5000"]))
    assert (run.zero.stage, run.trainer.max_steps, run.zero.reduce_bucket_size) == (1, 50, 5000)
    # A group chosen on the command line wins over the recipe's choice.
    assert to_run_config(compose_config(["recipe=gpt1m_zero1_cpu", "zero=stage2"])).zero.stage == 2
    gpu = to_run_config(compose_config(["trainer=gpu"])).trainer
    assert (gpu.accelerator, gpu.devices, gpu.precision) == ("gpu", "auto", "bf16-mixed")
    nvme = compose_config(["offload=optimizer_nvme", "zero.nvme_path=/mnt/nvme"]).zero
    assert (nvme.offload_optimizer, nvme.offload_optimizer_device, nvme.nvme_path) == (True, "nvme", "/mnt/nvme")


def test_config_groups_are_complete() -> None:
    conf = resource_dir("conf")
    options = {group: sorted(p.stem for p in (conf / group).glob("*.yaml")) for group in GROUPS}
    assert options["zero"] == ["stage1", "stage2", "stage3"]
    assert options["offload"] == ["none", "optimizer_cpu", "optimizer_nvme", "params_optimizer_cpu",
                                  "params_optimizer_nvme"]
    assert options["quantization"] == ["int8_weights", "none"]
    assert {"cpu", "gpu"} <= set(options["trainer"])
    for group, names in options.items():
        for name in names:
            compose_config([f"{group}={name}"])  # every option composes against its schema


@pytest.mark.parametrize("name", recipe_names())
def test_recipe_is_complete_and_documented(name: str) -> None:
    lines = (resource_dir("recipes") / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == RECIPE_HEADER
    assert lines[1].startswith("# ") and len(lines[1]) > 20, "line 2 must say what the recipe is for"
    selected = {line.split("/")[1].split(":")[0] for line in lines if line.strip().startswith("- override /")}
    assert selected == set(GROUPS), f"a recipe selects every group explicitly; missing {set(GROUPS) - selected}"
    to_run_config(compose_config([f"recipe={name}"]))


def test_conf_and_recipes_are_found_inside_the_package() -> None:
    import lightning_zeroq

    package = Path(lightning_zeroq.__file__).parent
    assert resource_dir("conf") == (package / "conf").resolve() == (REPO_ROOT / "conf").resolve()
    assert resource_dir("recipes") == (package / "recipes").resolve() == (REPO_ROOT / "recipes").resolve()


# ---------------------------------------------------------------------------- the command


def test_cfg_job_prints_the_config_and_runs_nothing(tmp_path: Path) -> None:
    proc = run_cli(["recipe=gpt1m_zero1_cpu", "trainer.max_steps=7", "--cfg", "job"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert (cfg.zero.stage, cfg.trainer.max_steps) == (1, 7)
    assert not (tmp_path / "outputs").exists()


def test_bad_override_exits_with_one_clean_line(tmp_path: Path) -> None:
    proc = run_cli(["zero.stage=5"], tmp_path)
    assert proc.returncode == 2
    assert "zeroq-train: error: ZeroConfig.stage=5 is not a ZeRO stage" in proc.stderr
    assert "Traceback" not in proc.stderr and "Initializing distributed" not in proc.stdout + proc.stderr


def test_multirun_runs_each_job_on_two_ranks_in_its_own_dir(tmp_path: Path) -> None:
    proc = run_cli(["--multirun", "zero=stage1,stage2", "trainer.max_steps=3", "trainer.enable_progress_bar=false"],
                   tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = [line for line in proc.stdout.splitlines() if line.startswith(SUMMARY_PREFIX)]
    assert len(summaries) == 2, proc.stdout
    assert "[zero=stage1 " in summaries[0] and "3 steps on 2 ranks" in summaries[0]
    assert "[zero=stage2 " in summaries[1]
    # The children trained in their parent's job directory and created none of their own.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]
    jobs = sorted(p.relative_to(tmp_path).parts[-1] for p in tmp_path.glob("multirun/*/*/*") if p.is_dir())
    assert jobs == ["0", "1"]
    assert len(list(tmp_path.glob("multirun/*/*/*/.hydra/config.yaml"))) == 2
