"""The dense MLP: SwiGLU, or GeGLU with the tanh GELU (Gemma), gate and up split by columns, down by rows; and the row
tiles selective recomputation runs a long sequence's MLP in."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayspeed.config.shape import ModelShape
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import ColumnParallelLinear, RowParallelLinear, enter_tp_region


class MLP(nn.Module):
    """SwiGLU: w_down(silu(w_gate x) * w_up x), or GeGLU with the tanh GELU (Gemma); gate/up split by columns,
    down by rows."""

    def __init__(self, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int, name: str):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        h, f = dims.hidden_size, dims.ffn_hidden_size
        self.gelu = dims.hidden_act == "gelu_pytorch_tanh"
        col = functools.partial(ColumnParallelLinear, tp=tp, shared_input=True, init_std=dims.init_std, seed=seed)
        self.w_gate = col(h, f, name=f"{name}.w_gate")
        self.w_up = col(h, f, name=f"{name}.w_up")
        self.w_down = RowParallelLinear(
            f, h, tp, input_is_parallel=True, sequence_parallel=sequence_parallel,
            init_std=dims.residual_init_std, seed=seed, name=f"{name}.w_down",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.tp, self.sequence_parallel)
        gate = self.w_gate(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down(gate * self.w_up(x))


# planner/memory.py MLP_TILE_BYTES: a dense MLP whose intermediates (gate, its activation, up, the product) would
# pass this for the rank's rows is recomputed a tile of rows at a time under selective checkpointing.
MLP_TILE_BYTES = 1 << 28


def mlp_tile_rows(mlp: nn.Module, x: torch.Tensor) -> Optional[int]:
    """Rows (of dim 1, this rank's sequence) per MLP tile, or None: one piece (small, or a mixture of experts)."""
    if not isinstance(mlp, MLP):
        return None
    gathered = mlp.tp.world_size if (mlp.sequence_parallel and mlp.tp.enabled) else 1  # rows each tile gathers
    per_row = x.shape[0] * gathered * (mlp.w_gate.out_features // mlp.tp.world_size) * 4 * x.element_size()
    if per_row * x.shape[1] <= MLP_TILE_BYTES:
        return None
    return max(1, MLP_TILE_BYTES // per_row)
