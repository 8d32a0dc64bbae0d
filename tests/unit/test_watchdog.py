"""The watchdog's diagnosis (``common/watchdog.py``) from the beats in the store, without processes: a rank
never names itself as unheard, and a store that cannot be reached is said to be gone (rank 0 ended)."""

from __future__ import annotations

import json
import os
import socket
import time

from lightning_zeroq.common.watchdog import PREFIX, Watchdog


class DictStore:
    def __init__(self, values: dict) -> None:
        self.values = values

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys: list) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


class GoneStore:
    """The store of a process that was killed: every call fails (as a TCPStore whose server is gone)."""

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")

    check = get = set


def _beat(age_s: float, waiting: bool = True) -> bytes:
    return json.dumps({"t": time.time() - age_s, "pid": os.getpid(), "host": socket.gethostname(),
                       "waiting": waiting, "at": "train.py:1 in step"}).encode()


def test_a_rank_never_names_itself_unheard() -> None:
    # Rank 1 asks; its own beat is old (its watchdog thread was held up) and rank 0 never beat.
    store = DictStore({f"{PREFIX}beat/1": _beat(age_s=60)})
    diagnosis = Watchdog(store, rank=1, world_size=2, timeout_s=3).diagnose()
    assert "rank 0 stopped" in diagnosis, diagnosis
    assert "rank 1" not in diagnosis, diagnosis


def test_with_the_store_gone_the_diagnosis_names_rank_0_not_itself() -> None:
    # Rank 0 was SIGKILLed with the store it hosts: rank 1 can read no beat at all.
    diagnosis = Watchdog(GoneStore(), rank=1, world_size=2, timeout_s=3).diagnose()
    assert "rank 1" not in diagnosis, diagnosis
    assert "rank 0" in diagnosis and "store" in diagnosis, diagnosis


def test_the_report_names_rank_0_when_the_store_is_gone() -> None:
    watchdog = Watchdog(GoneStore(), rank=1, world_size=2, timeout_s=3, interval_s=0.01)
    message = watchdog.report(RuntimeError("Connection closed by peer"))
    assert "rank 1 stopped" not in message and "rank 0" in message, message
