"""Run named benchmark suites (``benchmarks/suites.py``) and write their results, each file with the commit,
the command and the hardware inside.

    python benchmarks/suite.py --list                      # the suites, what each measures, their time limits
    python benchmarks/suite.py links --dry-run             # the commands, without running them
    python benchmarks/suite.py links --launch 2            # only its second launch (one machine call each)
    python benchmarks/suite.py links offload --out results # run; results in results/ (default: $OUT)

Every launch calls a script of this folder through its command line (``torchrun --nproc-per-node N
benchmarks/step_time.py --arms ...``) with its own time limit, so a slow launch costs only itself. Results
go to ``<out>/<benchmark>_<hardware>_<date>.jsonl`` (``.txt`` for benchmarks that print text), e.g.
``step_time_2xh200_2026-12-01.jsonl``; hardware is ``<n>x<gpu>`` from ``nvidia-smi`` (``cpu`` without a GPU
and for the host suites), the date is UTC. A file that exists is appended to. A JSON-lines file holds:

- ``{"header": {...}}``: suite, commit (``git describe``-style, ``+dirty`` with uncommitted changes),
  the driver's command, hardware (GPUs, CPU model, cores), torch and Python versions, start time;
- per launch ``{"launch": {...}}`` (its command line, environment, link, world size, time limit), the
  JSON lines the script printed, then ``{"end": {"rc": ..., "wall_s": ...}}`` (rc 124: time limit reached);
- ``{"table": [...]}``: the short table also printed at the end.

Text files carry the same header and launch lines as ``# `` comments. What a launch prints that is not a
JSON line goes to ``<benchmark>_<hardware>_<date>.log`` beside it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suites import BASE_ENV, LINKS, SUITES, TABLE_COLUMNS, Launch, Suite

REPO = Path(__file__).resolve().parents[1]
BUILD = ("-c", "from lightning_zeroq.ops._load import main; raise SystemExit(main())")
NAME = re.compile(r"^[a-z0-9_]+_(cpu|\d+x[a-z0-9]+)_\d{4}-\d{2}-\d{2}\.(jsonl|txt|log|md)$")


def gpus() -> list[str]:
    """The GPUs' names from nvidia-smi (those of CUDA_VISIBLE_DEVICES where it is set); [] without."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = [line.strip() for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [n for i, n in enumerate(names) if str(i) in visible.split(",")]
    return names


def hardware_tag(names: list[str]) -> str:
    """``2xh200`` for two NVIDIA H200s, ``cpu`` for none."""
    if not names:
        return "cpu"
    words = [w for w in re.split(r"[\s-]+", names[0].lower()) if w not in ("nvidia", "amd", "geforce", "tesla", "rtx")]
    model = re.sub(r"[^a-z0-9]", "", words[0]) if words else "gpu"
    return f"{len(names)}x{model}"


def results_name(bench: str, hardware: str, date: str, output: str = "jsonl") -> str:
    name = f"{bench}_{hardware}_{date}.{'jsonl' if output == 'jsonl' else 'txt'}"
    if not NAME.match(name):
        raise ValueError(f"results name {name!r} does not follow <benchmark>_<hardware>_<date>: "
                         "use lower-case letters, digits and '_' in the benchmark and hardware names")
    return name


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit(repo: Path = REPO) -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip()
    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v
    try:
        return v(module)
    except PackageNotFoundError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world(launch: Launch, override: int | None) -> int | None:
    """The launch's world size (None: a plain process), or ``override`` for a torchrun launch."""
    return launch.world_size if override is None or launch.world_size is None else override


def command(launch: Launch, world_size: int | None, port: int | None = None) -> list[str]:
    """The command line of a launch (placeholders still in); ``world_size`` overrides the launch's."""
    ws = world(launch, world_size)
    if ws is None:
        return ["python", *launch.argv]
    return ["torchrun", "--nproc-per-node", str(ws), "--master-port", str(port or 29500), *launch.argv]


