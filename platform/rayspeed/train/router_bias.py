"""model.router_bias_update: after every optimizer step, each MoE layer with a score correction (DeepSeek-V3's
e_score_correction_bias) moves it toward an even load over the step's tokens on every data-parallel rank (its
module's balance_bias). The correction is a frozen parameter: the optimizer never touches it, and a full fine-tune's
checkpoint keeps it (engine/deepspeed_state.py), so a resumed job goes on from the moved values."""

from __future__ import annotations

from typing import Any

from rayspeed.train.events import Callback, TrainState


class RouterBiasUpdate(Callback):
    def __init__(self, model: Any, speed: float, group: Any):
        self.layers = [m for m in model.modules() if hasattr(m, "balance_bias")]
        self.speed, self.group = speed, group

    def on_step_end(self, state: TrainState) -> None:
        for layer in self.layers:
            layer.balance_bias(self.speed, self.group)
