"""QLoRA parity with peft + bitsandbytes: the same checkpoint loaded by transformers with an NF4 BitsAndBytesConfig
(the base's linear layers packed at load, embeddings and head in fp32), the same adapter weights, fp32 compute,
rtol = atol = 1e-5: logits, loss and every adapter gradient at tp1, with and without double quantization, for LoRA
and DoRA; and at tp2 with sequence parallelism, where each rank quantizes its shard of the whole matrix's blocks
(exactly tp1's weights: rayspeed.adapters.nf4). The model is wide enough (hidden 128, ffn 256) that every tp2 shard
is a whole number of 64-element NF4 blocks."""

from __future__ import annotations

import pytest
import torch
from test_adapters_peft_parity import _adapter_grads, _check_grads, peft_pass, randomize_b

from _dist import run_distributed
from _hf_models import save, shape_of
from _hf_parity import TOL, build, init_deepspeed_gloo, tokens

pytest.importorskip("bitsandbytes")

WIDE = dict(arch="llama", vocab=256, hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, tied=False, rope="default",
            max_positions=64)
SEQ, BATCH = 16, 2


def _adapter(dora=False, double_quant=True):
    from rayspeed.config.schema import AdapterConfig

    return AdapterConfig(type="lora", rank=4, alpha=8.0, dora=dora, base_precision="nf4", double_quant=double_quant)


def _ids():
    return tokens(256, BATCH, SEQ, 5)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide") / "m"
    save(d, WIDE, seed=3)
    return str(d)


def qlora(shape, model_dir, adapter, tp=None, sp=False):
    from rayspeed.adapters.attach import add_adapters
    from rayspeed.adapters.nf4 import quantize_base

    model = build(shape, model_dir, tp, sp)
    assert quantize_base(model, double_quant=adapter.double_quant, compute=adapter.compute_dtype, tp=tp) == 7 * 2
    add_adapters(model, adapter, tp, sp, seed=1)
    randomize_b(model)
    return model


def peft_bnb_reference(model_dir, state, adapter, shape):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from rayspeed.adapters import peft_files

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_use_double_quant=adapter.double_quant)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quant,
                                              device_map="cpu")
    assert type(hf.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    peft = get_peft_model(hf, LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, use_dora=adapter.dora,
                                         target_modules=peft_files.target_modules(adapter, shape)))
    assert not set_peft_model_state_dict(peft, peft_files.peft_state(state, shape)).unexpected_keys
    # Training mode, as fine-tuning runs it: in eval mode bitsandbytes repacks the weights for its CPU inference
    # kernel (AVX512-BF16), a different function from the training path's dequantize-then-matmul.
    peft.train()
    return peft_pass(peft)


def _run(model):
    ids = _ids()
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return logits, loss.detach(), _adapter_grads(model.named_parameters())


@pytest.mark.parametrize("dora,double_quant", [(False, True), (False, False), (True, True)],
                         ids=["lora-double-quant", "lora-single-quant", "dora-double-quant"])
def test_tp1_qlora_matches_peft_and_bitsandbytes(base, dora, double_quant):
    shape = shape_of(base, SEQ)
    adapter = _adapter(dora, double_quant)
    model = qlora(shape, base, adapter)
    ref = peft_bnb_reference(base, model.full_state_dict(), adapter, shape)
    logits, loss, grads = _run(model)
    torch.testing.assert_close(logits, ref["logits"], **TOL)
    torch.testing.assert_close(loss, ref["loss"], **TOL)
    assert len(grads) == len(ref["grads"])
    _check_grads(grads, ref, shape)
    # The base is packed: no dense weight of a linear layer is left, and nothing of it is in the state dict.
    assert not [n for n in model.state_dict() if n.endswith(("wq.weight", "w_down.weight"))]
    dense = build(shape, base)
    with torch.no_grad():
        assert (dense(_ids()[:, :-1]) - logits).abs().max() > 1e-3  # 4 bits changed the function


def _tp2_ranks(rank, world_size, model_dir):
    from rayspeed.parallel.groups import ParallelGroups

    init_deepspeed_gloo()
    shape = shape_of(model_dir, SEQ)
    model = qlora(shape, model_dir, _adapter(), ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    state = model.full_state_dict()  # collective: every rank
    return (state if rank == 0 else None), _run(model)


def test_tp2_sequence_parallel_qlora_holds_tp1s_4bit_weights(base):
    shape = shape_of(base, SEQ)
    results = run_distributed(_tp2_ranks, 2, base, timeout_s=120)
    ref = peft_bnb_reference(base, results[0][0], _adapter(), shape)
    for rank, (_, (logits, loss, grads)) in enumerate(results):
        torch.testing.assert_close(logits, ref["logits"], **TOL, msg=lambda m: f"tp2 rank {rank} logits: {m}")
        torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"tp2 rank {rank} loss: {m}")
        _check_grads(grads, ref, shape, rank, 2, where=f"tp2 rank {rank}")


def test_a_shard_that_splits_nf4_blocks_is_refused():
    from rayspeed.adapters.nf4 import Nf4Weight

    with pytest.raises(ValueError, match="whole number of NF4 blocks"):
        Nf4Weight(torch.randn(32, 16), double_quant=True, compute=torch.float32, split_dim=1, tp=_Enabled(),
                  name="layers.0.attn.wo.weight")


class _Enabled:  # a tp2 rank's handle: the check runs before any collective
    enabled, world_size, rank = True, 2, 0


def test_casts_of_the_module_leave_the_packed_weight_and_its_statistics_alone():
    """DeepSpeed casts a half-precision job's module (module.bfloat16()): the codes stay uint8 and the block scales
    fp32, so the 4-bit weight is the one quantized at load; device moves still apply."""
    from rayspeed.adapters.nf4 import Nf4Weight

    w = torch.randn(64, 128)
    packed = Nf4Weight(w, double_quant=True, compute=torch.float32)
    before = packed.dequantize()
    packed.bfloat16().to("cpu")
    assert packed.codes.dtype == torch.uint8 and packed.state.absmax.dtype == torch.uint8  # 8-bit scales (double)
    assert packed.absmax2.dtype == torch.int32  # fp32 bits, untouched by the cast
    assert packed.state.state2.absmax.dtype == torch.float32
    torch.testing.assert_close(packed.dequantize(), before, rtol=0, atol=0)
    x = torch.randn(3, 128)
    torch.testing.assert_close(packed(x), x @ before.T, rtol=1e-6, atol=1e-6)
    assert packed.nbytes() == 64 * 128 // 2 + 128 + 4  # codes, one 8-bit scale per block, one fp32 per 256 scales
