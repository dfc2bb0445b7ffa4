"""QLoRA's frozen base: a tensor-parallel linear layer's weight packed as 4-bit NormalFloat (bitsandbytes), the
matrix product through bitsandbytes' matmul_4bit, as peft's 4-bit LoRA layer computes it.

NF4 quantizes blocks of 64 consecutive elements of the row-major weight, each with its absolute maximum (absmax);
double quantization then stores those absmax values in 8 bits (blocks of 256, less their mean). A block's codes
depend only on its own elements, so a rank's shard that is a whole number of blocks of the whole matrix quantizes
to exactly the whole matrix's codes for it. The double-quantized absmax depends on every block's (their mean), so
under tensor parallelism the exact absmax of all shards is gathered, compressed as the whole matrix's would be,
and each rank keeps its blocks' values (in fp32: 4 bytes per 64 elements instead of about 1). Every layout so
holds the weights tp1 holds, to the bit: the parity with peft + bitsandbytes at tp1 carries to tp > 1.

The packed codes and the quantization statistics are buffers that move with the module's device and that the
engine's casts to bf16 leave alone (uint8, and fp32 kept as int32 bits). None is saved in checkpoints: the base is
re-quantized from model.pretrained at every start, and a checkpoint holds the adapter only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

BLOCK = 64
"""NF4 block size: the elements sharing one absmax (bitsandbytes' and transformers' default)."""
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as e:  # a launch says so first (train/launch_checks.package_problems)
        raise RuntimeError("model.adapter.base_precision nf4 needs bitsandbytes: "
                           "pip install 'bitsandbytes>=0.50'") from e
    return bitsandbytes


def compute_dtype(setting: str, param_dtype: torch.dtype) -> torch.dtype:
    """model.adapter.compute_dtype: auto is the dtype the model's other weights are in (the job's precision)."""
    return param_dtype if setting == "auto" else _DTYPES[setting]


class Nf4Weight(nn.Module):
    """The frozen weight of one linear layer (this rank's shard), packed. `forward(x, bias)` is x W^T + bias with W
    dequantized in the compute dtype (inside matmul_4bit: its backward dequantizes again instead of keeping W)."""

    def __init__(self, weight: torch.Tensor, *, double_quant: bool, compute: torch.dtype,
                 split_dim: Optional[int] = None, tp: Any = None, name: str = "weight"):
        super().__init__()
        F = bnb().functional
        w = weight.detach().contiguous()
        self.shape, self.name, self.compute = tuple(w.shape), name, compute
        sharded = tp is not None and tp.enabled and split_dim is not None
        if sharded:
            _check_aligned(w.shape, split_dim, name)
        codes, state = F.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4",
                                       compress_statistics=double_quant and not sharded)
        if sharded and double_quant:
            state.absmax = _whole_matrix_absmax(state.absmax, w.shape, split_dim, tp, F)
        self.register_buffer("codes", codes, persistent=False)
        self.dtype, self.nested = state.dtype, state.nested
        self._keep("absmax", state.absmax)
        self._keep("code", state.code)
        if state.nested:
            self._keep("offset", state.offset)
            self._keep("absmax2", state.state2.absmax)
            self._keep("code2", state.state2.code)

    def _keep(self, name: str, t: torch.Tensor) -> None:
        # A buffer moves with the module's device; an fp32 one is kept as its int32 bits so that dtype casts
        # (DeepSpeed's module.bfloat16()) leave the quantization statistics exact.
        self.register_buffer(name, t.view(torch.int32) if t.dtype == torch.float32 else t, persistent=False)

    def _get(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        return t.view(torch.float32) if t.dtype == torch.int32 else t

    @property
    def state(self) -> Any:
        """bitsandbytes' QuantState of these buffers (a light object, made per call)."""
        F = bnb().functional
        state2 = (F.QuantState(absmax=self._get("absmax2"), code=self._get("code2"), blocksize=256,
                               dtype=torch.float32) if self.nested else None)
        return F.QuantState(absmax=self._get("absmax"), shape=torch.Size(self.shape), code=self._get("code"),
                            blocksize=BLOCK, quant_type="nf4", dtype=self.dtype,
                            offset=self._get("offset") if self.nested else None, state2=state2)

    def dequantize(self) -> torch.Tensor:
        return bnb().functional.dequantize_4bit(self.codes, self.state).to(self.compute)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = x.dtype
        b = None if bias is None else bias.to(self.compute)
        return bnb().matmul_4bit(x.to(self.compute), self.codes.t(), self.state, bias=b).to(dtype)

    def nbytes(self) -> int:
        """Bytes this rank holds for the weight: the codes and the block statistics (the code tables aside)."""
        held = [self.codes, self.absmax] + ([self.absmax2] if self.nested else [])
        return sum(t.numel() * t.element_size() for t in held)

    def extra_repr(self) -> str:
        return f"{self.name}: nf4 {list(self.shape)}, double_quant={self.nested}, compute={self.compute}"


def _check_aligned(shape: torch.Size, split_dim: int, name: str) -> None:
    """A shard of whole blocks: the column shard's elements, the row shard's width, a multiple of 64."""
    n = shape[1] if split_dim == 1 else shape[0] * shape[1]
    if n % BLOCK:
        raise ValueError(
            f"{name}: its tensor-parallel shard {list(shape)} is not a whole number of NF4 blocks of {BLOCK} "
            "elements of the whole matrix, so it would quantize differently from it; use a parallel.tp that "
            "leaves each shard a multiple of 64 wide (or tp 1) with model.adapter.base_precision nf4")


def _whole_matrix_absmax(absmax: torch.Tensor, shape: torch.Size, split_dim: int, tp: Any, F: Any) -> torch.Tensor:
    """This shard's blocks' absmax as the whole matrix's double quantization stores them (dequantized, fp32)."""
    from rayspeed.parallel.comm import all_gather_along

    rows = shape[0]
    # Row-major block order: a column shard holds whole rows (its blocks follow the previous rank's), a row
    # shard holds the same columns of every row (its blocks sit beside the other ranks' in each row).
    local = absmax.float().view(rows, -1) if split_dim == 1 else absmax.float().view(1, -1)
    whole = all_gather_along(local.contiguous(), tp, 1)
    flat = whole.reshape(-1)
    # bitsandbytes' compress_statistics, on the whole matrix's absmax: less the mean, 8-bit blockwise (256).
    offset = flat.mean()
    packed, state2 = F.quantize_blockwise(flat - offset, blocksize=256)
    restored = (F.dequantize_blockwise(packed, state2) + offset).view(whole.shape)
    return restored.chunk(tp.world_size, dim=1)[tp.rank].reshape(-1).contiguous()


def quantize_base(model: nn.Module, *, double_quant: bool, compute: str, tp: Any = None) -> int:
    """Pack the weight of every tensor-parallel linear layer of `model`'s blocks (the output head and the
    embeddings stay in the job's precision, as in transformers' QLoRA); returns how many were packed."""
    from rayspeed.parallel.layers import ColumnParallelLinear, RowParallelLinear

    n = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or layer.quantized is not None:
            continue
        w = layer.weight
        layer.quantized = Nf4Weight(
            w, double_quant=double_quant, compute=compute_dtype(compute, w.dtype),
            split_dim=1 if isinstance(layer, RowParallelLinear) else 0, tp=tp, name=f"{name}.weight")
        layer.weight = None  # the dense copy goes; the parameter's name stays out of the module's state
        n += 1
    return n