def placeholders(scratch: Path, out: Path, cores: int, world_size: int | None) -> dict[str, str]:
    return {"scratch": str(scratch), "out": str(out), "cores": str(cores),
            "threads": str(max(1, cores // (world_size or 1)))}


def fill(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def environment(launch: Launch, values: dict[str, str]) -> dict[str, str]:
    env = dict(BASE_ENV)
    env.update(LINKS.get(launch.link or "", {}))
    if launch.link:
        env["BENCH_LINK"] = launch.link
    env.update({k: fill(v, values) for k, v in launch.env.items()})
    return env


def table(bench: str, records: list[dict]) -> list[str]:
    """A short fixed-width table of the records' main columns."""
    rows = [r for r in records if not r.get("error")] or records
    if not rows:
        return []
    cols = [c for c in TABLE_COLUMNS.get(bench, ()) if any(c in r for r in rows)] or list(rows[0])[:5]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return [fmt.format(*cols), *(fmt.format(*row) for row in cells)]


class Results:
    """The results files of one run of the driver, opened as benchmarks write into them."""

    def __init__(self, out: Path, hardware: str, date: str, header: dict):
        self.out, self.hardware, self.date, self.header = out, hardware, date, header
        self.records: dict[str, list[dict]] = {}
        self.files: dict[str, Path] = {}

    def path(self, launch: Launch) -> Path:
        if launch.bench not in self.files:
            hw = self.hardware if self.header["suite_gpu"] else "cpu"
            path = self.out / results_name(launch.bench, hw, self.date, launch.output)
            header = {k: v for k, v in self.header.items() if k != "suite_gpu"}
            header["benchmark"] = launch.bench
            self.write(path, launch, {"header": header})
            self.files[launch.bench] = path
        return self.files[launch.bench]

    def write(self, path: Path, launch: Launch, record: dict | str) -> None:
        with open(path, "a") as f:
            if isinstance(record, str):
                f.write(record if record.endswith("\n") else record + "\n")
            elif launch.output == "jsonl":
                f.write(json.dumps(record) + "\n")
            else:
                f.write("# " + json.dumps(record) + "\n")

    def log(self, launch: Launch) -> Path:
        return self.path(launch).with_suffix(".log")


def run_launch(launch: Launch, results: Results, values: dict[str, str], world_size: int | None,
               pythonpath: str, repo: Path = REPO) -> int:
    port = free_port()
    cmd = [fill(a, values) for a in command(launch, world_size, port)]
    env = environment(launch, values)
    path = results.path(launch)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in BASE_ENV)
    line = (shown + " " if shown else "") + shlex.join(cmd)
    missing = [m for m in launch.requires if importlib.util.find_spec(m) is None]
    meta = {"command": line, "link": launch.link, "world_size": world(launch, world_size), "timeout_s": launch.timeout}
    if missing:
        results.write(path, launch, {"launch": meta, "skipped": f"{', '.join(missing)} not installed"})
        print(f"skipped ({', '.join(missing)} not installed): {line}", flush=True)
        return 0
    results.write(path, launch, {"launch": meta})
    print(f"$ {line}", flush=True)
    argv = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]] if cmd[0] == "torchrun" else \
        [sys.executable, *cmd[1:]]
    full_env = {**os.environ, **env, "PYTHONPATH": pythonpath}
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=repo, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = start + launch.timeout
    timed_out = False

    def kill(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # torchrun and its ranks: the launch's own process group
        except ProcessLookupError:
            pass

    def stop() -> None:  # at the time limit: SIGTERM (ranks clean up swap files), SIGKILL 10 s later
        nonlocal timed_out
        timed_out = True
        kill(signal.SIGTERM)
        hard = threading.Timer(10.0, kill, (signal.SIGKILL,))
        hard.daemon = True
        hard.start()

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop)
    timer.start()
    try:
        with open(results.log(launch) if launch.output == "jsonl" else os.devnull, "a") as log:
            log.write(f"$ {line}\n")
            for text in proc.stdout:  # type: ignore[union-attr]
                if launch.output == "text":
                    results.write(path, launch, text)
                    continue
                stripped = text.strip()
                if stripped.startswith("{"):
                    try:
                        record = json.loads(stripped)
                    except json.JSONDecodeError:
                        record = None
                    if isinstance(record, dict):
                        results.write(path, launch, record)
                        results.records.setdefault(launch.bench, []).append(record)
                        print(stripped[:300], flush=True)
                        continue
                log.write(text)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # the driver was interrupted
            kill(signal.SIGKILL)
    rc = 124 if timed_out else rc
    wall = round(time.monotonic() - start, 1)
    results.write(path, launch, {"end": {"rc": rc, "wall_s": wall}})
    if rc:
        print(f"exit {rc} after {wall} s{' (time limit reached)' if timed_out else ''}; output: "
              f"{results.log(launch) if launch.output == 'jsonl' else path}", flush=True)
    return rc


def install_wheels(folder: Path, target: Path) -> None:
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"suite.py: error: --wheels {folder}: no .whl files there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="*", help="suite names (--list shows them)")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and the results files, run nothing")
    parser.add_argument("--launch", type=int, default=None, metavar="K",
                        help="run only the K-th launch of the one suite named (1-based; --dry-run lists them), "
                             "e.g. to fit a machine's time limit per call")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "zeroq_bench"),
                        help="results folder (default: $OUT, else a temp folder)")
    parser.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "zeroq_bench_scratch"),
                        help="folder for checkpoints, swap files and snapshots")
    parser.add_argument("--world-size", type=int, default=None,
                        help="run every torchrun launch at this world size instead of the suite's")
    parser.add_argument("--hardware", default=None, help="the hardware part of result names (default: from nvidia-smi)")
    parser.add_argument("--date", default=None, help="the date part of result names (default: today, UTC)")
    parser.add_argument("--repo", default=str(REPO),
                        help="run the scripts and package of this checkout (default: the one holding suite.py), "
                             "e.g. an earlier commit checked out with 'git worktree add'; its commit goes in the "
                             "header")
    parser.add_argument("--wheels", default=None,
                        help="a folder of .whl files (e.g. DeepSpeed) to install into the scratch folder first, "
                             "without a package index")
    args = parser.parse_args(argv)

    if args.list:
        for name, suite in SUITES.items():
            limit = sum(launch.timeout for launch in suite.launches)
            print(f"{name:10} {len(suite.launches):2} launches, <= {limit:5d} s  {suite.about}")
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown or not args.suites:
        parser.error(f"unknown suite {unknown[0]!r}: use one of {', '.join(SUITES)}" if unknown else
                     f"name a suite: {', '.join(SUITES)}")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: use 1 or more")
    if args.launch is not None:
        if len(args.suites) != 1:
            parser.error(f"--launch {args.launch}: name one suite (it picks one of that suite's launches)")
        count = len(SUITES[args.suites[0]].launches)
        if not 1 <= args.launch <= count:
            parser.error(f"--launch {args.launch}: {args.suites[0]} has launches 1 to {count}")

    def launches(suite: Suite) -> tuple[Launch, ...]:
        return suite.launches if args.launch is None else (suite.launches[args.launch - 1],)
    if args.date is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.date):
        parser.error(f"--date {args.date!r}: use YYYY-MM-DD")
    if args.hardware is not None and not re.fullmatch(r"cpu|\d+x[a-z0-9]+", args.hardware):
        parser.error(f"--hardware {args.hardware!r}: use 'cpu' or <count>x<gpu>, e.g. 2xh200")

    repo = Path(args.repo).resolve()
    if not (repo / "benchmarks").is_dir() or not (repo / "lightning_zeroq").is_dir():
        parser.error(f"--repo {args.repo}: not a checkout of this project (no benchmarks/ and lightning_zeroq/ there)")
    names = gpus()
    hardware = args.hardware or hardware_tag(names)
    date = args.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out, scratch = Path(args.out).resolve(), Path(args.scratch).resolve()
    cores = os.cpu_count() or 1
    driver_command = shlex.join(["python", "benchmarks/suite.py", *(argv if argv is not None else sys.argv[1:])])

    if args.dry_run:
        if repo != REPO:
            print(f"# in {repo} (commit {commit(repo)})")
        for name in args.suites:
            suite = SUITES[name]
            print(f"# {name}: {suite.about}")
            if suite.build and names:
                print(f"python {shlex.join(BUILD)}")
            for launch in launches(suite):
                values = placeholders(scratch, out, cores, world(launch, args.world_size))
                env = environment(launch, values)
                shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in BASE_ENV)
                cmd = shlex.join(fill(a, values) for a in command(launch, args.world_size))
                req = f"  # needs {', '.join(launch.requires)}" if launch.requires else ""
                hw = hardware if suite.gpu else "cpu"
                print(f"timeout {launch.timeout} {shown + ' ' if shown else ''}{cmd}{req}")
                print(f"  -> {out / results_name(launch.bench, hw, date, launch.output)}")
        return 0

    gpu_suites = [s for s in args.suites if SUITES[s].gpu]
    if gpu_suites and not names:
        print(f"warning: no GPU found (nvidia-smi); {', '.join(gpu_suites)} will run on the CPU, if at all",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    pythonpath = str(repo) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    if args.wheels:
        site = scratch / "site"
        install_wheels(Path(args.wheels), site)
        pythonpath += os.pathsep + str(site)
        sys.path.append(str(site))
        importlib.invalidate_caches()
    failed = 0
    for name in args.suites:
        suite = SUITES[name]
        header = {"suite": name, "about": suite.about, "commit": commit(repo), "command": driver_command,
                  "hardware": {"gpus": names, "cpu": cpu_model(), "cores": cores, "host": platform.node()},
                  "torch": version("torch"), "lightning": version("lightning"), "python": platform.python_version(),
                  "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "suite_gpu": suite.gpu}
        results = Results(out, hardware, date, header)
        print(f"# {name}: {suite.about}", flush=True)
        if suite.build and names:
            build = subprocess.run([sys.executable, *BUILD], cwd=repo, env={**os.environ, "PYTHONPATH": pythonpath},
                                   capture_output=True, text=True, timeout=300, check=False)
            print("CUDA extension: " + ((build.stdout + build.stderr).strip().splitlines() or ["?"])[-1], flush=True)
        for launch in launches(suite):
            values = placeholders(scratch, out, cores, world(launch, args.world_size))
            failed += run_launch(launch, results, values, args.world_size, pythonpath, repo) != 0
        for bench, path in results.files.items():
            rows = table(bench, results.records.get(bench, []))
            if rows:
                with open(path, "a") as f:
                    f.write(json.dumps({"table": rows}) + "\n")
                print(f"\n{path.name}:\n" + "\n".join(rows), flush=True)
            else:
                print(f"\n{path.name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
