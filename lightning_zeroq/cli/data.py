"""The default training text: Python's own documentation, byte-level, cut into fixed windows.

Every CPython ships the text of its interactive help topics in ``pydoc_data.topics.topics`` (a dict
from topic name to a page of the language reference: about 0.5-0.7 MB of English, depending on the
Python version), so the default recipes train on real text on any machine without a download.
``DataConfig.text_file`` points at any UTF-8 file instead.

Tokenizer: bytes. The text is UTF-8 encoded and every byte is a token id in ``[0, 256)``, so there is
no vocabulary to build or ship and any text encodes.

Samples: the token stream is cut into consecutive, non-overlapping windows of ``seq_len + 1`` tokens
(the model reads the first ``seq_len`` and predicts the last ``seq_len``); the tail shorter than a
window is dropped. The train loader shuffles; under a distributed strategy Lightning replaces its
sampler with a ``DistributedSampler`` seeded from ``seed_everything``, so every rank sees different
windows in an order fixed by the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_zeroq.validation import check_int

PYDOC_SOURCE = "pydoc_data.topics"


@dataclass(kw_only=True)
class DataConfig:
    """Where the text comes from and how it is batched."""

    text_file: Optional[str] = None
    """A UTF-8 text file to train on; ``None`` means the pydoc topics shipped with Python."""

    seq_len: int = 128
    """Tokens (bytes) the model reads per sample; at most the model's ``block_size``."""

    batch_size: int = 16
    """Samples per batch on each rank."""

    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process; the data is in memory)."""

    def __post_init__(self) -> None:
        for name, minimum in (("seq_len", 1), ("batch_size", 1), ("num_workers", 0)):
            check_int("DataConfig", name, getattr(self, name), minimum)
        if self.text_file is not None and not Path(self.text_file).expanduser().is_file():
            raise ValueError(
                f"DataConfig.text_file={self.text_file!r} is not a file; give the path of a UTF-8 text file, "
                "or null for the pydoc topics that ship with Python."
            )


def load_text(text_file: Optional[str] = None) -> str:
    """The training text: ``text_file``'s contents, or the pydoc topics joined in sorted topic order."""
    if text_file is not None:
        try:
            return Path(text_file).expanduser().read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"DataConfig.text_file={text_file!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                f"offset {err.start:,} does not decode); give a UTF-8 text file."
            ) from None
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def encode_bytes(text: str) -> Tensor:
    """Byte-level tokenization: the UTF-8 bytes of ``text`` as int64 token ids in ``[0, 256)``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def check_one_batch_per_rank(cfg: DataConfig, ranks: int) -> None:
    """``ValueError`` unless the text fills one batch of windows on each of ``ranks`` ranks.

    With less, every rank's loader (``drop_last=True``) is empty and training would "finish" after 0
    steps; ``zeroq-train`` calls this before it starts any process.
    """
    tokens = len(load_text(cfg.text_file).encode("utf-8"))
    window = cfg.seq_len + 1
    needed = cfg.batch_size * ranks
    if tokens // window < needed:
        raise ValueError(
            f"DataConfig.text_file={cfg.text_file!r} is too little text for one batch: {tokens:,} bytes make "
            f"{tokens // window} windows of seq_len+1={window} bytes, and one batch on every rank needs "
            f"batch_size x ranks = {cfg.batch_size} x {ranks} = {needed} windows ({needed * window:,} bytes); "
            "use a longer text, or lower data.seq_len or data.batch_size."
        )


class TokenWindows(Dataset[Tensor]):
    """Consecutive, non-overlapping windows of ``seq_len + 1`` tokens of one token stream."""

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        num_windows = tokens.numel() // (seq_len + 1)
        if num_windows == 0:
            raise ValueError(
                f"the text has {tokens.numel()} tokens, fewer than one window of seq_len+1={seq_len + 1}; "
                "use a longer text or a smaller data.seq_len."
            )
        self.windows = tokens[: num_windows * (seq_len + 1)].view(num_windows, seq_len + 1)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> Tensor:
        return self.windows[index]


class TextDataModule(L.LightningDataModule):
    """Train loader over ``TokenWindows`` of the configured text (no validation split)."""

    def __init__(self, cfg: DataConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dataset: Optional[TokenWindows] = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            self.dataset = TokenWindows(encode_bytes(load_text(self.cfg.text_file)), self.cfg.seq_len)

    def train_dataloader(self) -> DataLoader[Tensor]:
        assert self.dataset is not None, "setup() runs before train_dataloader()"
        return DataLoader(
            self.dataset,
            batch_size=self.cfg.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.cfg.num_workers,
        )

    @property
    def source(self) -> str:
        """Human-readable name of the text, for summaries."""
        return self.cfg.text_file or PYDOC_SOURCE
