"""What ``offload="auto"`` (and, on a GPU, the check before launch of a configuration given by hand) plans
from under the Trainer: the module's ``training_step`` on the first batch of its training dataloader,
moved to the meta device (``planning/choose.py`` traces it with the
parameters on the meta device too, so nothing is allocated). The batch is read once at setup, as
Lightning's ``DeepSpeedStrategy`` reads one to learn the micro-batch size; the fit then starts from
the dataloader's beginning as usual. ``self.log`` does nothing during the trace.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor, nn

from lightning_zeroq.common.precision import ZeroQPrecision
from lightning_zeroq.config import ZeroConfig
from lightning_zeroq.nulls import nothing
from lightning_zeroq.planning.estimate import ForwardError
from lightning_zeroq.zero.policies import auto_request

FIX = "or pass plan_forward=lambda model: <one micro-batch's loss> to ZeroQStrategy"


def planning_forward(
    trainer: Any, module: Any, precision: ZeroQPrecision, config: ZeroConfig, device: torch.device
) -> Optional[Callable[[nn.Module], Tensor]]:
    """What a fit plans from: the first batch's ``training_step`` for ``offload="auto"`` (required), and
    on a GPU for the check before launch of a configuration given by hand (where it can be read)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return None
    if auto_request(config) is not None:
        return first_batch_forward(trainer, module, precision)
    return first_batch_forward(trainer, module, precision, required=False) if device.type == "cuda" else None


def first_batch_forward(
    trainer: Any, module: Any, precision: ZeroQPrecision, required: bool = True
) -> Optional[Callable[[nn.Module], Tensor]]:
    """``forward(model)``: ``model.training_step`` on the first training batch (meta tensors) and its loss.
    Not ``required`` (the check before launch of a configuration given by hand): None where reading a
    batch could cost the run something (manual optimization, a stream: an ``IterableDataset``) or fails."""
    if not required:
        try:
            loader = trainer.fit_loop._data_source.dataloader()
            loaders = (
                loader.values()
                if isinstance(loader, Mapping)
                else loader
                if isinstance(loader, (list, tuple))
                else [loader]
            )
            if not module.automatic_optimization or any(
                isinstance(getattr(dl, "dataset", None), torch.utils.data.IterableDataset) for dl in loaders
            ):
                return None
            return first_batch_forward(trainer, module, precision)
        except Exception:
            return None
    if not module.automatic_optimization:
        raise ValueError(
            "offload='auto' plans from training_step, which under manual optimization steps the "
            f"optimizers itself; choose the offload by hand (zeroq-plan shows what fits) {FIX}."
        )
    loader = trainer.fit_loop._data_source.dataloader()  # as Lightning's DeepSpeedStrategy reads it at setup
    try:
        batch, _, _ = next(iter(CombinedLoader(loader, "max_size_cycle")))
    except StopIteration:
        raise ValueError(
            f"offload='auto' plans from the first training batch, and the training dataloader is "
            f"empty; give it data {FIX}."
        ) from None
    batch = apply_to_collection(batch, Tensor, lambda t: t.to("meta"))
    return training_step_loss(precision.convert_input(batch), f"offload='auto': {{}}; {FIX}.")


def training_step_loss(batch: Any, error: str = "{}") -> Callable[[nn.Module], Tensor]:
    """``forward(model)``: ``model.training_step(batch, 0)``'s loss, ``self.log`` doing nothing meanwhile
    (``error``: the message, with ``{}`` for what was wrong, where it returns no loss)."""

    def forward(model: nn.Module) -> Tensor:
        quiet = dict.fromkeys(("log", "log_dict"), nothing)
        model.__dict__.update(quiet)  # an instance attribute shadows the method during the trace
        try:
            out = model.training_step(batch, 0)  # type: ignore[operator]
        finally:
            for name in quiet:
                model.__dict__.pop(name, None)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise ForwardError(error.format(f"training_step returned {type(out).__name__}, not a loss"))
        return loss

    return forward
