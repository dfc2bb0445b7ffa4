"""The model builds what the family's record says: its block module, and q/o widths of heads * head_dim where the
head width is not hidden / heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rayspeed import families
from rayspeed.config.hf_checkpoint import param_shapes
from rayspeed.config.shape import ModelShape
from rayspeed.families.family import HEAD_DIM_FROM_CONFIG, Family
from rayspeed.model import Transformer
from rayspeed.model.transformer import Block, block_class

WIDE = Family(architectures=("WideHeadForCausalLM",), model_type="wide_head",
              head_dim_rule=HEAD_DIM_FROM_CONFIG, qkv_bias=True)


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (WIDE,))
    return ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=64,
                      vocab_size=256, seq_len=16, tie_embeddings=False, architecture="WideHeadForCausalLM",
                      qkv_bias=True)


def test_the_families_without_a_block_module_use_the_decoders_block():
    for fam in (f for f in families.FAMILIES if f.block_module is None):
        shape = ModelShape(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                           vocab_size=256, seq_len=8, tie_embeddings=True, architecture=fam.architecture)
        assert block_class(shape) is Block


def test_a_family_naming_a_block_module_gets_that_modules_block(monkeypatch):
    own = dataclasses.replace(WIDE, block_module="transformer")
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (own,))
    shape = ModelShape(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=256,
                       seq_len=8, tie_embeddings=True, architecture="WideHeadForCausalLM")
    assert block_class(shape) is Block  # rayspeed.model.transformer.Block, found through the record
    missing = dataclasses.replace(WIDE, architectures=("NoBlockForCausalLM",), block_module="no_such_block")
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (missing,))
    with pytest.raises(ModuleNotFoundError):
        block_class(dataclasses.replace(shape, architecture="NoBlockForCausalLM"))


def test_the_model_of_a_wide_head_family_has_the_checkpoints_shapes_and_runs(wide):
    assert (wide.head_dim, wide.q_dim, wide.kv_dim) == (16, 64, 32)
    model = Transformer(wide, seed=1)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == param_shapes(wide)
    assert sum(p.numel() for p in model.parameters()) == wide.params
    ids = torch.randint(0, 256, (2, 16))
    loss = model(ids, ids)
    assert torch.isfinite(loss)
