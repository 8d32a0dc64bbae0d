"""A short ZeRO stage-2 training run on CPU with 2 processes (gloo): `python examples/train_cpu.py`.

A tiny character-level language model on a real text that every Python install carries (the
interactive help topics in ``pydoc_data``), so no download is needed.
"""

import lightning as L
import torch
import torch.nn.functional as F
from pydoc_data.topics import topics
from torch import nn

import lightning_zeroq  # noqa: F401  registers strategy="zeroq"

SEQ = 64


class CharLM(L.LightningModule):
    def __init__(self, vocab: int = 128, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch[:, :-1], batch[:, 1:]
        h, _ = self.rnn(self.embed(x))
        loss = F.cross_entropy(self.head(h).reshape(-1, 128), y.reshape(-1))
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    text = "".join(topics.values()).encode("ascii", "replace")
    data = torch.tensor(list(text[: 400 * (SEQ + 1)]), dtype=torch.long).clamp_(max=127).view(-1, SEQ + 1)
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="zeroq", max_steps=30, logger=False,
                        enable_checkpointing=False, log_every_n_steps=5)
    trainer.fit(CharLM(), torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss']:.3f}")


if __name__ == "__main__":
    main()
