"""The roles an optimizer placement plays, one per phase of a step, and who takes which.

A placement (``device.OptimizerHome`` and the placements built on it: host, NVMe, split, auto)
decides where the fp32 master shards and the optimizer state live and where the update runs. The
engine's parts never see the whole placement: each takes the one role it calls, as FSDP2 keeps its
parameter, its group's collectives and its hooks apart. Only the build (``build.py``) and the
optimizer side of the step (``step.Stepper``) hold the placement whole, for its lifecycle
(``adopt_master``, ``store_built``, ``attach``, ``state_loaded``, ``optimizer_replaced``,
``step_done``, ``close``).

| role | taken by | what it answers |
|---|---|---|
| ``Masters`` | ``gather.Gatherer``, ``wire.Wire``, ``full_params``, ``state_dict`` | where a master is read and written |
| ``Gradients`` | ``reducer.Reducer`` | where a reduced gradient shard lands, when it may be released |
| ``Updater`` | ``step.run`` / ``step.step_in`` | in which batches units step, who steps them, what gradient they read |

``tests/test_architecture.py`` checks that each taker is typed with its role, and mypy that it calls
nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, Sequence

import torch
from torch import Tensor

from lightning_zeroq.zero.unit import Unit

if TYPE_CHECKING:
    from lightning_zeroq.ops.host_adam import HostAdam
    from lightning_zeroq.zero.optim.binding import Binding


class Masters(Protocol):
    """Where each unit's fp32 master lives and how the device reads it."""

    def master_on_device(self, index: int) -> bool:
        """Unit ``index``'s master stays on the compute device (stage 3 gathers from it there)."""

    def resident(self, units: Sequence[Unit]) -> Iterator[Unit]:
        """The units in order, each with its master (and state) readable and writable while the caller
        holds it: every walk over the masters other than the step's (publish, state dicts, loads)."""

    def device_master(self, unit: Unit) -> Tensor:
        """The master as fp32 on the device (the INT8 wire encodes it; full state gathers it)."""

    def device_working(self, unit: Unit, dtype: torch.dtype) -> Tensor:
        """The master in the working dtype on the device (a full-width publish gathers it)."""

    def host_working(self, unit: Unit, dtype: torch.dtype) -> Optional[Tensor]:
        """The working-dtype copy of a host master the host step wrote, if fresh (stage 3's payload)."""

    def write_working(self, unit: Unit, out: Tensor, spans: Sequence[slice]) -> None:
        """``out[span]`` (this rank's part of the working buffer, on the device) = the master's ``span`` in
        ``out``'s dtype, for each of ``spans`` (a publish of what one of several optimizers stepped)."""

    def published(self, unit: Unit) -> None:
        """The copies that read the unit's master were just issued: a host master is not written, nor
        its buffer reused, before they ran."""


class Gradients(Protocol):
    """Where a unit's reduced gradient shard goes, and when the device may let it go."""

    def master_on_device(self, index: int) -> bool: ...

    def begin_backward(self, last: bool) -> None:
        """A backward begins (``last``: the caller said a step follows it)."""

    def grad_reduced(self, unit: Unit) -> None:
        """On the reduction stream: a unit's gradient shard just grew (offload: copy it to the host now,
        if the backward is the last)."""

    def gradients_ready(self, units: Sequence[Unit]) -> None:
        """Every reduction is issued, before the step's agreement is read back."""

    def gradients_done(self, units: Sequence[Unit]) -> None:
        """The agreement was read back: every gradient shard is final."""

    def step_grad(self, unit: Unit) -> Tensor:
        """The gradient shard the optimizer reads (offload: its host copy, after its copy finished)."""

    def clear_spans(self, unit: Unit, spans: Sequence[slice]) -> None:
        """Zero parts of the unit's gradient where the optimizer reads it, beside the device's shard (which
        the caller zeroes): offload, its host copy, in the dtype it landed in (another optimizer still reads
        the rest as it is)."""

    def end_window(self) -> None:
        """Before the device's gradient shards are released: the copies still reading them finish."""


class Updater(Protocol):
    """How the optimizer steps the units."""

    def step_batches(self, units: Sequence[Unit]) -> Iterator[list[Unit]]:
        """The units in the batches the optimizer steps, the same on every rank."""

    def scale_grads(self, unit: Unit, spans: Sequence[slice], multiplier: float) -> None:
        """Multiply parts of a unit's gradient (unscaling and clipping), or owe it to the host kernel."""

    def step_batch(self, batch: Sequence[Unit], binding: "Binding", used: Sequence[Any]) -> bool:
        """Step ``batch`` here (True), or leave it to the optimizer's own ``step()`` (False)."""

    def step_grad(self, unit: Unit) -> Tensor: ...

    def matrix_grad(self, unit: Unit) -> tuple[Tensor, float]:
        """A matrix optimizer's read of the unit's gradient: as it is kept (bf16 as it landed, where the
        host kernel reads it) and the multiplier it still owes (``optim.matrix.MatrixSource``)."""

    def host_kernel(self, unit: Unit) -> Optional["HostAdam"]:
        """The host kernel that steps the unit's segments on the host, if any."""

    def kernel_copy(self, unit: Unit) -> Optional[Tensor]:
        """Where the host kernel writes the unit's bf16 master copy as it steps (None: no such copy)."""

    def copied(self, unit: Unit, spans: Sequence[slice]) -> None:
        """These spans of ``kernel_copy(unit)`` were just written with their masters."""
