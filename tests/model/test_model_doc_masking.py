"""Document masking: the loss of a packed sequence with masking equals the losses of its documents computed alone
(tp 1, tp 2 with sequence parallelism, and 2 DeepSpeed pipeline stages), and without segment ids the model is the
plain causal one it always was."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from _dist import run_distributed
from rayspeed.compat import skip_deepspeed_shm_comm_op
from rayspeed.config.shape import ModelShape

VOCAB, SEQ = 64, 32
DOC_LENS = (10, 7, 16)  # 33 tokens packed: inputs are the first 32, labels the last 32
TOL = dict(rtol=1e-5, atol=1e-5)


def _shape(tied=True):
    cfg = SimpleNamespace(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                          vocab_size=VOCAB, seq_len=SEQ, tie_embeddings=tied, rope_theta=10000.0, norm_eps=1e-5,
                          init_std=0.2)
    return ModelShape.from_config(cfg)


def _packed(batch=2):
    """(docs per row, input ids, labels with cross-document labels ignored, segment ids), two rows with the
    documents in different orders."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in DOC_LENS]
    orders = [(0, 1, 2), (2, 0, 1)][:batch]
    xs, ys, segs = [], [], []
    for order in orders:
        packed = torch.cat([docs[i] for i in order])
        seg = torch.cat([torch.full((DOC_LENS[i],), k) for k, i in enumerate(order)])
        y = packed[1:].clone()
        y[seg[1:] != seg[:-1]] = -100
        xs.append(packed[:-1])
        ys.append(y)
        segs.append(seg[:-1])
    return docs, torch.stack(xs), torch.stack(ys), torch.stack(segs)


def _alone(model, docs):
    """Sum of per-token losses and the count, each document on its own."""
    total, n = 0.0, 0
    with torch.no_grad():
        for d in docs:
            total += float(model(d[None, :-1], d[None, 1:])) * (len(d) - 1)
            n += len(d) - 1
    return total, n


def test_packed_with_masking_equals_the_documents_alone():
    from rayspeed.model.transformer import Transformer

    model = Transformer(_shape(), seed=3).eval()
    docs, x, y, seg = _packed()
    total, n = _alone(model, docs)
    with torch.no_grad():
        packed = model(x, y, seg)
        unmasked = model(x, y)
    assert int((y != -100).sum()) == 2 * n
    torch.testing.assert_close(packed, torch.tensor(total / n), **TOL)
    assert abs(float(unmasked) - total / n) > 1e-3  # attending across documents is a different function
    # Logits too: the last document's logits equal its logits alone.
    with torch.no_grad():
        alone = model(docs[2][None, :-1])
        torch.testing.assert_close(model(x[:1], segment_ids=seg[:1])[0, 17:], alone[0], **TOL)


def test_no_segment_ids_is_the_causal_model_and_checkpointing_keeps_masking():
    from rayspeed.model.transformer import Transformer

    docs, x, y, seg = _packed()
    ref = Transformer(_shape(), seed=3)
    for mode in ("selective", "full"):
        m = Transformer(_shape(), seed=3, activation_checkpointing=mode)
        a, b = ref(x, y, seg), m(x, y, seg)
        torch.testing.assert_close(a, b, **TOL)
        a.backward()
        b.backward()
        for (name, p), q in zip(ref.named_parameters(), m.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda s, name=name: f"{mode} {name}: {s}")
        ref.zero_grad()
    one_segment = torch.zeros_like(seg)  # a single document everywhere: exactly the causal model
    with torch.no_grad():
        torch.testing.assert_close(ref(x, y, one_segment), ref(x, y), **TOL)


def _ranks(rank, world_size, case):
    import deepspeed

    from rayspeed.engine.pipeline_module import build_pipeline_module
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.groups import ParallelGroups

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    docs, x, y, seg = _packed()
    shape = _shape(tied=case != "pp2")
    if case == "tp2_sp":
        groups = ParallelGroups(dp=1, tp=2, pp=1)
        model = Transformer(shape, tp=groups.tp, sequence_parallel=True, seed=3).eval()
        with torch.no_grad():
            return float(model(x, y, seg))
    groups = ParallelGroups(dp=1, tp=1, pp=2)
    module = build_pipeline_module(shape, groups, num_stages=2, seed=3, partition_method="type:Block")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                           config=config)
    # Two micro-batches of one row each, through the stages as (ids, segment_ids); the loss is the mean of theirs.
    loss = engine.eval_batch(iter([((x[i:i + 1], seg[i:i + 1]), y[i:i + 1]) for i in range(2)]))
    return float(loss)


@pytest.mark.parametrize("case", ["tp2_sp", "pp2"])
def test_masking_through_tensor_sequence_and_pipeline_parallel(case):
    from rayspeed.model.transformer import Transformer

    docs, x, y, seg = _packed()
    ref = Transformer(_shape(tied=case != "pp2"), seed=3).eval()
    total, n = _alone(ref, docs)
    per_rank = run_distributed(_ranks, 2, case, timeout_s=90)
    for rank, loss in enumerate(per_rank):
        assert loss == pytest.approx(total / n, rel=1e-5, abs=1e-5), (case, rank)
