"""Two independent runs saving to the same path at once (two jobs sharing a checkpoint directory): every
save succeeds, the path holds the last one published, complete, and no temporary directory is left behind. A save's cleanup of leftovers never removes another
save's temporary directory while that save is in progress (``atomic.create_owned``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.dist_pool import REPO_ROOT

pytestmark = pytest.mark.launch  # starts processes of its own: outside the fast tier

SAVES = 25

CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from lightning_zeroq.checkpoint import atomic
    from lightning_zeroq.checkpoint.engine_io import save_engine
    from tests.integration.checkpoint.test_faults import _engine
    atomic.exchange_supported = None if {exchange} else False
    path, sync, me = Path({path!r}), Path({sync!r}), {me}
    engine = _engine(seed=me)
    (sync / f"ready{{me}}").touch()
    while not all((sync / f"ready{{r}}").exists() for r in (0, 1)):  # start the loops together
        time.sleep(0.01)
    outcomes = []
    for i in range({saves}):
        try:
            save_engine(engine, path, trainer_state={{"writer": me, "save": i}})
        except Exception as error:
            outcomes.append(f"save {{i}} failed: {{type(error).__name__}}: {{error}}")
            continue
        # With the exchange a checkpoint is always at the path once one was (this one, or a later one); with
        # two renames the other run may be between its renames.
        outcomes.append("ok" if not {exchange} or (path / "zeroq.json").is_file() else f"save {{i}}: path empty")
    print("OUTCOMES " + json.dumps(outcomes))
""")


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_two_runs_saving_the_same_path_lose_nothing(tmp_path, exchange):
    from lightning_zeroq.checkpoint.engine_io import load_engine
    from tests.integration.checkpoint.test_faults import _engine

    root, sync = tmp_path / "ckpts", tmp_path / "sync"
    root.mkdir()
    sync.mkdir()
    path = root / "last.ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", CHILD.format(root=REPO_ROOT, path=str(path), sync=str(sync),
                                                                 me=me, saves=SAVES, exchange=exchange)],
                             env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for me in (0, 1)]
    outputs = []
    for run in runs:
        try:
            outputs.append(run.communicate(timeout=300)[0])
        finally:
            run.kill()
    for me, (run, output) in enumerate(zip(runs, outputs)):
        assert run.returncode == 0, output[-3000:]
        line = next(line for line in output.splitlines() if line.startswith("OUTCOMES "))
        outcomes = json.loads(line.removeprefix("OUTCOMES "))
        failed = [o for o in outcomes if o != "ok"]
        assert not failed, f"run {me}: {len(failed)} of {SAVES} saves failed or were lost: {failed[:3]}"
    state = load_engine(_engine(seed=3), path)
    assert state["writer"] in (0, 1) and state["save"] == SAVES - 1, state  # the last save of one of them
    assert sorted(p.name for p in root.iterdir()) == ["last.ckpt"], "leftovers of the saves remain"


def test_a_temporary_directory_removed_before_it_is_opened_is_made_again(tmp_path, monkeypatch):
    """Another save's cleanup can remove a fresh temporary directory between its ``mkdir`` and the
    ``open`` that locks it (seen once in 25 saves of two runs): the save makes it again."""
    import os

    from lightning_zeroq.checkpoint import atomic

    tmp = tmp_path / "ckpts" / ".last.ckpt.zeroq-tmp-0123"
    real_open, opened = os.open, []

    def racing_open(path, flags, *args, **kwargs):
        if str(path) == str(tmp) and not opened:
            opened.append(True)
            os.rmdir(path)  # the other save's cleanup, just after the mkdir
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    fd = atomic.create_owned(tmp)
    assert opened and tmp.is_dir()
    atomic.release(fd)
