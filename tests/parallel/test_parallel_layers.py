"""Tensor/sequence-parallel layers against their unsharded reference, in real gloo worlds.

One 2-process world runs every tp=2 parity check (process start-up dominates the cost);
each check records its own failure so each test below reports separately.
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist import run_distributed
from rayspeed.model.transformer import Transformer
from rayspeed.parallel.comm import split_along
from rayspeed.parallel.groups import ParallelGroups, TensorParallel, check_tp_within_nodes, layout
from rayspeed.parallel.layers import (
    NO_TP,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full,
)
from rayspeed.parallel.loss import linear_cross_entropy, vocab_parallel_cross_entropy

SEED = 7
ATOL, RTOL = 1e-5, 1e-4


def _close(actual, expected, what):
    if not torch.allclose(actual, expected, atol=ATOL, rtol=RTOL):
        raise AssertionError(f"{what}: max abs diff {(actual - expected).abs().max().item():.3e}")


def _data(*shape, seed=0):
    # Same values on every rank: every rank plays the reference too.
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tp_handle():
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    return TensorParallel.from_group(group)


# --- checks (run in every rank of the 2-process world) -----------------------------------------


def check_column(tp):
    x_full = _data(2, 6, 16, seed=1)
    g_full = _data(2, 6, 24, seed=2)
    ref = ColumnParallelLinear(16, 24, NO_TP, seed=SEED, name="col")
    x_ref = x_full.clone().requires_grad_()
    (ref(x_ref) * g_full).sum().backward()
    y_ref = ref(x_full).detach()

    for gather_output in (True, False):
        layer = ColumnParallelLinear(16, 24, tp, gather_output=gather_output, seed=SEED, name="col")
        _close(layer.weight.detach(), split_along(ref.weight.detach(), tp, 0), "column init slice")
        x = x_full.clone().requires_grad_()
        y = layer(x)
        g = g_full if gather_output else split_along(g_full, tp, -1)
        _close(y, y_ref if gather_output else split_along(y_ref, tp, -1), f"column out gather={gather_output}")
        (y * g).sum().backward()
        _close(x.grad, x_ref.grad, f"column input grad gather={gather_output}")
        _close(gather_full(layer.weight.grad, layer.weight, tp), ref.weight.grad, "column weight grad")

    # Sequence parallel: input sharded along the sequence, output full sequence / sharded features.
    layer = ColumnParallelLinear(16, 24, tp, sequence_parallel=True, seed=SEED, name="col")
    x = split_along(x_full, tp, 1).requires_grad_()
    y = layer(x)
    _close(y, split_along(y_ref, tp, -1), "column sp out")
    (y * split_along(g_full, tp, -1)).sum().backward()
    _close(x.grad, split_along(x_ref.grad, tp, 1), "column sp input grad")
    _close(gather_full(layer.weight.grad, layer.weight, tp), ref.weight.grad, "column sp weight grad")


def check_row(tp):
    x_full = _data(2, 6, 24, seed=3)
    g_full = _data(2, 6, 16, seed=4)
    ref = RowParallelLinear(24, 16, NO_TP, seed=SEED, name="row")
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g_full).sum().backward()
    y_ref = y_ref.detach()

    layer = RowParallelLinear(24, 16, tp, input_is_parallel=True, seed=SEED, name="row")
    _close(layer.weight.detach(), split_along(ref.weight.detach(), tp, 1), "row init slice")
    x = split_along(x_full, tp, -1).requires_grad_()
    y = layer(x)
    _close(y, y_ref, "row out")
    (y * g_full).sum().backward()
    _close(x.grad, split_along(x_ref.grad, tp, -1), "row input grad")
    _close(gather_full(layer.weight.grad, layer.weight, tp), ref.weight.grad, "row weight grad")

    layer = RowParallelLinear(24, 16, tp, input_is_parallel=False, seed=SEED, name="row")
    x = x_full.clone().requires_grad_()
    y = layer(x)
    _close(y, y_ref, "row out (split input)")
    (y * g_full).sum().backward()
    _close(x.grad, x_ref.grad, "row input grad (split input)")

    layer = RowParallelLinear(24, 16, tp, sequence_parallel=True, seed=SEED, name="row")
    x = split_along(x_full, tp, -1).requires_grad_()
    y = layer(x)
    _close(y, split_along(y_ref, tp, 1), "row sp out")
    (y * split_along(g_full, tp, 1)).sum().backward()
    _close(x.grad, split_along(x_ref.grad, tp, -1), "row sp input grad")
    _close(gather_full(layer.weight.grad, layer.weight, tp), ref.weight.grad, "row sp weight grad")


def check_embedding(tp):
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    g_full = _data(2, 6, 8, seed=6)
    ref = VocabParallelEmbedding(32, 8, NO_TP, seed=SEED, name="emb")
    y_ref = ref(ids)
    (y_ref * g_full).sum().backward()
    y_ref = y_ref.detach()

    for sp in (False, True):
        layer = VocabParallelEmbedding(32, 8, tp, sequence_parallel=sp, seed=SEED, name="emb")
        _close(layer.weight.detach(), split_along(ref.weight.detach(), tp, 0), "embedding init slice")
        y = layer(ids)
        g = split_along(g_full, tp, 1) if sp else g_full
        _close(y, split_along(y_ref, tp, 1) if sp else y_ref, f"embedding out sp={sp}")
        (y * g).sum().backward()
        _close(gather_full(layer.weight.grad, layer.weight, tp), ref.weight.grad, f"embedding grad sp={sp}")


def check_vocab_parallel_ce(tp):
    logits_full = _data(10, 32, seed=7) * 3
    labels = torch.randint(0, 32, (10,), generator=torch.Generator().manual_seed(8))
    labels[3] = -100
    ref_logits = logits_full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, labels, ignore_index=-100)
    ref.backward()

    shard = split_along(logits_full, tp, -1).requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, tp)
    assert loss.dtype == torch.float32
    _close(loss, ref.detach(), "vocab-parallel CE loss")
    loss.backward()
    _close(shard.grad, split_along(ref_logits.grad, tp, -1), "vocab-parallel CE grad")

    # Huge logits must not overflow (the max is subtracted before exp).
    big = split_along(logits_full * 1000, tp, -1)
    assert torch.isfinite(vocab_parallel_cross_entropy(big, labels, tp))

    # The fused head + loss used by the model: hidden [N, H], weight slice [V/tp, H].
    hidden = _data(10, 8, seed=9)
    weight = _data(32, 8, seed=10)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    F.cross_entropy(h_ref @ w_ref.t(), labels, ignore_index=-100).backward()
    h = hidden.clone().requires_grad_()
    w = split_along(weight, tp, 0).requires_grad_()
    loss = linear_cross_entropy(h, w, labels, tp)
    loss.backward()
    # Each rank's hidden grad covers its vocab slice only; the model's f operator sums them.
    h_grad = h.grad.clone()
    dist.all_reduce(h_grad, group=tp.group)
    _close(h_grad, h_ref.grad, "linear CE hidden grad")
    _close(w.grad, split_along(w_ref.grad, tp, 0), "linear CE weight grad")

    # In tiles of 3 tokens (a long sequence's logits are never whole on any rank), with and without a soft cap.
    for cap in (None, 2.0):
        h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h_ref @ w_ref.t()
        F.cross_entropy(cap * torch.tanh(logits / cap) if cap else logits, labels, ignore_index=-100).backward()
        h = hidden.clone().requires_grad_()
        w = split_along(weight, tp, 0).requires_grad_()
        linear_cross_entropy(h, w, labels, tp, chunk_tokens=3, cap=cap).backward()
        h_grad = h.grad.clone()
        dist.all_reduce(h_grad, group=tp.group)
        _close(h_grad, h_ref.grad, f"tiled linear CE hidden grad cap={cap}")
        _close(w.grad, split_along(w_ref.grad, tp, 0), f"tiled linear CE weight grad cap={cap}")


CFG = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
           vocab_size=64, seq_len=8)


def check_transformer(tp, sequence_parallel, tie_embeddings, activation_checkpointing):
    cfg = SimpleNamespace(**CFG, tie_embeddings=tie_embeddings)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(11))
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(12))

    ref = Transformer(cfg, seed=SEED)
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    ref_logits = ref(ids).detach()

    model = Transformer(cfg, tp=tp, sequence_parallel=sequence_parallel,
                        activation_checkpointing=activation_checkpointing, seed=SEED)
    full = model.full_state_dict()
    ref_params = dict(ref.named_parameters())
    assert full.keys() == ref_params.keys()
    for name, value in full.items():
        # Layout-independent init: bit-identical, not just close.
        assert torch.equal(value, ref_params[name].detach()), f"init of {name} differs from tp=1"

    loss = model(ids, labels)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    _close(loss.detach(), ref_loss.detach(), "transformer loss")
    loss.backward()
    for name, p in model.named_parameters():
        _close(gather_full(p.grad, p, tp), ref_params[name].grad, f"transformer grad {name}")
    _close(model(ids).detach(), ref_logits, "transformer logits")



def check_mlp_tiles(tp):
    """A long sequence's MLP recomputed in tiles of rows (selective checkpointing, sequence parallel: each tile
    gathers its rows over tp) gives tp1's loss, gradients and logits: 2 tiles of 2 of the rank's 4 rows here."""
    from rayspeed.model.parts import mlp

    old = mlp.MLP_TILE_BYTES
    mlp.MLP_TILE_BYTES = 2 * 2 * 2 * 32 * 4 * 4  # rows x batch x tp x f / tp x 4 tensors x fp32
    try:
        x = torch.zeros(2, 4, 32)
        model = Transformer(SimpleNamespace(**CFG, tie_embeddings=False), tp=tp, sequence_parallel=True, seed=SEED)
        assert mlp.mlp_tile_rows(model.layers[0].mlp, x) == 2
        check_transformer(tp, True, False, "selective")
    finally:
        mlp.MLP_TILE_BYTES = old


def check_grad_clip(tp):
    """The platform's clip on tp-sharded gradients equals torch's clip on the unsharded model."""
    from rayspeed.engine.clip import GradClipper

    cfg = SimpleNamespace(**CFG, tie_embeddings=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(21))
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(22))
    ref = Transformer(cfg, seed=SEED)
    (ref(ids, labels) * 50).backward()  # large enough that clipping bites
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    model = Transformer(cfg, tp=tp, sequence_parallel=True, seed=SEED)
    (model(ids, labels) * 50).backward()
    norm = GradClipper(model.parameters(), 0.5, tp.group)()
    assert ref_norm > 0.5
    _close(norm, ref_norm, "clip norm")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(gather_full(p.grad, p, tp), ref_params[name].grad, f"clipped grad {name}")

CHECKS = {
    "column": check_column,
    "row": check_row,
    "embedding": check_embedding,
    "vocab_parallel_ce": check_vocab_parallel_ce,
    "transformer_tp": lambda tp: check_transformer(tp, False, True, "none"),
    "transformer_tp_sp": lambda tp: check_transformer(tp, True, False, "none"),
    "transformer_tp_sp_tied_selective": lambda tp: check_transformer(tp, True, True, "selective"),
    "transformer_tp_sp_selective_mlp_tiles": lambda tp: check_mlp_tiles(tp),
    "grad_clip": check_grad_clip,
}


def _run_checks(rank, world_size):
    torch.manual_seed(0)
    tp = _tp_handle()
    failures = {}
    for name, check in CHECKS.items():
        try:
            check(tp)
        except Exception:
            failures[name] = traceback.format_exc()
    return failures


@pytest.fixture(scope="module")
def tp2_failures():
    per_rank = run_distributed(_run_checks, 2)
    return {name: [f[name] for f in per_rank if name in f] for name in CHECKS}


@pytest.mark.parametrize("name", list(CHECKS))
def test_tp2_matches_unsharded(tp2_failures, name):
    errors = tp2_failures[name]
    assert not errors, "\n".join(errors)


# --- process groups ---------------------------------------------------------------------------


def _groups_layout(rank, world_size):
    groups = ParallelGroups(dp=2, tp=2, pp=1)
    # The groups must really connect the listed ranks: sum the global ranks over each.
    sums = {}
    for name, group in (("tp", groups.tp_group), ("dp", groups.dp_group), ("pp", groups.pp_group),
                        ("mp", groups.mp_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    mpu = {
        "dp": (groups.get_data_parallel_rank(), groups.get_data_parallel_world_size(),
               groups.get_data_parallel_group_ranks()),
        "tp": (groups.get_tensor_model_parallel_rank(), groups.get_tensor_model_parallel_world_size(),
               groups.get_tensor_model_parallel_src_rank()),
        "mp": (groups.get_model_parallel_rank(), groups.get_model_parallel_world_size()),
        "pp": (groups.get_pipeline_model_parallel_rank(), groups.get_pipeline_model_parallel_world_size()),
        "tp_handle": (groups.tp.rank, groups.tp.world_size),
        "ulysses": hasattr(groups, "initialize_sequence_parallel"),
        "seq": (groups.get_sequence_parallel_world_size(), groups.get_sequence_data_parallel_world_size(),
                groups.get_sequence_data_parallel_rank()),
    }
    # tp2 x cp2: cp next to tp, so a cp group pairs the same tp slice of consecutive tp groups.
    cp = ParallelGroups(dp=1, tp=2, pp=1, cp=2)
    cp_sums = {}
    for name, group in (("tp", cp.tp_group), ("cp", cp.cp_group), ("dpcp", cp.dpcp_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        cp_sums[name] = t.item()
    cp_mpu = {"seq": (cp.get_sequence_parallel_rank(), cp.get_sequence_parallel_world_size(),
                      cp.get_sequence_data_parallel_world_size()), "dp": cp.get_data_parallel_world_size(),
              "handle": (cp.cp.rank, cp.cp.world_size, cp.cp.ranks)}
    return {"sums": sums, "ranks": (groups.tp_ranks, groups.dp_ranks, groups.pp_ranks), "mpu": mpu,
            "cp": (cp_sums, cp_mpu, (cp.tp_ranks, cp.cp_ranks, cp.dpcp_ranks, cp.dp_ranks))}


def test_parallel_groups_layout_dp2_tp2():
    results = run_distributed(_groups_layout, 4)
    for rank, r in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        tp_ranks = [2 * dp_rank, 2 * dp_rank + 1]
        dp_ranks = [tp_rank, tp_rank + 2]
        assert r["ranks"] == (tp_ranks, dp_ranks, [rank])
        assert r["sums"] == {"tp": sum(tp_ranks), "dp": sum(dp_ranks), "pp": rank, "mp": sum(tp_ranks)}
        assert r["mpu"]["dp"] == (dp_rank, 2, dp_ranks)
        assert r["mpu"]["tp"] == (tp_rank, 2, tp_ranks[0])
        assert r["mpu"]["mp"] == (tp_rank, 2)
        assert r["mpu"]["pp"] == (0, 1)
        assert r["mpu"]["tp_handle"] == (tp_rank, 2)
        # Must not look like DeepSpeed's own Ulysses mpu, or DeepSpeed would drop its data and model groups; at cp 1
        # the sequence-data group is the dp group.
        assert r["mpu"]["ulysses"] is False
        assert r["mpu"]["seq"] == (1, 2, dp_rank)
        sums, mpu, ranks = r["cp"]
        cp_ranks = [tp_rank, tp_rank + 2]
        assert ranks == (tp_ranks, cp_ranks, cp_ranks, [rank])
        assert sums == {"tp": sum(tp_ranks), "cp": sum(cp_ranks), "dpcp": sum(cp_ranks)}
        assert mpu == {"seq": (dp_rank, 2, 2), "dp": 1, "handle": (dp_rank, 2, tuple(cp_ranks))}


def test_layout_arithmetic():
    groups = layout(dp=2, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # cp between tp and dp: rank = (dp_rank * cp + cp_rank) * tp + tp_rank; ZeRO spans dp x cp.
    groups = layout(dp=2, tp=2, pp=1, cp=2)
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dpcp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["mp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_tp_group_spanning_nodes_is_rejected():
    check_tp_within_nodes(["a", "a", "b", "b"], 2)
    check_tp_within_nodes(["a", "a", "a", "a"], 4)
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] spans nodes \['a', 'b'\]"):
        check_tp_within_nodes(["a", "a", "a", "b", "b", "b"], 2)
    with pytest.raises(ValueError, match="does not divide"):
        check_tp_within_nodes(["a", "a", "b"], 2)


def test_heads_must_divide_by_tp():
    fake_tp = TensorParallel(group=None, rank=0, world_size=2)  # validation fails before any communication
    cfg = SimpleNamespace(**{**CFG, "num_kv_heads": 1}, tie_embeddings=True)
    with pytest.raises(ValueError, match="num_kv_heads=1 must divide by the tensor-parallel size tp=2"):
        Transformer(cfg, tp=fake_tp)
    cfg = SimpleNamespace(**{**CFG, "num_heads": 2, "num_kv_heads": 1, "hidden_size": 32}, tie_embeddings=True)
    with pytest.raises(ValueError, match="tp=4"):
        Transformer(cfg, tp=TensorParallel(group=None, rank=0, world_size=4))
