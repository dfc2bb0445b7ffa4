"""Planner arithmetic: parameter counts, FLOPs, bytes per parameter, ZeRO divisions, activations, rules."""

import dataclasses
import math

import pytest

from rayspeed.config.layout import Layout
from rayspeed.config.load import parse
from rayspeed.config.shape import ModelShape
from rayspeed.planner import hardware
from rayspeed.planner.memory import (
    activation_bytes,
    bytes_per_param,
    layer_saved,
    logits_bytes,
    model_state_bytes,
    stage_breakdown,
)
from rayspeed.planner.model_math import max_stage_params, stage_params
from rayspeed.planner.rules import comm_profile, lr_rule
from rayspeed.planner.search import accumulation_cap, build_ctx
from rayspeed.planner.timing import Link, collective_s

LLAMA2_7B = ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008,
                       vocab_size=32000, seq_len=4096, tie_embeddings=False)
LLAMA2_70B = ModelShape(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
                        vocab_size=32000, seq_len=4096, tie_embeddings=False)


def test_llama2_7b_parameter_count():
    assert LLAMA2_7B.params == 6_738_415_616  # the published 6.74B
    assert LLAMA2_7B.layer_params == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096


def test_llama2_70b_parameter_count_with_gqa():
    # 8 kv heads: k and v are 8192 x 1024 each.
    assert round(LLAMA2_70B.params / 1e9, 2) == 68.98


def test_tied_embeddings_are_counted_once():
    tied = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=256, vocab_size=256,
                      seq_len=128, tie_embeddings=True)
    untied = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_hidden_size=256, vocab_size=256,
                        seq_len=128, tie_embeddings=False)
    assert untied.params - tied.params == 256 * 64


def test_flops_per_token_is_palms_6n_non_embedding_plus_attention():
    sh = LLAMA2_7B  # untied: the input embedding is a lookup and does not count; the head is a matmul and does
    n = sh.params - sh.vocab_size * sh.hidden_size
    assert sh.non_embedding_params == n
    assert sh.flops_per_token == 6 * n + 12 * sh.num_layers * sh.hidden_size * sh.seq_len
    tied = dataclasses.replace(sh, tie_embeddings=True)  # the shared matrix counts once, as the head
    assert tied.non_embedding_params == tied.params


