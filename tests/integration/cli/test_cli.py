"""``zeroq-train``'s configuration: composition, validation, error messages, ``--cfg`` and ``--multirun``.

Most checks compose in this process with ``lightning_zeroq.cli.train.compose_config`` (what the command
does before it runs anything); the rest run the command as ``python -m lightning_zeroq.cli`` in a
temporary directory: config errors and ``--help`` (a few seconds each), a stale ``ZEROQ_CHILD_CONFIG``
under a launcher, one short 2-rank run and one 2-job ``--multirun``. The installed console script is
exercised by ``tests/integration/cli/test_wheel.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import lightning_zeroq.cli.train as cli
from lightning_zeroq import ZeroConfig
from lightning_zeroq.cli.train import (
    CHILD_ENV,
    RECIPE_HEADER,
    SUMMARY_PREFIX,
    compose_config,
    inherited_payload,
    recipe_names,
    resource_dir,
    to_run_config,
)
from lightning_zeroq.cli.config import build_run_config, config_error_line, preflight
from lightning_zeroq.zero.policies import ineffective

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

REPO_ROOT = Path(__file__).resolve().parents[3]
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


def run_cli(args: list[str], cwd: Path, timeout: float = 180,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK", CHILD_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return run_command([sys.executable, "-m", "lightning_zeroq.cli", *args], cwd, env | (extra_env or {}), timeout)


def write_text(path: Path, nbytes: int) -> Path:
    """A UTF-8 text file of exactly ``nbytes`` bytes."""
    line = "The quick brown fox jumps over the lazy dog.\n"
    path.write_text((line * (nbytes // len(line) + 1))[:nbytes], encoding="utf-8")
    return path


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
        (["trainer.devices=-1"], "TrainerConfig.devices=-1 means every GPU, and the accelerator is the CPU",
         "trainer.devices"),
        (["trainer.devices=0"], "use a positive number of processes per node (e.g. 2) or auto.", "trainer.devices"),
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
    ("overrides", "key"),
    [
        (["zero=stage2", "offload=params_optimizer_cpu"], "zero.offload_parameters"),
        (["zero=stage1", "offload=params_optimizer_cpu"], "zero.offload_parameters"),
        (["offload=optimizer_nvme"], "zero.nvme_path"),
        (["zero=stage3", "offload=params_optimizer_nvme"], "zero.nvme_path"),
        (["quantization=int8_weights", "zero.quantized_weights_group_size=12"], "zero.quantized_weights_group_size"),
    ],
)
def test_bad_combinations_of_groups_are_rejected_at_startup(overrides: list[str], key: str) -> None:
    # Each option is valid alone; the combination is not. The CLI must reject it before any process
    # starts, with ZeroConfig's own message (the engine's check, not a copy that could drift).
    values = OmegaConf.to_container(compose_config(overrides).zero, resolve=True)
    with pytest.raises(ValueError) as direct:
        ZeroConfig(**values)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as via_cli:
        to_run_config(compose_config(overrides))
    assert str(via_cli.value) == str(direct.value)
    line = config_error_line(via_cli.value)
    assert line.startswith("zeroq-train: error: ZeroConfig.") and "\n" not in line
    assert line.endswith(f"[Hydra key: {key}]")


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
def test_recipe_is_complete_and_documented(name: str, tmp_path: Path) -> None:
    lines = (resource_dir("recipes") / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == RECIPE_HEADER
    assert lines[1].startswith("# ") and len(lines[1]) > 20, "line 2 must say what the recipe is for"
    selected = {line.split("/")[1].split(":")[0] for line in lines if line.strip().startswith("- override /")}
    assert selected == set(GROUPS), f"a recipe selects every group explicitly; missing {set(GROUPS) - selected}"
    run = to_run_config(compose_config([f"recipe={name}"]))
    if run.finetune.lora_rank:  # a fine-tuning recipe needs its base: none here, then a stand-in
        with pytest.raises(ValueError, match=r"lora_rank=\d+ needs finetune.base"):
            preflight(run)
        run = to_run_config(compose_config([f"recipe={name}", f"finetune.base={tmp_path}"]))
    preflight(run)  # the pydoc text fills a batch on every rank
    # A recipe sets nothing that cannot take effect (each such setting warns on every run).
    assert ineffective(run.zero, loss_scaling=run.trainer.precision == "16-mixed") == []
    # What the launched ranks rebuild from ZEROQ_CHILD_CONFIG is the parent's config.
    assert build_run_config(json.loads(json.dumps(dataclasses.asdict(run)))) == run


def test_conf_and_recipes_are_found_at_the_top_of_a_checkout() -> None:
    # The wheel carries them inside the package (tests/integration/cli/test_wheel.py); a checkout has them once,
    # at its top, and no link into the package.
    package = Path(cli.__file__).parents[1]
    assert resource_dir("conf") == (REPO_ROOT / "conf").resolve()
    assert resource_dir("recipes") == (REPO_ROOT / "recipes").resolve()
    assert [p for p in package.rglob("*") if p.is_symlink()] == []


# ---------------------------------------------------------------------------- the command


def test_cfg_job_prints_the_config_and_runs_nothing(tmp_path: Path) -> None:
    proc = run_cli(["recipe=gpt1m_zero1_cpu", "trainer.max_steps=7", "--cfg", "job"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert (cfg.zero.stage, cfg.trainer.max_steps) == (1, 7)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["zero.stage=5"], "ZeroConfig.stage=5 is not a ZeRO stage; use 1, 2 or 3. [Hydra key: zero.stage]"),
        (["offload=params_optimizer_cpu", "zero.stage=2"],
         "ZeroConfig.offload_parameters=True needs stage=3 (got stage=2)"),
        # 600 bytes: 4 windows of 129 bytes, a batch on each of 2 ranks needs 16 x 2 = 32 windows.
        (["data.text_file=small.txt"], "DataConfig.text_file='small.txt' is too little text for one batch: "
         "600 bytes make 4 windows of seq_len+1=129 bytes, and one batch on every rank needs "
         "batch_size x ranks = 16 x 2 = 32 windows (4,128 bytes)"),
        (["trainer=gpu"], "TrainerConfig.accelerator='gpu' needs a CUDA GPU"),
        (["trainer.devices=0"], "TrainerConfig.devices=0 is not a device count Lightning can run"),
        (["data.text_file=binary.dat"], "DataConfig.text_file='binary.dat' is not UTF-8 text (byte 0xff at offset 2,000"),
        (["offload=optimizer_nvme", "zero.nvme_path=no_such_dir"], "ZeroConfig.nvme_path='no_such_dir' does not exist"),
        (["offload=optimizer_nvme", "zero.nvme_path=small.txt"], "ZeroConfig.nvme_path='small.txt' is not a directory"),
        # /proc refuses new files to root as well: what a read-only mount does.
        (["recipe=gpt1m_zero3_offload_params_nvme_cpu", "zero.nvme_path=/proc"], "ZeroConfig.nvme_path='/proc' is not writable"),
    ],
    ids=["bad-value", "bad-combination", "too-little-text", "no-gpu", "no-devices", "binary-text", "nvme-missing",
         "nvme-file", "nvme-read-only"],
)
def test_bad_config_is_one_clean_line_before_any_process_starts(args: list[str], expected: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # What zeroq-train runs before it launches anything (compose, check, preflight), in this process; the
    # command's exit status and output for such an error: the test below.
    if "trainer=gpu" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    write_text(tmp_path / "small.txt", 600)
    (tmp_path / "binary.dat").write_bytes(b"a" * 2000 + b"\xff" * 8000)
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, RuntimeError)) as failed:
        preflight(to_run_config(compose_config(args)))
    line = config_error_line(failed.value)
    assert line.startswith(f"zeroq-train: error: {expected}") and "\n" not in line, line
    assert "[Hydra key: " in line


def test_a_bad_config_exits_2_with_one_line_and_starts_nothing(tmp_path: Path) -> None:
    proc = run_cli(["recipe=gpt1m_zero3_offload_params_nvme_cpu", "zero.nvme_path=/proc"], tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.startswith("zeroq-train: error: ZeroConfig.nvme_path='/proc' is not writable"), proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""  # one line, nothing else, no process started


def test_preflight_counts_the_ranks() -> None:
    # 4,128 bytes are exactly 32 windows: one batch of 16 on each of 2 ranks, not on 3.
    small = ["data.seq_len=128", "data.batch_size=16"]
    path = write_text(Path(os.environ.get("TMPDIR", "/tmp")) / f"zeroq-preflight-{os.getpid()}.txt", 4128)
    try:
        preflight(to_run_config(compose_config([*small, f"data.text_file={path}", "trainer.devices=2"])))
        with pytest.raises(ValueError, match=r"16 x 3 = 48 windows"):
            preflight(to_run_config(compose_config([*small, f"data.text_file={path}", "trainer.devices=3"])))
        with pytest.raises(ValueError, match=r"16 x 4 = 64 windows"):
            preflight(to_run_config(compose_config([*small, f"data.text_file={path}", "trainer.num_nodes=2"])))
    finally:
        path.unlink()


def test_help_says_what_the_tool_does(tmp_path: Path) -> None:
    proc = run_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("zeroq-train: train a small byte-level GPT with lightning_zeroq's ZeroQStrategy")
    assert "== Configuration groups ==" in proc.stdout and "recipe: gpt1m_lora_zero3_cpu, gpt1m_lora_zero3_offload_cpu, gpt1m_zero1_cpu" in proc.stdout


# ---------------------------------------------------------------------------- the launched ranks


def child_payload(run_dir: Path, label: str, overrides: list[str] = ()) -> dict:
    """The payload a zeroq-train parent in this process would hand its children."""
    with cli._children_inherit(to_run_config(compose_config(overrides)), run_dir, label):
        return json.loads(os.environ[CHILD_ENV])


def test_only_a_child_of_the_payloads_writer_accepts_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    genuine = child_payload(tmp_path, "parent")
    assert (genuine["parent_pid"], genuine["parent_start"]) == (os.getpid(), cli._start_time(os.getpid()))
    # This process is the child of os.getppid(): a payload written there is accepted.
    mine = genuine | {"parent_pid": os.getppid(), "parent_start": cli._start_time(os.getppid())}
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(CHILD_ENV, json.dumps(mine))
    assert inherited_payload() == mine
    assert capsys.readouterr().err == ""
    rejected = {
        "written by this process, not its parent": (genuine, "1", "not by this process's parent"),
        "the parent's pid, another start time (a reused pid)":
            (mine | {"parent_start": (mine["parent_start"] or 0) + 1}, "1", "not by this process's parent"),
        "no LOCAL_RANK": (mine, None, "LOCAL_RANK is not set"),
        "an old format": ({"config": {}, "run_dir": "/x", "label": "x"}, "1", "not a payload of this version"),
    }
    for case, (payload, local_rank, reason) in rejected.items():
        monkeypatch.setenv(CHILD_ENV, json.dumps(payload))
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK")
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert inherited_payload() is None, case
        assert CHILD_ENV not in os.environ, case
        err = capsys.readouterr().err
        assert err.startswith(f"zeroq-train: warning: ignoring {CHILD_ENV}: ") and reason in err, (case, err)


def test_a_stale_child_config_under_a_launcher_is_ignored(tmp_path: Path) -> None:
    # torchrun sets LOCAL_RANK on every rank; a ZEROQ_CHILD_CONFIG left in the environment (here one
    # written by a process that has exited) must not replace the command line.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = child_payload(tmp_path / "old", "STALE", ["trainer.max_steps=3"]) | {"parent_pid": dead.pid}
    launcher_env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", CHILD_ENV: json.dumps(stale)}
    proc = run_cli(["trainer.max_steps=7", "--cfg", "job"], tmp_path, extra_env=launcher_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OmegaConf.create(proc.stdout).trainer.max_steps == 7
    assert f"zeroq-train: warning: ignoring {CHILD_ENV}: it was written by process {dead.pid}" in proc.stderr


def test_a_run_logs_to_its_dir_and_its_ranks_get_the_config_verbatim(tmp_path: Path) -> None:
    # A literal "${" (escaped for Hydra as "\${") next to a ${hydra:...} interpolation, which only
    # resolves under Hydra: the parent resolves once, the launched rank must not resolve again.
    text_dir = tmp_path / "texts ${x}"
    text_dir.mkdir()
    # 5,000 bytes: 38 windows, one batch of 16 per rank (so Lightning warns about log_every_n_steps=10).
    write_text(text_dir / "t.txt", 5000)
    proc = run_cli(["trainer.max_steps=2", "trainer.enable_progress_bar=false", "hydra.run.dir=run",
                    r"data.text_file=${hydra:runtime.cwd}/texts \${x}/t.txt"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ignoring " + CHILD_ENV not in proc.stderr  # the launched rank trained on the parent's payload
    summary = [line for line in proc.stdout.splitlines() if line.startswith(SUMMARY_PREFIX)]
    assert len(summary) == 1 and "| 2 steps on 2 ranks |" in summary[0], proc.stdout
    log = (tmp_path / "run" / "zeroq-train.log").read_text()
    for expected in (
        f"[lightning_zeroq.cli][INFO] - {summary[0]}",  # the summary line
        f"ZeRO stage 2, data {text_dir / 't.txt'}, cpu x 2",  # the header line, with the path verbatim
        "[INFO] - Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2",  # Lightning's rank-0 info
        "[py.warnings][WARNING] - ",  # a warning
        "smaller than the logging interval Trainer(log_every_n_steps=10)",
    ):
        assert expected in log, f"{expected!r} not in zeroq-train.log:\n{log}"


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


def test_the_summary_counts_the_steps_the_engine_skipped() -> None:
    # fp16 overflows (and nonfinite_gradients="skip") skip steps; the summary says how many, read from
    # the engine when training ends.
    from types import SimpleNamespace

    from lightning_zeroq.cli.train import RunRecorder, TrainResult

    recorder = RunRecorder()
    trainer = SimpleNamespace(strategy=SimpleNamespace(engine=SimpleNamespace(skipped_steps=3)))
    recorder.on_train_end(trainer, None)  # type: ignore[arg-type]
    assert recorder.skipped_steps == 3
    result = TrainResult(label="x", world_size=2, num_parameters=10, losses=[1.0], tokens_per_s=1.0,
                         peak_memory_bytes=[2**20], memory_kind="max RSS", skipped_steps=recorder.skipped_steps)
    assert result.summary().endswith("| skipped steps 3")
