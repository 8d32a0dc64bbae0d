"""``lightning_zeroq.ranks`` in one process: what ``group`` means, and ``agree``'s order of verdicts (every rank's
errors, this rank's own error, the payloads' comparison). Several ranks: ``tests/integration/engine/test_rank_failures.py``."""

from __future__ import annotations

import pickle

import pytest

from lightning_zeroq import ranks
from lightning_zeroq.ranks import LOCAL, agree, exchange, rank_and_size


def _failure(errors: list[list[str]]) -> RuntimeError:
    return RuntimeError(f"failed: {errors}")


def test_local_is_this_process_alone_and_so_is_every_group_without_a_process_group(monkeypatch):
    assert rank_and_size(LOCAL) == (0, 1) and exchange("mine", LOCAL) == ["mine"]  # whatever process group is up
    monkeypatch.setattr(ranks, "is_distributed", lambda: False)  # (another test of this process may have left one)
    assert rank_and_size(None) == (0, 1) and exchange("mine", None) == ["mine"]


def test_local_is_one_value_and_stays_one_through_pickle():
    assert repr(LOCAL) == "LOCAL"
    assert pickle.loads(pickle.dumps(LOCAL)) is LOCAL


def test_agree_returns_the_payloads_where_no_rank_has_errors():
    assert agree([], LOCAL, _failure, payload={"token": 1}) == [{"token": 1}]
    assert agree([], LOCAL, _failure) == [None]


def test_errors_raise_the_failure_and_an_own_error_is_raised_as_it_is():
    with pytest.raises(RuntimeError, match=r"failed: \[\['disk full'\]\]"):
        agree(["disk full"], LOCAL, _failure)
    own = OSError("no space left")
    with pytest.raises(OSError) as raised:
        agree(["OSError: no space left"], LOCAL, _failure, own=own, quick=True)
    assert raised.value is own


def test_a_disagreement_comes_before_any_error_and_names_the_own_error_as_its_cause():
    own = ValueError("shard_group_size does not divide the world size")

    def compare(payloads: list) -> ValueError:
        return ValueError(f"differs: {payloads}")

    with pytest.raises(ValueError, match=r"differs: \[2\]") as raised:
        agree(["ValueError: ..."], LOCAL, _failure, payload=2, own=own, compare=compare)
    assert raised.value.__cause__ is own
    assert agree([], LOCAL, _failure, payload=2, compare=lambda payloads: None) == [2]
