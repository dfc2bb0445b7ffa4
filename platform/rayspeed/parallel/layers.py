"""Megatron-style tensor-parallel layers, each given its TensorParallel handle (biases only on column-parallel
layers, split with their outputs).

With tp.world_size == 1 every layer is a plain nn.Linear / nn.Embedding equivalent.

Initialisation is independent of the layout: a layer generates the FULL weight from a
generator seeded by (seed, parameter name) and keeps only its slice, so tp=1, tp=2 or any
pipeline split of the same model start from bit-identical weights. The cost is one full
fp32 tensor on the host per parameter at construction time.

Sharded parameters carry Megatron's attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`), which DeepSpeed reads when it computes the global gradient norm.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayspeed.parallel.comm import (
    all_gather_along,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from rayspeed.parallel.groups import TensorParallel

NO_TP = TensorParallel()
_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Parameters built inside hold this rank's slice uninitialised (no full tensor, no random draw): for models
    whose weights are loaded right after (a pretrained checkpoint), where the seeded init would cost one full
    fp32 tensor per parameter on every rank for values that are overwritten anyway."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = before


def stable_seed(seed: int, key: str) -> int:
    """A 63-bit seed from (seed, key) that is the same in every process (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_normal(shape, std: float, seed: int, key: str) -> torch.Tensor:
    """The unsharded initial value of parameter `key`: N(0, std) in fp32 on the host."""
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(seed, key))
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=gen)


def sharded_parameter(
    full_shape,
    partition_dim: Optional[int],
    tp: TensorParallel,
    *,
    std: float,
    seed: int,
    key: str,
    dtype: Optional[torch.dtype] = None,
) -> nn.Parameter:
    """A parameter holding this rank's slice (along partition_dim) of a deterministic full tensor.

    partition_dim None means replicated: every rank holds the full tensor. std 0 means zeros (biases).
    Inside `deferred_init()` the slice is allocated and left uninitialised.
    """
    if partition_dim is not None and tp.enabled and full_shape[partition_dim] % tp.world_size != 0:
        raise ValueError(
            f"{key}: dim {partition_dim} of size {full_shape[partition_dim]} does not divide by tp={tp.world_size}"
        )
    if getattr(_DEFERRED, "on", False):
        local = list(full_shape)
        if partition_dim is not None and tp.enabled:
            local[partition_dim] //= tp.world_size
        full = torch.empty(local, dtype=dtype or torch.get_default_dtype())
    else:
        full = full_normal(full_shape, std, seed, key) if std > 0 else torch.zeros(tuple(full_shape))
        if partition_dim is not None and tp.enabled:
            full = full.chunk(tp.world_size, dim=partition_dim)[tp.rank]
    param = nn.Parameter(full.to(dtype or torch.get_default_dtype()).contiguous())
    if partition_dim is not None:
        param.tensor_model_parallel = True
        param.partition_dim = partition_dim
        param.partition_stride = 1
    return param


def gather_full(tensor: torch.Tensor, param: nn.Parameter, tp: TensorParallel) -> torch.Tensor:
    """The unsharded value of `tensor` (a parameter or its gradient), collective over tp.

    Replicated parameters come back unchanged.
    """
    if getattr(param, "tensor_model_parallel", False):
        return all_gather_along(tensor.detach(), tp, param.partition_dim)
    return tensor.detach()


def enter_tp_region(x: torch.Tensor, tp: TensorParallel, sequence_parallel: bool) -> torch.Tensor:
    """Bring an activation into a tensor-parallel region: f, or the sequence all-gather under sp.

    Layers that read the same activation (q, k, v; gate, up) share one call instead of each
    communicating on its own.
    """
    return gather_from_sequence(x, tp) if sequence_parallel else copy_to_tp(x, tp)


def leave_tp_region(x: torch.Tensor, tp: TensorParallel, sequence_parallel: bool) -> torch.Tensor:
    """Sum the partial results of a tensor-parallel region: g, or the sequence reduce-scatter under sp."""
    return reduce_scatter_to_sequence(x, tp) if sequence_parallel else reduce_from_tp(x, tp)


