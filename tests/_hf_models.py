"""Tiny Hugging Face models for the tests, made by scripts/make_tiny_hf_model.py (random weights, no download)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_hf_model.py"
_spec = importlib.util.spec_from_file_location("make_tiny_hf_model", _SCRIPT)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

# GQA (4 query heads, 2 kv heads), q/k/v biases, untied head, linear RoPE scaling.
QWEN = dict(arch="qwen2", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=False, rope="linear",
            max_positions=64)
# Tied embeddings, llama3 RoPE scaling (all three frequency bands are hit with head_dim 8).
LLAMA_TIED = dict(arch="llama", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=True,
                  rope="llama3", max_positions=512)

# Qwen3: per-head q/k norms, a head width (16) other than hidden / heads (8), tied embeddings.
QWEN3 = dict(arch="qwen3", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=True, rope="default",
             max_positions=64, head_dim=16)
# OLMo 2: post-norms, q/k norms over the whole projections (heads x head_dim), untied head.
OLMO2 = dict(arch="olmo2", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=False, rope="default",
             max_positions=64)

# Gemma 3 (text): four (1 + w) norms per block, per-head q/k norms, GeGLU, a scaled embedding, the attention scale
# query_pre_attn_scalar^-0.5 (256, not head_dim 16), local layers (window 5, shorter than the tests' sequences) with
# their own RoPE base around a global one with linear scaling, tied embeddings.
GEMMA3 = dict(arch="gemma3_text", vocab=256, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64, tied=True,
              rope="linear", max_positions=64, head_dim=16, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], local_rope_theta=100.0)
# Sliding windows shorter than the tests' sequences: Mistral's on every layer, Qwen2's on the layers it names.
MISTRAL_SWA = dict(arch="mistral", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=False,
                   rope="default", max_positions=64, sliding_window=5)
QWEN2_SWA = dict(arch="qwen2", vocab=256, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64, tied=False,
                 rope="linear", max_positions=64, sliding_window=6,
                 layer_types=["full_attention", "sliding_attention", "sliding_attention"])

# Long-context RoPE past an original context of 8 positions: yarn on Qwen3 (its published long-context form),
# longrope on Llama (head_dim 8: four long and four short factors; max_position_embeddings 64 gives factor 8).
QWEN3_YARN = dict(QWEN3, rope="yarn")
LLAMA_LONGROPE = dict(arch="llama", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=False,
                      rope="longrope", max_positions=64)

# Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, a window (5) on every layer, longrope past 8 positions;
# the Phi-4-mini form rotates half of each head (partial_rotary_factor; head_dim 16 here, 8 rotated).
PHI3 = dict(arch="phi3", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tied=False, rope="longrope",
            max_positions=64, sliding_window=5)
PHI4_MINI = dict(arch="phi3", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=64, tied=True,
                 rope="default", max_positions=64, partial_rotary=0.5)

# Gemma 2: Gemma 3's block without q/k norms, one RoPE base, soft-capped attention scores and final logits (caps
# of 2 and 3, low enough for the tiny model's scores and logits to reach them), local layers of window 5.
GEMMA2 = dict(arch="gemma2", vocab=256, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64, tied=True,
              rope="default", max_positions=64, head_dim=16, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], softcaps=(2.0, 3.0))


def save(out, spec, seed=0, shards=1, tokenizer=False):
    spec = dict(spec)
    arch = spec.pop("arch")
    return tiny.save(str(out), arch, seed=seed, shards=shards, tokenizer=tokenizer, **spec)


def shape_of(model_dir, seq_len):
    """The ModelShape rayspeed resolves for the checkpoint (through the job config path)."""
    from rayspeed.config.load import parse
    from rayspeed.config.shape import ModelShape

    cfg = parse({"model": {"seq_len": seq_len}},
                [f"model.pretrained={model_dir}"])
    return ModelShape.from_config(cfg.model)


def first_batch_loss(home, model_dir, seq, batch, seed):
    """(transformers' mean next-token loss on step 1's global batch, that batch), rebuilt from the job's own data
    cache (a job on configs/tiny-pretrained-cpu.yaml: python-stdlib, byte tokenizer)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from rayspeed.data import build_token_file, make_schedule

    tf = build_token_file("python-stdlib", None, "bytes", str(Path(home) / "runs" / ".cache" / "data"))
    train, _ = tf.split(0.01, seq)
    windows = torch.from_numpy(train.windows(make_schedule(train, seq, batch, seed).indices(0), seq))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item(), windows
