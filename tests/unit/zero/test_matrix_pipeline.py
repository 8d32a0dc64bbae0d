"""A matrix optimizer's batches are pipelined (``step.step_matrix_batches``): batch k+1's step starts
before batch k's finishes and is published, and a batch that fails to start still finishes and publishes
the one before it, so no unit is left half stepped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_zeroq.zero import step as step_module


class _Unit(int):
    """A unit as the pipeline sees it: its index (and itself in the events)."""

    @property
    def index(self) -> int:
        return int(self)


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.events: list[str] = []
        self.fail_at = fail_at

    def start(self, binding, batch, used, source, group, device):
        (unit,) = batch
        if unit == self.fail_at:
            self.events.append(f"start {unit} failed")
            raise ValueError(f"unit {unit}")
        self.events.append(f"start {unit}")
        return lambda: self.events.append(f"apply {unit}")


def _run(monkeypatch: pytest.MonkeyPatch, recorder: Recorder, units: list[int]) -> bool:
    monkeypatch.setattr(step_module, "start_matrices", recorder.start)
    placement = SimpleNamespace(step_batches=lambda units: ([u] for u in units))
    gatherer = SimpleNamespace(
        wire=SimpleNamespace(group=None), device="cpu",
        publish=lambda unit, spans: recorder.events.append(f"publish {unit}"),
    )
    one_step = SimpleNamespace(step=lambda: recorder.events.append("optimizer.step"))
    binding = SimpleNamespace(optimized={u: [] for u in units})
    return step_module.step_matrix_batches(one_step, binding, [_Unit(u) for u in units], placement, gatherer, [])


def test_the_next_batch_starts_before_this_one_finishes(monkeypatch) -> None:
    recorder = Recorder()
    assert _run(monkeypatch, recorder, [3, 2, 1])
    assert recorder.events == [
        "start 3",
        "start 2", "apply 3", "optimizer.step", "publish 3",
        "start 1", "apply 2", "optimizer.step", "publish 2",
        "apply 1", "optimizer.step", "publish 1",
    ]


def test_a_batch_that_fails_to_start_finishes_the_one_before(monkeypatch) -> None:
    recorder = Recorder(fail_at=1)
    with pytest.raises(ValueError, match="unit 1"):
        _run(monkeypatch, recorder, [3, 2, 1])
    assert recorder.events == [
        "start 3",
        "start 2", "apply 3", "optimizer.step", "publish 3",
        "start 1 failed", "apply 2", "optimizer.step", "publish 2",
    ]


def test_no_batch_means_the_optimizers_own_step_is_left_to_the_caller(monkeypatch) -> None:
    recorder = Recorder()
    assert not _run(monkeypatch, recorder, [])
    assert recorder.events == []
