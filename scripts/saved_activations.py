"""What one block of the platform's model keeps for backward, measured on CPU, against the planner's formula.

    python scripts/saved_activations.py [--by-op]   # one JSON line per case (bench.py --only activation_memory)

`measure_block` builds one block (rayspeed.model.transformer's, or the shape's family block) at tp = 1, runs its
forward on a [micro_batch, seq, hidden] input under torch.autograd.graph.saved_tensors_hooks and adds up the bytes of
the distinct tensors autograd saved (deduplicated by storage, each storage counted once, with its whole nbytes);
tensors whose storage is a parameter's are left out: only activations count. Recomputation is the model's own
(Block.activation_checkpointing, the attribute the activation_checkpointing transform sets): under "selective" and
"full" the non-reentrant checkpoint saves the checkpointed function's inputs through the outer hooks, the rest
through its own, so what is seen is exactly what stays alive until backward.

`predicted` is the planner's kept term (rayspeed.planner.memory.activation_bytes) per token per block, in bytes:
the difference between the activations of a 2-block and a 1-block model at pp = 1, so the mode's arithmetic is the
planner's own, not a copy of it (or layer_saved's attention / MLP term, for a sub-block, through block_saved).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "platform"))

from rayspeed.config.layout import Layout  # noqa: E402
from rayspeed.config.load import load  # noqa: E402
from rayspeed.config.shape import ModelShape  # noqa: E402
from rayspeed.model.transformer import CHECKPOINTING_MODES, block_class  # noqa: E402
from rayspeed.planner.memory import activation_bytes, block_saved  # noqa: E402
from rayspeed.planner.search import build_ctx  # noqa: E402

CONFIG = ROOT / "configs" / "tiny-cpu.yaml"

# (overrides of configs/tiny-cpu.yaml's model section, micro-batch): MHA, GQA 2:1 and 4:1, a Qwen3 shape (q/k
# norms, head_dim 32 != hidden / heads), an OLMo 2 shape (post-norms, q/k norms over the projections) and a Gemma 3
# shape (four (1 + w) norms, GeGLU, a sliding window shorter than the sequence) and a Gemma 2 shape (soft-capped
# attention scores, materialised).
CASES: tuple[tuple[dict, int], ...] = (
    (dict(hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=192, seq_len=64), 2),
    (dict(hidden_size=96, num_heads=6, num_kv_heads=3, ffn_hidden_size=256, seq_len=128), 1),
    (dict(hidden_size=128, num_heads=8, num_kv_heads=2, ffn_hidden_size=320, seq_len=64), 4),
    (dict(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=256, head_dim=32,
          architecture="Qwen3ForCausalLM"), 1),
    (dict(hidden_size=96, num_heads=6, num_kv_heads=3, ffn_hidden_size=256, seq_len=128,
          architecture="Olmo2ForCausalLM"), 2),
    (dict(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=128, head_dim=32,
          architecture="Gemma3ForCausalLM", sliding_window=32, query_pre_attn_scalar=32, tie_embeddings=True), 2),
    (dict(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, seq_len=64, head_dim=32,
          architecture="Gemma2ForCausalLM", attn_logit_softcapping=50.0, tie_embeddings=True), 2),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def case_config(model: dict, micro_batch: int, precision: str = "fp32"):
    """configs/tiny-cpu.yaml with this model section, one block, this precision and micro-batch."""
    sets = [f"model.{k}={v}" for k, v in model.items()] + [
        "model.num_layers=1", f"train.precision={precision}", f"parallel.micro_batch_size={micro_batch}"]
    return load(str(CONFIG), sets)


def saved_bytes_by_op(out: torch.Tensor, kept: dict) -> dict[str, int]:
    """Bytes of the kept storages by the autograd node that saved them (the first node found in the graph that
    holds each one); "?" for a storage no node names."""
    names: dict[int, str] = {}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                vals = getattr(node, attr)
            except RuntimeError:  # freed or not unpackable
                continue
            for v in vals if isinstance(vals, (tuple, list)) else (vals,):
                if isinstance(v, torch.Tensor):
                    names.setdefault(v.untyped_storage().data_ptr(), f"{node.name()}.{attr[len('_saved_'):]}")
        todo.extend(n for n, _ in node.next_functions)
    by_op: dict[str, int] = {}
    for ptr, nbytes in kept.items():
        key = names.get(ptr, "?")
        by_op[key] = by_op.get(key, 0) + nbytes
    return dict(sorted(by_op.items()))


PARTS = ("block", "attn", "mlp")


def measure_block(cfg, mode: str, dtype: torch.dtype, micro_batch: int, part: str = "block", seed: int = 0,
                  by_op: bool = False) -> dict[str, Any]:
    """Bytes per token that one block keeps for backward (see the module's docstring). part "attn" / "mlp": only
    that sub-block (its norm and attention, or its norm and SwiGLU) without recomputation, through the block's
    public modules, to compare with layer_saved's attention and MLP terms."""
    dims = ModelShape.from_config(cfg.model)
    torch.manual_seed(seed)
    block = block_class(dims)(dims, 0, activation_checkpointing=mode, seed=seed).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(micro_batch, dims.seq_len, dims.hidden_size, dtype=dtype, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t

    run = {"block": block, "attn": block.attn_branch, "mlp": block.mlp_branch}[part]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(x)
    tokens = micro_batch * dims.seq_len
    res: dict[str, Any] = {"bytes": sum(kept.values()), "bytes_per_token": sum(kept.values()) / tokens}
    if by_op:  # reading a checkpointed node's saved tensors would recompute it: name those by the mode
        res["by_op"] = saved_bytes_by_op(out, kept) if mode == "none" else {f"{mode}_inputs": res["bytes"]}
    out.float().sum().backward()  # the graph is whole: the saved tensors were enough for backward
    return res


def planner_ctx(cfg, precision: str):
    return dataclasses.replace(build_ctx(cfg, world_size=1), precision=precision)


def predicted(cfg, mode: str, precision: str, micro_batch: int, part: str = "block") -> float:
    """The planner's bytes per token per block. block: activation_bytes' kept term (the difference between a
    2-block and a 1-block model at pp = 1, tp = 1); attn / mlp: layer_saved's sub-block terms (mode none)."""
    ctx = planner_ctx(cfg, precision)
    lay = Layout(1, 1, 1, 0, micro_batch, 1, False, mode)
    if part != "block":
        return block_saved(ctx, lay)[PARTS.index(part)] * ctx.w_bytes
    two = dataclasses.replace(ctx, shape=dataclasses.replace(ctx.shape, num_layers=2))
    one = dataclasses.replace(ctx, shape=dataclasses.replace(ctx.shape, num_layers=1))
    return (activation_bytes(two, lay, 0) - activation_bytes(one, lay, 0)) / (micro_batch * ctx.shape.seq_len)


def compare(model: dict, micro_batch: int, mode: str, precision: str, part: str = "block",
            by_op: bool = False) -> dict[str, Any]:
    """One case: the shape, mode and dtype, the planner's prediction, the measurement and their ratio."""
    cfg = case_config(model, micro_batch, precision)
    dims = ModelShape.from_config(cfg.model)
    res = measure_block(cfg, mode, DTYPES[precision], micro_batch, part, by_op=by_op)
    got = res["bytes_per_token"]
    pred = predicted(cfg, mode, precision, micro_batch, part)
    line = {"bench": "activation_memory", "architecture": dims.architecture, "hidden_size": dims.hidden_size,
            "num_heads": dims.num_heads, "num_kv_heads": dims.num_kv_heads, "head_dim": dims.head_dim,
            "ffn_hidden_size": dims.ffn_hidden_size, "seq_len": dims.seq_len, "micro_batch_size": micro_batch,
            "mode": mode, "dtype": precision, "predicted_bytes_per_token_per_block": round(pred, 2),
            "measured": round(got, 2), "ratio": round(got / pred, 4)}
    if part != "block":
        line["part"] = part
    if by_op:
        line["measured_by_op"] = res["by_op"]
    return line


def all_cases(by_op: bool = False) -> list[dict[str, Any]]:
    """The bench's lines: every case, dtype and mode, whole block."""
    return [compare(m, mb, mode, prec, by_op=by_op) for m, mb in CASES for prec in DTYPES
            for mode in CHECKPOINTING_MODES]


if __name__ == "__main__":
    torch.set_num_threads(1)
    for line in all_cases(by_op="--by-op" in sys.argv):
        print(json.dumps(line), flush=True)