def test_stage_params_split_tp_and_pp():
    sh = LLAMA2_7B
    # tp splits the matrices and the vocab-parallel embedding/head; norms are replicated.
    assert stage_params(sh, 2, 1, 0) == (32 * (sh.layer_matrix_params // 2 + 2 * sh.hidden_size)
                                         + 2 * sh.vocab_size * sh.hidden_size // 2 + sh.hidden_size)
    # pp: first stage holds the embedding, last the final norm and head; all stages add up to the model.
    total = sum(stage_params(sh, 1, 4, st) for st in range(4))
    assert total == sh.params
    assert stage_params(sh, 1, 4, 0) == 8 * sh.layer_params + sh.vocab_size * sh.hidden_size
    assert stage_params(sh, 1, 4, 3) == 8 * sh.layer_params + sh.vocab_size * sh.hidden_size + sh.hidden_size
    assert max_stage_params(sh, 1, 4) == stage_params(sh, 1, 4, 3)


def test_tied_head_is_a_second_copy_on_the_last_stage():
    sh = ModelShape(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, ffn_hidden_size=256, vocab_size=256,
                    seq_len=128, tie_embeddings=True)
    assert stage_params(sh, 1, 1, 0) == sh.params
    assert stage_params(sh, 1, 2, 0) + stage_params(sh, 1, 2, 1) == sh.params + sh.vocab_size * sh.hidden_size


def test_playbook_16_and_20_bytes_per_param():
    assert sum(bytes_per_param("bf16", "bf16").values()) == 16  # 2 + 2 + 4 + 8
    assert sum(bytes_per_param("bf16", "fp32").values()) == 20  # + fp32 gradient accumulation
    assert sum(bytes_per_param("fp32", "fp32").values()) == 16  # fp32 weights/grads, Adam, no master copy


@pytest.mark.parametrize("stage,expected", [
    (0, 2 + 2 + 4 + 8),
    (1, 2 + 2 + (4 + 8) / 8),  # optimizer states and master weights / dp
    (2, 2 + (2 + 4 + 8) / 8),  # + gradients / dp
    (3, (2 + 2 + 4 + 8) / 8),  # everything / dp
])
def test_zero_divisions(stage, expected):
    b = model_state_bytes(1000, "bf16", "bf16", stage, 8)
    assert sum(b.values()) == pytest.approx(1000 * expected)


def test_activations_by_checkpointing_mode_and_sequence_parallel():
    cfg = parse({"model": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "ffn_hidden_size": 11008,
                           "vocab_size": 32000, "seq_len": 4096, "tie_embeddings": False},
                 "train": {"global_batch_size": 64}, "cluster": {"num_workers": 8, "use_gpu": True}})
    ctx = build_ctx(cfg)

    def acts(tp, sp, mode, pp=1, ga=8):
        return activation_bytes(ctx, Layout(8 // (tp * pp), tp, pp, 1, 1, ga, sp, mode), 0)

    none, sel, full = acts(1, False, "none"), acts(1, False, "selective"), acts(1, False, "full")
    assert none > sel > full
    # Per layer, without recomputation: the block keeps ~45h bytes per token (playbook GPT-3: 34h).
    total, _, _ = layer_saved(ctx.shape, 1, False)
    assert 20 < total / ctx.shape.hidden_size < 26
    # Sequence parallel divides everything by tp but RoPE's [s, head_dim] tables; tp alone leaves the norm region
    # replicated.
    rope = 2 * 2 * ctx.shape.head_dim
    t_sp, t_nosp = layer_saved(ctx.shape, 4, True)[0], layer_saved(ctx.shape, 4, False)[0]
    assert t_sp == pytest.approx((total - rope) / 4 + rope)
    assert total / 4 < t_nosp < total
    # 1F1B: the first stage holds pp micro-batches in flight, the last one.
    lay = Layout(2, 1, 4, 1, 1, 8, False, "none")
    assert activation_bytes(ctx, lay, 0) > 3 * activation_bytes(ctx, lay, 3)


def test_loss_buffers_are_one_chunk_of_the_rank_vocabulary_slice_at_every_tp():
    cfg = parse({"model": {"hidden_size": 1024, "num_layers": 4, "num_heads": 8, "vocab_size": 32000,
                           "seq_len": 2048}, "train": {"global_batch_size": 8},
                 "cluster": {"num_workers": 2, "use_gpu": True}})
    ctx = build_ctx(cfg)
    tp1 = logits_bytes(ctx, Layout(2, 1, 1, 0, 4, 1, False, "none"), 0)
    tp2 = logits_bytes(ctx, Layout(1, 2, 1, 0, 8, 1, True, "none"), 0)
    assert tp1 == pytest.approx(2**26 * 10 + 4 * 32000 * 1024)  # one 2^26-element chunk + the head's fp32 gradient
    assert tp2 == pytest.approx(2**26 * 10 + 4 * 32000 / 2 * 1024)  # the same chunk, of this rank's vocabulary half
    assert logits_bytes(ctx, Layout(1, 1, 2, 0, 8, 1, False, "none"), 0) == 0  # not on the first stage


def test_breakdown_has_every_component_and_context():
    cfg = parse({"train": {"global_batch_size": 16}, "cluster": {"num_workers": 2, "use_gpu": True}})
    br = stage_breakdown(build_ctx(cfg), Layout(2, 1, 1, 1, 8, 1, False, "none"), 0)
    assert br["cuda_context"] >= 0.75 * 2**30 and br["allocator_slack"] > 0


def test_lr_rule_and_its_floor():
    r = lr_rule(1024, 128)
    assert r["lr"] == pytest.approx(1e-4)  # log2(128)/7 = 1
    r = lr_rule(256, 8)
    assert r["lr"] == pytest.approx(1e-4 * 0.5 * 3 / 7)
    one = lr_rule(1024, 1)
    assert one["lr"] == pytest.approx(1e-4 / 7) and one["lr"] > 0 and "floored" in one


def test_accumulation_cap():
    cfg = parse({"model": {"hidden_size": 8192, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8,
                           "ffn_hidden_size": 28672, "vocab_size": 32000, "seq_len": 4096, "tie_embeddings": False},
                 "train": {"global_batch_size": 1024}, "cluster": {"num_workers": 64, "use_gpu": True}})
    ctx = build_ctx(cfg)
    assert accumulation_cap(ctx) == math.floor(2048 / (ctx.shape.params / 1e9 * 64**0.33)) == 7


def test_collective_cost_grows_with_bytes_and_ranks():
    link = Link(100.0, 10.0, 1.0)
    assert collective_s(1e9, 1, link, "allreduce") == 0
    ar = collective_s(1e9, 8, link, "allreduce")
    ag = collective_s(1e9, 8, link, "all_gather")
    assert ar == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + (10 + 6) * 1e-6)
    assert ag < ar
    assert collective_s(1e6, 512, link, "all_gather") > collective_s(1e6, 8, link, "all_gather")


@pytest.mark.parametrize("gpus,algo,async_eh",
                         [(8, None, False), (64, None, False), (256, None, True), (512, None, True)])
def test_comm_profile_by_cluster_size(gpus, algo, async_eh):
    cfg = parse({"train": {"global_batch_size": 1024}, "cluster": {"num_workers": gpus, "use_gpu": True}})
    ctx = build_ctx(cfg)
    prof = comm_profile(ctx, Layout(gpus, 1, 1, 1, 1, 1024 // gpus, False, "none"), 600)
    # The field guide's Tree for 9-64 GPUs is a hypothesis: tested with every all-reduce forced to a tree against
    # NCCL's own per-call choice, which already takes trees where its cost model prefers them.
    assert prof["env"].get("NCCL_ALGO") == algo
    test = prof.get("nccl_algo_test")
    assert (test is not None) is (8 < gpus <= 64)
    if test:
        assert not test["applied"] and test["step_time_s_tree_forced"] >= test["step_time_s_nccl_choice"]
    assert (prof["env"].get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1") is async_eh
    for bad in ("NCCL_SOCKET_TIMEOUT", "NCCL_TIMEOUT", "NCCL_MAX_NTHREADS", "NCCL_ASYNC_ERROR_HANDLING"):
        assert bad not in prof["env"]


def test_hardware_table_and_overrides():
    assert set(hardware.NAMES) >= {"h100-sxm-80gb", "h100-pcie-80gb", "h200", "a100-80gb", "a100-40gb", "l40s", "cpu"}
    hw = hardware.get("h200", {"inter_node_gbps": 25.0})
    assert hw.inter_node_gbps == 25.0 and hw.memory_gib > 130
    assert hardware.get("h100-sxm-80gb").gemm_efficiency == pytest.approx(790 / 989, abs=0.01)
    with pytest.raises(KeyError):
        hardware.get("h200", {"warp_drive": 1})
