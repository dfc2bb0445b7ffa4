"""Save a tiny Llama-family causal LM with `save_pretrained`: random weights, no download.

    python scripts/make_tiny_hf_model.py OUT [--arch llama|mistral|qwen2|qwen3|olmo2|gemma3_text] [--vocab 256]
        [--hidden 64] [--layers 2] [--heads 4] [--kv-heads 2] [--ffn 128] [--tied]
        [--rope llama3|linear|yarn|longrope|default] [--max-positions 512] [--seed 0] [--shards N] [--head-dim N]
        [--sliding-window N]
        [--layer-types full_attention,sliding_attention,...] [--local-rope-theta X] [--partial-rotary F]

Every weight is drawn from N(0, 0.2) (norm weights around 1) rather than transformers' initialisation, whose
zero biases and unit norms would let a wrong bias or norm mapping go unnoticed in parity tests. A vocabulary of
256 or more lets rayspeed's byte tokenizer feed the model. `--tokenizer` also saves a tokenizer whose ids are
the UTF-8 bytes (the byte tokenizer's), so the folder is a complete Hugging Face model.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))


def hf_config(arch: str = "llama", vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, ffn: int = 128, tied: bool = False, rope: str = "default",
              max_positions: int = 512, rope_theta: float = 10000.0, head_dim: int | None = None,
              sliding_window: int | None = None, layer_types: list[str] | None = None,
              local_rope_theta: float | None = None, partial_rotary: float | None = None,
              softcaps: tuple[float, float] | None = None) -> Any:
    import transformers

    from rayspeed import families
    from rayspeed.config.shape import ModelShape, rope_fields
    from rayspeed.families.family import QUERY_SCALE_KEY

    half = int((head_dim or hidden // heads) * (partial_rotary or 1.0)) // 2
    scaling = {"default": None,
               "linear": {"rope_type": "linear", "factor": 2.0},
               "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 256},
               # An original context of 8 positions: the tests' sequences go past it (yarn's ramp and longrope's
               # long factors apply there; longrope's short ones within it).
               "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
               "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 8,
                            "long_factor": [1.0 + 0.75 * i for i in range(half)],
                            "short_factor": [1.0 + 0.1 * i for i in range(half)]}}[rope]
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta} if scaling is None else {
        **scaling, "rope_theta": rope_theta}
    kwargs: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=max_positions, tie_word_embeddings=tied,
                                  rope_parameters=rope_parameters, rms_norm_eps=1e-6, bos_token_id=None,
                                  eos_token_id=None, pad_token_id=None)
    if head_dim is not None:  # a family that reads config.json's head_dim (Qwen3): a width other than hidden/heads
        kwargs["head_dim"] = head_dim
    # The family's own keys as an export writes them (the window and layer types given here, no extra biases).
    family = families.by_model_type(arch)
    scalar = family.defaults.get(QUERY_SCALE_KEY) if family.keys.reads(QUERY_SCALE_KEY) else None
    shape = ModelShape(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       ffn_hidden_size=ffn, vocab_size=vocab, seq_len=max_positions, tie_embeddings=tied,
                       rope_theta=rope_theta, architecture=family.architecture, head_dim=head_dim or 0,
                       hidden_act=family.keys.activations[0], sliding_window=sliding_window,
                       layer_types=tuple(layer_types or ()), rope_local_theta=local_rope_theta,
                       query_pre_attn_scalar=scalar, partial_rotary_factor=partial_rotary or 1.0,
                       attn_logit_softcapping=softcaps[0] if softcaps else None,
                       final_logit_softcapping=softcaps[1] if softcaps else None,
                       **rope_fields(scaling, max_positions))
    kwargs.update(family.export_extras(shape))
    return transformers.AutoConfig.for_model(arch, **kwargs)


def make_model(config: Any, seed: int = 0) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model.eval()


def save(out: str, arch: str = "llama", seed: int = 0, shards: int = 1, tokenizer: bool = False, **shape: Any) -> Any:
    """Create and save the model into `out`; returns the transformers model."""
    model = make_model(hf_config(arch, **shape), seed)
    kwargs: dict[str, Any] = {}
    if shards > 1:  # a byte budget that yields about `shards` files
        total = sum(p.numel() * 4 for p in model.parameters())
        kwargs["max_shard_size"] = max(1, total // shards + 1)
    model.save_pretrained(out, **kwargs)
    if tokenizer:
        from rayspeed.model.hf_export import byte_tokenizer

        byte_tokenizer().save_pretrained(out)
    return model


def model_types() -> list[str]:
    from rayspeed import families

    return [f.model_type for f in families.FAMILIES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--arch", choices=model_types(), default="llama", help="the family's config.json model_type")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--rope", choices=("default", "linear", "llama3", "yarn", "longrope"), default="default")
    ap.add_argument("--max-positions", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--tokenizer", action="store_true", help="also save the byte-level tokenizer")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="attention head width, for a family that reads config.json's head_dim (qwen3, gemma3_text)")
    ap.add_argument("--sliding-window", type=int, default=None, help="sliding-window attention of this length")
    ap.add_argument("--layer-types", default=None,
                    help="comma-separated full_attention / sliding_attention per layer (default: every layer slides)")
    ap.add_argument("--local-rope-theta", type=float, default=None,
                    help="RoPE base of the sliding layers (gemma3_text)")
    ap.add_argument("--partial-rotary", type=float, default=None,
                    help="share of each head RoPE rotates (phi3: Phi-4-mini's 0.75)")
    a = ap.parse_args(argv)
    save(a.out, a.arch, a.seed, a.shards, a.tokenizer, vocab=a.vocab, hidden=a.hidden, layers=a.layers,
         heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn, tied=a.tied, rope=a.rope, max_positions=a.max_positions,
         head_dim=a.head_dim, sliding_window=a.sliding_window,
         layer_types=a.layer_types.split(",") if a.layer_types else None, local_rope_theta=a.local_rope_theta,
         partial_rotary=a.partial_rotary)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
