"""The benchmark driver (``benchmarks/suite.py``): every shipped suite's commands name scripts that exist and
flags (and step_time arms) those scripts accept; results files are named ``<benchmark>_<hardware>_<date>`` and
carry the commit, the command, the launches and a table; a launch over its time limit is stopped."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import suite as driver
import suites

DATE = "2026-12-01"


def _dry_run(*args: str) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert driver.main(["--dry-run", "--hardware", "2xh200", "--date", DATE, *args]) == 0
    return buf.getvalue()


@pytest.mark.parametrize("name", list(suites.SUITES))
def test_dry_run_prints_each_launch_and_its_results_file(name, tmp_path):
    out = _dry_run(name, "--out", str(tmp_path), "--scratch", str(tmp_path / "scratch"))
    commands = [line for line in out.splitlines() if line.startswith("timeout ")]
    targets = [line.split("-> ", 1)[1] for line in out.splitlines() if line.startswith("  -> ")]
    launches = suites.SUITES[name].launches
    assert len(commands) == len(targets) == len(launches) > 0, out
    for line, target, launch in zip(commands, targets, launches):
        words = shlex.split(line)
        assert words[1] == str(launch.timeout)
        env = dict(w.split("=", 1) for w in words[2:] if re.match(r"^[A-Z0-9_]+=", w))
        cmd = [w for w in words[2:] if not re.match(r"^[A-Z0-9_]+=", w)]
        assert {k: env[k] for k in suites.LINKS[launch.link]} == suites.LINKS[launch.link] if launch.link else True
        if launch.world_size is None:
            assert cmd[0] == "python"
        else:
            assert cmd[:3] == ["torchrun", "--nproc-per-node", str(launch.world_size)], line
        script = next(a for a in cmd if a.endswith(".py") or a.startswith(("benchmarks.", "lightning_zeroq.", "pytest")))
        path = REPO / (script if script.endswith(".py") else script.replace(".", "/") + ".py")
        assert script == "pytest" or path.is_file(), f"{name}: {script} does not exist"
        assert "{" not in " ".join(cmd), f"placeholder left in {line}"
        hardware = "2xh200" if suites.SUITES[name].gpu else "cpu"
        assert Path(target).parent == tmp_path
        assert Path(target).name == f"{launch.bench}_{hardware}_{DATE}.{'jsonl' if launch.output == 'jsonl' else 'txt'}"
        assert driver.NAME.match(Path(target).name)


def test_dry_run_of_one_launch_and_its_bad_values(capsys):
    out = _dry_run("compile-2gpu", "--launch", "2")
    commands = [line for line in out.splitlines() if line.startswith("timeout ")]
    assert len(commands) == 1 and "BENCH_LINK=socket" in commands[0], out
    for bad, said in ((["compile-2gpu", "--launch", "3"], "compile-2gpu has launches 1 to 2"),
                      (["compile-2gpu", "links", "--launch", "1"], "name one suite")):
        with pytest.raises(SystemExit) as error:
            driver.main(["--dry-run", *bad])
        assert error.value.code == 2 and said in capsys.readouterr().err


def test_dry_run_world_size_override_and_bad_values():
    out = _dry_run("checkpoint", "--world-size", "8")
    assert "torchrun --nproc-per-node 8 " in out
    for bad in (["nosuch"], ["links", "--world-size", "0"], ["links", "--date", "1.12.2026"],
                ["links", "--hardware", "H200 x2"]):
        with pytest.raises(SystemExit) as error:
            driver.main(["--dry-run", *bad])
        assert error.value.code == 2


class _Parsed(Exception):
    pass


def _launches():
    seen = {}
    for name, s in suites.SUITES.items():
        for launch in s.launches:
            seen.setdefault(launch.argv, (name, launch))
    return list(seen.values())


def test_every_launch_is_accepted_by_its_script(monkeypatch, tmp_path):
    """Each distinct command line of every suite is parsed by its script's own parser (strictly: an
    unknown flag or bad value fails), and step_time arms by step_time's ``parse_arm``."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    values = driver.placeholders(tmp_path, tmp_path, 4, 2)
    modules = {}
    step_time = None
    for name, launch in _launches():
        argv = [driver.fill(a, values) for a in launch.argv]
        if argv[:2] == ["-m", "pytest"]:
            assert (REPO / argv[-1]).exists() and "gpu" in (REPO / "pyproject.toml").read_text() + \
                (REPO / "tests" / "conftest.py").read_text()
            continue
        script = argv[1].replace(".", "/") + ".py" if argv[0] == "-m" else argv[0]
        rest = argv[2:] if argv[0] == "-m" else argv[1:]
        if script not in modules:
            spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", REPO / script)
            modules[script] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[script])
        module = modules[script]
        monkeypatch.setattr(sys, "argv", [script, *rest])
        with pytest.raises(_Parsed) as parsed:
            module.main()
        args = parsed.value.args[0]
        if hasattr(args, "arms") and Path(script).stem in ("step_time", "memory_account"):
            step_time = step_time or modules.setdefault("benchmarks/step_time.py", _load("benchmarks/step_time.py"))
            for arm in args.arms.split(","):
                step_time.parse_arm(arm)  # raises on an arm step_time does not know
        if Path(script).stem == "checkpoints" and args.command == "save-load":
            assert set(args.arms.split(",")) <= set(module.ARMS), f"{name}: {args.arms}"
    assert {"benchmarks/step_time.py", "benchmarks/checkpoints.py", "benchmarks/kernels.py"} <= set(modules)


