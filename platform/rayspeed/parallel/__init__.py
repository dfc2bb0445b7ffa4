"""Tensor, sequence and pipeline parallel machinery: process groups, communication, layers, loss."""

from rayspeed.parallel.groups import ParallelGroups, TensorParallel, check_tp_within_nodes, layout
from rayspeed.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from rayspeed.parallel.loss import chunked_linear_cross_entropy, linear_cross_entropy, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "ParallelGroups",
    "RowParallelLinear",
    "TensorParallel",
    "VocabParallelEmbedding",
    "check_tp_within_nodes",
    "chunked_linear_cross_entropy",
    "layout",
    "linear_cross_entropy",
    "vocab_parallel_cross_entropy",
]
