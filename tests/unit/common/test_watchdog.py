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


def _gathers_beat(n: int, last: list, now=None) -> bytes:
    beat = json.loads(_beat(age_s=0))
    beat.update(inside=True, still=10.0, gathers={"n": n, "last": last, "now": now})
    return json.dumps(beat).encode()


def test_a_timeout_names_the_stage3_unit_the_ranks_gathered_differently() -> None:
    # Rank 0 ran a module rank 1 skipped: its gather #3 was net.extra where rank 1's was net.head; both then wait.
    store = DictStore({f"{PREFIX}beat/0": _gathers_beat(5, ["net.embed", "net.body", "net.extra", "net.head",
                                                             "net.head"], now="net.head"),
                       f"{PREFIX}beat/1": _gathers_beat(4, ["net.embed", "net.body", "net.head", "net.head"])})
    diagnosis = Watchdog(store, rank=1, world_size=2, timeout_s=30).diagnose()
    assert "at their stage-3 gather #3, rank 0 gathered 'net.extra'; rank 1 gathered 'net.head'" in diagnosis, diagnosis
    message = Watchdog(store, rank=1, world_size=2, timeout_s=30, interval_s=0.01).report(
        RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
    assert "rank 0 gathered 'net.extra'; rank 1 gathered 'net.head'" in message and "(30 s)" in message, message


def test_a_rank_in_a_gather_the_others_are_not_in_is_named() -> None:
    # Rank 1 is in its gather #4 (net.extra), rank 0 did 3 gathers as rank 1 did and waits in another collective.
    store = DictStore({f"{PREFIX}beat/0": _gathers_beat(3, ["a", "b", "c"]),
                       f"{PREFIX}beat/1": _gathers_beat(4, ["a", "b", "c", "net.extra"], now="net.extra")})
    diagnosis = Watchdog(store, rank=0, world_size=2, timeout_s=30).diagnose()
    assert "gather #4, rank 0 did not gather any unit; rank 1 gathered 'net.extra'" in diagnosis, diagnosis


def test_ranks_in_the_same_gathers_are_not_named_for_it() -> None:
    store = DictStore({f"{PREFIX}beat/{r}": _gathers_beat(3, ["a", "b", "c"], now="c") for r in range(2)})
    diagnosis = Watchdog(store, rank=0, world_size=2, timeout_s=30).diagnose()
    assert "stage-3" not in diagnosis, diagnosis


def test_a_signal_the_main_thread_acted_on_is_forgotten_and_one_it_cannot_act_on_ends_the_rank() -> None:
    # Where the main thread stands is what the watchdog samples (``_main_key``); here it is given: standing
    # still (blocked in one C call, as in a hung collective, where no handler can run) or moving on after the
    # signal (a handler that let training continue, as a user's SIGTERM handler may). The real sampling is
    # exercised by the launches of ``tests/integration/lightning/test_signals.py``.
    import itertools
    import signal

    for moving, ends in ((False, True), (True, False)):
        watchdog = Watchdog(DictStore({}), rank=0, world_size=1, timeout_s=30)
        steps = itertools.count()
        watchdog._main_key = steps.__next__ if moving else (lambda: "blocked")  # type: ignore[method-assign]
        watchdog._signalled, watchdog._signal_key = signal.SIGTERM, watchdog._main_key()
        watchdog._signal_at = time.monotonic() - 60  # long past STILL_S
        assert watchdog._signal_unheeded() is ends
        assert (watchdog._signalled is None) is moving
        assert watchdog._signal_unheeded() is ends  # forgotten for good, or still standing
