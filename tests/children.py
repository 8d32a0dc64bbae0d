"""Signalling a child process that waits on its stdin for the test."""

from __future__ import annotations

import subprocess


def signal_and_wait(child: "subprocess.Popen[str]", signum: int, timeout: float = 60) -> tuple[str, str]:
    """Send ``signum`` and wait for the child to end with its stdin still open, then return its output. The
    child waits on stdin, so the signal is its only way out: closed first (as ``communicate`` does), the
    child could read the end of stdin and go on, or finish, before its handler ran."""
    child.send_signal(signum)
    try:
        child.wait(timeout=timeout)
    finally:
        if child.returncode is None:
            child.kill()
        out, err = child.communicate(timeout=timeout)
    return out, err
