"""The largest-model search (``benchmarks/fits.py largest``): the bisection finds the deepest depth that
trains under every rule, with few trials; the parameter count is the step_time GPT's; a real trial on CPU
trains, and a failing one reports why."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import fits


@pytest.mark.parametrize("start", [1, 3, 16, 64])
@pytest.mark.parametrize("most", [1, 7, 50, 128])
def test_the_search_finds_the_deepest_depth_that_trains(start: int, most: int) -> None:
    for limit in [0, 1, 2, 5, 16, 17, 49, 50, 127, 200]:
        calls: list[int] = []

        def trains(layers: int) -> dict:
            calls.append(layers)
            return {"trains": layers <= limit}

        deepest, tried = fits.search(trains, start, most)
        expected = min(limit, most) or None
        assert deepest == expected, (start, most, limit, calls)
        assert len(calls) == len(set(calls)) and len(calls) <= 2 * most.bit_length() + 2  # each depth once, few
        assert all(tried[d]["trains"] == (d <= limit) for d in tried)


def test_the_parameter_count_is_the_models() -> None:
    sys.path.insert(0, str(REPO))
    import step_time

    model = step_time.GPT(vocab=100, dim=32, layers=3, heads=4, ffn=48)
    assert fits.params_of(3, 32, 48, 100) == sum(p.numel() for p in model.parameters())
    assert round(fits.params_of(32, 4096, 11008, 32000) / 1e9, 2) == 6.74  # Llama-7B-like


def _main(*args: str) -> list[dict]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert fits.main(["largest", *args]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_dry_run_reports_the_deepest_and_why_the_next_fails() -> None:
    lines = _main("--arms", "zeroq3+offload_params", "--dry-run", "37", "--start", "16")
    summary = lines[-1]
    assert summary["deepest_layers"] == 37 and summary["next_fails_because"] == "dry run"
    assert [t["layers"] for t in lines[:-1]] == [16, 32, 64, 48, 40, 36, 38, 37]


TINY = ("--dim", "32", "--heads", "2", "--ffn", "64", "--vocab", "128", "--batch", "2", "--seq", "16", "--steps", "1")


def test_a_trial_on_cpu_trains_or_says_why() -> None:
    parser_args = ["--arms", "zeroq3+offload_params", *TINY, "--max-layers", "1", "--start", "1", "--checkpoint"]
    summary = _main(*parser_args)[-1]
    assert summary["deepest_layers"] == 1 and summary["tokens_per_s"] > 0
    failed = _main("--arms", "zeroq3+offload_params+nvme", *TINY, "--max-layers", "1", "--start", "1")
    assert failed[-1]["deepest_layers"] is None
    assert "+nvme needs --nvme-path DIR" in failed[0]["reason"]
