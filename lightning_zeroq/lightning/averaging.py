"""Lightning's weight-averaging callbacks under the engine.

``WeightAveraging`` (``EMAWeightAveraging`` and the user's subclasses) and ``StochasticWeightAveraging``
read every parameter of the module after steps or epochs into a copy of the model they hold, and write
their average into the module (for validation, at the end of training). Under DDP they see the fp32
parameters. Where the engine's module holds something else between steps (stage 3: freed parameters;
bf16/fp16 or INT8 working weights; ``full_params.module_holds_masters``), the strategy runs each of their loop
hooks inside ``gathered_parameters(module, writeback=True)``: the callback reads the full fp32 masters
and what it writes becomes the masters (and the working weights), as under DDP. Elsewhere they read the
module as it is, and what they write after the last step is kept when the module is handed back
(``full_params.release_module``).

Their checkpoints: ``WeightAveraging.on_save_checkpoint`` moves the module's state (the engine's shards)
from ``state_dict`` to ``current_model_state`` and puts its average there; the checkpoint stores both with
the tensors (``lightning/checkpoint.py``) and a load hands both back whole, the engine taking
``state_dict`` as from any checkpoint. Its ``on_load_checkpoint`` then loads the average into its copy and
``current_model_state`` into the module: in every stage the strategy runs it inside
``gathered_parameters(module, writeback=True)``, so what it loads becomes the masters and the working
weights. A checkpoint directory's trainer state has no ``state_dict`` of its own (its weights went straight
into the engine): for a checkpoint saved without the callback, which it reads to start its average, it
reads the module's weights as loaded, as under DDP.

Their ``setup`` copies the model before the strategy builds the engine, so the copy is of the plain
module. A stage-3 model made in ``Trainer.init_module()`` has its parameters on the meta device until
the engine materializes them: there is nothing to copy yet, so such a fit is refused before it starts
(``refuse_meta_copies``), naming the callback and the fix.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, Iterable

from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.callbacks.weight_averaging import WeightAveraging
from torch import nn

AVERAGING = (WeightAveraging, StochasticWeightAveraging)
LOAD_HOOK = "on_load_checkpoint"
HOOKS = (
    "on_train_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
)


def gather_around_averaging(
    callbacks: Iterable[Callback], gathered: Callable[[Any], ContextManager], loop_hooks: bool = True
) -> Callable[[], None]:
    """Run the hooks the averaging callbacks among ``callbacks`` implement inside ``gathered(pl_module)``:
    the loop hooks (``HOOKS``) where ``loop_hooks`` (the module does not hold the masters between steps),
    ``on_load_checkpoint`` always; returns what undoes it (the strategy's teardown calls it)."""
    wrapped: list[tuple[Callback, str]] = []
    for callback in callbacks:
        if not isinstance(callback, AVERAGING):
            continue
        for name in (*(HOOKS if loop_hooks else ()), LOAD_HOOK):
            if getattr(type(callback), name) is getattr(Callback, name) or name in vars(callback):
                continue  # not implemented (nothing to gather for), or already wrapped
            hook = _loading_hook if name == LOAD_HOOK else _gathered_hook
            setattr(callback, name, functools.partial(hook, getattr(callback, name), gathered))
            wrapped.append((callback, name))

    def undo() -> None:
        for callback, name in wrapped:
            vars(callback).pop(name, None)

    return undo


def _gathered_hook(
    hook: Callable, gathered: Callable[[Any], ContextManager], trainer: Any, pl_module: Any, *args: Any, **kwargs: Any
) -> Any:
    with gathered(pl_module):
        return hook(trainer, pl_module, *args, **kwargs)


def _loading_hook(
    hook: Callable,
    gathered: Callable[[Any], ContextManager],
    trainer: Any,
    pl_module: Any,
    checkpoint: dict,
    *args: Any,
    **kwargs: Any,
) -> Any:
    with gathered(pl_module):
        if "state_dict" in checkpoint:
            return hook(trainer, pl_module, checkpoint, *args, **kwargs)
        # A directory's weights went into the engine: the module holds them now (gathered), as they were saved.
        checkpoint["state_dict"] = pl_module.state_dict()
        try:
            return hook(trainer, pl_module, checkpoint, *args, **kwargs)
        finally:
            checkpoint.pop("state_dict", None)


def refuse_meta_copies(callbacks: Iterable[Callback], module: nn.Module) -> None:
    """Before a fit: a weight-averaging callback would copy parameters still on the meta device."""
    meta = next((n for n, p in module.named_parameters() if p.is_meta), None)
    averaging = next((c for c in callbacks if isinstance(c, AVERAGING)), None)
    if meta is not None and averaging is not None:
        raise ValueError(
            f"{type(averaging).__name__} copies the model before fit, but {meta} is on the meta device (the model "
            "was made in Trainer.init_module(), where ZeroQ stage 3 leaves parameters to the engine); create the "
            "model outside Trainer.init_module() (stage 3 still shards it), or leave the callback out."
        )
