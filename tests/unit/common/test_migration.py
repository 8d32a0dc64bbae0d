"""DeepSpeed's and FSDP's option names: the error says what the README's migration guide says."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lightning_zeroq import ZeroConfig, ZeroQFabricStrategy, ZeroQStrategy
from lightning_zeroq.common.migration import ADVICE

README = Path(__file__).resolve().parents[3] / "docs" / "migrating.md"


@pytest.mark.parametrize("strategy_cls", [ZeroQStrategy, ZeroQFabricStrategy])
@pytest.mark.parametrize("option, says", [
    ("pin_memory", "pinned whenever the device is a GPU"),
    ("sub_group_size", "host steps unit by unit"),
    ("contiguous_gradients", "one flat buffer"),
    ("partition_activations", "use torch.utils.checkpoint"),
    ("cpu_offload", "offload_optimizer=True, offload_parameters=True"),
    ("sync_module_states", "every rank starts from rank 0's values"),
])
def test_deepspeed_and_fsdp_options_get_the_guides_advice(strategy_cls, option, says):
    with pytest.raises(TypeError) as info:
        strategy_cls(**{option: True})
    message = str(info.value)
    assert option in message and says in message and "docs/migrating.md" in message
    assert "Valid options are" in message and "\n" not in message


def _readme_rows() -> dict[str, list[str]]:
    """Every name in the left column of the README's DeepSpeed and FSDP option tables that is not a ZeroQ
    option or strategy argument -> the right column of its rows, markdown removed."""
    section = README.read_text(encoding="utf-8").split("# Migrating from DeepSpeed or FSDP")[1].split("\n## ")[0]
    ours = set(ZeroConfig.__dataclass_fields__)
    for cls in (ZeroQStrategy, ZeroQFabricStrategy):
        ours |= set(inspect.signature(cls.__init__).parameters)
    rows: dict[str, list[str]] = {}
    for header in ("| DeepSpeed option | ZeroQ |", "| FSDP option | ZeroQ |"):
        body = section.split(header)[1].split("\n\n")[0].strip().splitlines()[1:]
        for line in body:
            left, right = line.strip().strip("|").split(" | ", 1)
            right = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", right.strip().replace("`", ""))
            for name in re.findall(r"`([A-Za-z_]\w*)(?:=[^`]*)?`", left):
                if name not in ours:
                    rows.setdefault(name, []).append(right)
    return rows


def test_advice_table_matches_the_readme():
    rows = _readme_rows()
    assert len(rows) > 30  # the tables were found
    assert sorted(ADVICE) == sorted(rows), "the README's migration tables and common/migration.py name other options"
    for name, advice in rows.items():
        for text in advice:
            assert text in ADVICE[name], f"{name}: the README says {text!r}, the error says {ADVICE[name]!r}"
