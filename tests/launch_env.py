"""The environment for a test's own launch of a multi-process job (Lightning's subprocess launcher, torchrun):
without the variables a launch sets (``MASTER_PORT`` and the like), which an earlier test or the pytest process
may hold. An inherited ``MASTER_PORT`` names a port that the operating system may since have given to another
socket (a worker pool's): rank 0 then cannot bind it and the rank it started waits on a stranger."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def launch_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without the launch variables, with the repository first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
