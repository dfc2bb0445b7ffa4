"""The decoder-only transformer: its pieces (rayspeed.model.decoder), run in one process by the Transformer or cut into
DeepSpeed pipeline stages by rayspeed.engine.pipeline_module (imported on demand: it pulls in deepspeed)."""

from rayspeed.model.transformer import (
    Block,
    OutputHead,
    RMSNorm,
    Transformer,
    count_parameters,
    num_parameters,
    parameter_bytes,
)

__all__ = [
    "Block",
    "OutputHead",
    "RMSNorm",
    "Transformer",
    "count_parameters",
    "num_parameters",
    "parameter_bytes",
]