def _load(script: str):
    spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_writes_header_launches_and_table(monkeypatch, tmp_path):
    """Two launches through the driver: one printing JSON lines and text, one stopped at its time limit."""
    lines = 'import json; print("warming up"); [print(json.dumps({"arm": a, "step_s_median": t})) for a, t in ' \
            '(("zeroq2", 0.06), ("zeroq3", 0.07))]'
    monkeypatch.setitem(suites.SUITES, "tiny-test", suites.Suite("a test", (
        suites.Launch("step_time", ("-c", lines), timeout=60),
        suites.Launch("step_time", ("-c", "import time; print('{\"arm\": \"sleeper\"}', flush=True); time.sleep(60)"),
                      timeout=2, link="socket")), gpu=False))
    monkeypatch.setattr(driver, "SUITES", suites.SUITES)
    with redirect_stdout(io.StringIO()) as printed:
        rc = driver.main(["tiny-test", "--out", str(tmp_path), "--scratch", str(tmp_path / "s"), "--date", DATE])
    assert rc == 1  # the second launch reached its limit
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert files == [f"step_time_cpu_{DATE}.jsonl", f"step_time_cpu_{DATE}.log"], files
    records = [json.loads(line) for line in (tmp_path / files[0]).read_text().splitlines()]
    header = records[0]["header"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip()
    assert header["commit"].split("+")[0] == head
    assert header["command"].startswith("python benchmarks/suite.py tiny-test")
    assert header["benchmark"] == "step_time" and header["torch"] and header["hardware"]["cores"] >= 1
    launches = [r["launch"] for r in records if "launch" in r]
    assert [lc["command"].split()[0] for lc in launches] == ["python", "BENCH_LINK=socket"]
    assert "NCCL_SOCKET_IFNAME=lo" in launches[1]["command"]
    ends = [r["end"] for r in records if "end" in r]
    assert [e["rc"] for e in ends] == [0, 124]  # 124: stopped at its limit (it sleeps for a minute)
    assert [r["arm"] for r in records if "arm" in r] == ["zeroq2", "zeroq3", "sleeper"]
    assert "warming up" in (tmp_path / files[1]).read_text()
    table = records[-1]["table"]
    assert table[0].split() == ["arm", "step_s_median"] and table[1].split() == ["zeroq2", "0.06"]
    assert "time limit reached" in printed.getvalue()


def test_stored_results_follow_the_naming():
    names = [p.name for p in (REPO / "benchmarks" / "results").iterdir()]
    assert names and all(driver.NAME.match(n) for n in names), [n for n in names if not driver.NAME.match(n)]
    assert driver.hardware_tag(["NVIDIA H200", "NVIDIA H200"]) == "2xh200"
    assert driver.hardware_tag(["NVIDIA A100-SXM4-80GB"]) == "1xa100"
    assert driver.hardware_tag([]) == "cpu"
    with pytest.raises(ValueError, match="<benchmark>_<hardware>_<date>"):
        driver.results_name("step-time", "2xh200", DATE)


def test_the_script_tables_name_every_script_and_its_suites():
    """``benchmarks/README.md`` and ``docs/benchmarks.md`` say in one table which script measures what and
    which suites run it: every script in ``benchmarks/`` has a row there, with the suites that launch it (not
    the driver, its suites, and ``commands.py``, the command line of the scripts with several commands)."""
    runs: dict[str, set[str]] = {}
    for name, s in suites.SUITES.items():
        for launch in s.launches:
            script = launch.argv[1].split(".")[-1] + ".py" if launch.argv[0] == "-m" else Path(launch.argv[0]).name
            runs.setdefault(script, set()).add(name)
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")} - {"suite.py", "suites.py", "commands.py"}
    for doc in (REPO / "benchmarks" / "README.md", REPO / "docs" / "benchmarks.md"):
        rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+\.py)` \|.*\| ([^|]*) \|[^|]*\|$",
                                                             doc.read_text(), re.M)}
        assert set(rows) == scripts, f"{doc.name}: {sorted(set(rows) ^ scripts)}"
        for script, cell in rows.items():
            assert set(re.findall(r"`([\w-]+)`", cell)) == runs.get(script, set()), f"{doc.name}: {script}: {cell}"
