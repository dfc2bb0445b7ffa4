"""The decoder-only transformer. The DeepSpeed pipeline form lives in rayspeed.model.pipeline
(imported on demand: it pulls in deepspeed)."""

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
