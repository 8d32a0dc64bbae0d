"""Dynamic loss scaling for fp16 working weights.

The engine decides overflow globally (one all-reduce over every rank's gradient shards), so every rank
skips the same steps and the scale stays identical everywhere; a per-rank ``GradScaler`` would let
ranks disagree once gradients are sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zeroq.zero.policies import LossScaling


@dataclass(kw_only=True)
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0
    skipped_steps: int = 0
    dynamic: bool = True

    def next_scale(self, overflow: bool) -> float:
        """The scale ``update(overflow)`` would set (for the log)."""
        if not self.dynamic:
            return self.scale
        if overflow:
            return max(self.scale * self.backoff_factor, self.min_scale)
        grows = (self.good_steps + 1) % self.growth_interval == 0
        return self.scale * self.growth_factor if grows else self.scale

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            self.skipped_steps += int(found_inf)
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def from_policy(policy: LossScaling) -> DynamicLossScaler:
    """The scaler ``policy`` asks for (DeepSpeed's ``loss_scale``/``initial_scale_power``/...)."""
    if policy.fixed_scale is not None:
        return DynamicLossScaler(scale=policy.fixed_scale, dynamic=False)
    return DynamicLossScaler(
        scale=policy.initial_scale, growth_interval=policy.growth_interval, min_scale=policy.min_scale
    )
