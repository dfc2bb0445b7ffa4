"""Model transforms run in their declared order on a built model (rayspeed.engine.transforms): recomputation set
on every block after build gives the same loss and gradients as none; tensor parallelism and the pipeline split
are reported as done at build; the slots stay empty until a feature fills them."""

import torch

from rayspeed.config.load import parse
from rayspeed.engine.transforms import ORDER, apply_transforms

MODEL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=256,
             seq_len=16)


def _cfg(**parallel):
    resolved = {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0, "sequence_parallel": False, **parallel}
    return parse({"name": "t", "model": MODEL, "parallel": resolved, "cluster": {"num_workers": 4}})


def _model():
    from rayspeed.model.transformer import Transformer

    return Transformer(_cfg().model, seed=7)


def test_the_declared_order():
    # image_path after adapters: an adapter job freezes every base weight, then the projector trains again in full
    assert [t.name for t in ORDER] == ["tensor_parallel", "expert_parallel", "pipeline_split", "router_freeze",
                                       "adapters", "image_path", "context_parallel", "activation_checkpointing",
                                       "compile"]
    assert all(t.name_map for t in ORDER)


def test_recomputation_on_a_built_model_changes_nothing_but_memory():
    from rayspeed.model.transformer import Block

    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, recomputed = _model(), _model()
    assert apply_transforms(plain, _cfg(activation_checkpointing="none"), None, on_gpu=False) == []
    done = apply_transforms(recomputed, _cfg(activation_checkpointing="selective"), None, on_gpu=False)
    assert done == [("activation_checkpointing", "selective on 2 blocks")]
    assert all(b.activation_checkpointing == "selective" for b in recomputed.modules() if isinstance(b, Block))
    losses = []
    for m in (plain, recomputed):
        loss = m(x, x)
        loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=0, atol=0)
    for a, b in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_build_time_transforms_are_reported():
    done = dict(apply_transforms(_model(), _cfg(tp=2, pp=2, dp=1, zero_stage=0, activation_checkpointing="full"),
                                 None, on_gpu=False))
    assert done["tensor_parallel"] == "tp 2 (at build)"
    assert done["pipeline_split"] == "pp 2 (at build)"
    assert list(done) == ["tensor_parallel", "pipeline_split", "activation_checkpointing"]
