"""The model builds what the family's record and its model module say: the composition of parts
(rayspeed.model.families, the Llama decoder for a family without one), and q/o widths of heads * head_dim where the
head width is not hidden / heads."""

from __future__ import annotations

import pytest
import torch

from rayspeed import families
from rayspeed.config.hf_checkpoint import param_shapes
from rayspeed.config.shape import ModelShape
from rayspeed.families.family import HEAD_DIM_KEY, ConfigKeys, Family, llama_tensor_names
from rayspeed.model import Transformer
from rayspeed.model.families import composition_of, compositions
from rayspeed.model.parts.norms import OffsetRMSNorm, RMSNorm
from rayspeed.model.transformer import Block, block_class

WIDE = Family(architectures=("WideHeadForCausalLM",), model_type="wide_head",
              tensor_names=llama_tensor_names(qkv_bias=True), keys=ConfigKeys(optional=(HEAD_DIM_KEY,)))


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (WIDE,))
    return ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=64,
                      vocab_size=256, seq_len=16, tie_embeddings=False, architecture="WideHeadForCausalLM",
                      qkv_bias=True)


def test_each_family_is_composed_once_and_the_others_are_the_llama_decoder():
    composed = [f for model in compositions() for f in model.families]
    assert len(composed) == len({id(f) for f in composed})  # no family in two modules
    assert [f.model_type for f in composed] == ["deepseek_v3", "gemma2", "gemma3_text", "glm4_moe", "gpt_oss",
                                                  "llama", "olmo2", "qwen3", "qwen3_moe"]
    for fam in families.FAMILIES:
        shape = ModelShape(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                           vocab_size=256, seq_len=8, tie_embeddings=True, architecture=fam.architecture)
        model = composition_of(fam)
        assert block_class(shape) is model.block and issubclass(model.block, Block)
        assert (model.norm is OffsetRMSNorm) == model.embed_scale == fam.model_type.startswith("gemma")
        if fam.model_type in ("llama", "mistral", "mixtral", "phi3", "qwen2"):
            assert (model.block, model.norm) == (Block, RMSNorm)


def test_a_family_no_module_composes_is_the_llama_decoder(wide):
    assert composition_of(WIDE).block is Block and composition_of(WIDE).families == (WIDE,)


def test_the_model_of_a_wide_head_family_has_the_checkpoints_shapes_and_runs(wide):
    assert (wide.head_dim, wide.q_dim, wide.kv_dim) == (16, 64, 32)
    model = Transformer(wide, seed=1)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == param_shapes(wide)
    assert sum(p.numel() for p in model.parameters()) == wide.params
    ids = torch.randint(0, 256, (2, 16))
    loss = model(ids, ids)
    assert torch.isfinite(loss)