def base_product(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x W^T (+ bias) of a parallel linear layer's own weight shard, dense or packed in 4 bits."""
    if layer.quantized is not None:
        return layer.quantized(x, bias)
    return F.linear(x, layer.weight, bias)


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """A parallel linear layer's weight shard as a dense tensor (a 4-bit one dequantized)."""
    return layer.weight if layer.quantized is None else layer.quantized.dequantize()


def adapter_weight(layer: nn.Module) -> Optional[torch.Tensor]:
    """What the layer's adapter reads of the base weight: DoRA the whole shard each forward, LoRA nothing (a
    4-bit weight is then not dequantized twice)."""
    if layer.quantized is not None and getattr(layer.adapter, "magnitude", None) is None:
        return None
    return dense_weight(layer)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along its output rows: rank r computes output features [r*n/tp, (r+1)*n/tp).

    gather_output: all-gather the output slices (otherwise the output stays sharded on the
    last dim, ready for a RowParallelLinear). sequence_parallel: the input is sharded along
    the sequence and gets all-gathered first. shared_input: the caller already called
    `enter_tp_region` on the input. bias: a bias split like the output features (zeros at init).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Optional[TensorParallel] = None,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        shared_input: bool = False,
        init_std: float = 0.02,
        seed: int = 0,
        name: str = "column_linear",
        dtype: Optional[torch.dtype] = None,
        bias: bool = False,
    ):
        super().__init__()
        self.tp = tp or NO_TP
        if gather_output and sequence_parallel:
            raise ValueError("gather_output is not supported with sequence_parallel")
        if out_features % self.tp.world_size != 0:
            raise ValueError(f"{name}: out_features={out_features} does not divide by tp={self.tp.world_size}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.shared_input = shared_input
        self.weight = sharded_parameter(
            (out_features, in_features), 0, self.tp, std=init_std, seed=seed, key=f"{name}.weight", dtype=dtype
        )
        self.bias = (sharded_parameter((out_features,), 0, self.tp, std=0.0, seed=seed, key=f"{name}.bias", dtype=dtype)
                     if bias else None)
        self.adapter: Optional[nn.Module] = None  # rayspeed.adapters: (x, y, weight, bias) -> y plus its share
        self.quantized: Optional[nn.Module] = None  # rayspeed.adapters.nf4: the frozen weight in 4 bits (QLoRA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shared_input:
            x = enter_tp_region(x, self.tp, self.sequence_parallel)
        y = base_product(self, x, self.bias)
        if self.adapter is not None:
            y = self.adapter(x, y, adapter_weight(self), self.bias)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp.world_size}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along its input columns; each rank's product is a partial sum.

    input_is_parallel: the input already holds this rank's slice of the last dim (the output
    of a ColumnParallelLinear); otherwise the full input is split here. The partial sums are
    all-reduced (g), or reduce-scattered along the sequence under sequence_parallel.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: Optional[TensorParallel] = None,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        seed: int = 0,
        name: str = "row_linear",
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.tp = tp or NO_TP
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        if in_features % self.tp.world_size != 0:
            raise ValueError(f"{name}: in_features={in_features} does not divide by tp={self.tp.world_size}")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.weight = sharded_parameter(
            (out_features, in_features), 1, self.tp, std=init_std, seed=seed, key=f"{name}.weight", dtype=dtype
        )
        self.adapter: Optional[nn.Module] = None  # rayspeed.adapters: (x, reduced y, weight) -> y plus its share
        self.quantized: Optional[nn.Module] = None  # rayspeed.adapters.nf4: the frozen weight in 4 bits (QLoRA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp)
        y = leave_tp_region(base_product(self, x, None), self.tp, self.sequence_parallel)
        return y if self.adapter is None else self.adapter(x, y, adapter_weight(self))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp.world_size}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Each rank looks up the tokens it owns and writes zeros for the rest; summing over ranks
    (all-reduce, or reduce-scatter along the sequence under sequence_parallel) gives the
    full embedding. Input ids are the same on every tp rank.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: Optional[TensorParallel] = None,
        *,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        seed: int = 0,
        name: str = "embedding",
        dtype: Optional[torch.dtype] = None,
        scale: Optional[float] = None,
    ):
        super().__init__()
        self.tp = tp or NO_TP
        self.scale = scale  # the output times this (Gemma: sqrt(hidden)), rounded to fp32 then to the output's dtype
        if num_embeddings % self.tp.world_size != 0:
            raise ValueError(f"{name}: vocab size {num_embeddings} does not divide by tp={self.tp.world_size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.vocab_per_rank = num_embeddings // self.tp.world_size
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        self.weight = sharded_parameter(
            (num_embeddings, embedding_dim), 0, self.tp, std=init_std, seed=seed, key=f"{name}.weight", dtype=dtype
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self.scaled(F.embedding(input_ids, self.weight))
        return self.scaled(leave_tp_region(self.partial(input_ids), self.tp, self.sequence_parallel))

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's term of the embedding, unscaled: its rows' vectors, zeros for tokens another rank owns (the
        sum over the tp group is the embedding)."""
        if not self.tp.enabled:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def scaled(self, out: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return out
        return out * torch.tensor(self.scale, dtype=torch.float32, device=out.device).to(out.dtype)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, dim={self.embedding_dim}, tp={self.tp.world_size}, "
                f"sequence_parallel={self.sequence_parallel}")
