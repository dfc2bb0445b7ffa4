"""Parity with transformers: a checkpoint made locally with `transformers` (random weights, save_pretrained) and
loaded by rayspeed gives the same logits and loss as transformers' own model on the same tokens, in fp32
(rtol = atol = 1e-5), under tp1, tp2 with sequence parallelism, pp2 (DeepSpeed PipelineModule and engine) and
tp2 x pp2, for a Qwen2-style model (GQA, q/k/v biases, untied head, linear RoPE scaling), and at tp2 for a
tied-embedding Llama model with llama3 RoPE scaling."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from _dist import run_distributed
from _hf_models import LLAMA_TIED, QWEN, save, shape_of
from rayspeed.compat import skip_deepspeed_shm_comm_op

SEQ, BATCH = 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens(vocab, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)


def _reference(model_dir):
    """transformers' logits and mean next-token loss for the test tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return logits, loss


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, spec, shards in (("qwen", QWEN, 3), ("llama_tied", LLAMA_TIED, 1)):
        d = root / name
        save(d, spec, seed=11, shards=shards)
        logits, loss = _reference(str(d))
        out[name] = {"dir": str(d), "logits": logits, "loss": loss}
    return out


def test_checkpoints_are_what_the_cases_claim(checkpoints):
    import json
    from pathlib import Path

    qwen = Path(checkpoints["qwen"]["dir"])
    assert (qwen / "model.safetensors.index.json").is_file()  # sharded
    assert len(list(qwen.glob("*.safetensors"))) > 1
    shape = shape_of(str(qwen), SEQ)
    assert (shape.qkv_bias, shape.tie_embeddings, shape.rope_type, shape.num_kv_heads) == (True, False, "linear", 2)
    llama = shape_of(checkpoints["llama_tied"]["dir"], SEQ)
    assert (llama.qkv_bias, llama.tie_embeddings, llama.rope_type) == (False, True, "llama3")
    assert "lm_head.weight" not in json.dumps(sorted(_header_names(checkpoints["llama_tied"]["dir"])))


def _header_names(model_dir):
    from pathlib import Path

    from rayspeed.config.hf_checkpoint import weight_files

    files, problems = weight_files(Path(model_dir))
    assert not problems
    return list(files)


def _build(shape, model_dir, tp=None, sp=False):
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.layers import deferred_init

    with deferred_init():
        model = Transformer(shape, tp=tp, sequence_parallel=sp)
    load_hf_weights(model, model_dir, shape, tp=tp)
    return model.eval()


def test_tp1_logits_and_loss_match_transformers(checkpoints):
    for name in ("qwen", "llama_tied"):
        c = checkpoints[name]
        shape = shape_of(c["dir"], SEQ)
        model = _build(shape, c["dir"])
        tokens = _tokens(shape.vocab_size)
        with torch.no_grad():
            logits = model(tokens[:, :-1])
            loss = model(tokens[:, :-1], tokens[:, 1:])
        torch.testing.assert_close(logits, c["logits"], **TOL)
        torch.testing.assert_close(loss, c["loss"], **TOL)


def test_random_init_is_not_the_checkpoint(checkpoints):
    # The parity above is the loaded weights', not an accident of the architecture.
    from rayspeed.model.transformer import Transformer

    c = checkpoints["qwen"]
    shape = shape_of(c["dir"], SEQ)
    tokens = _tokens(shape.vocab_size)
    with torch.no_grad():
        loss = Transformer(shape, seed=1)(tokens[:, :-1], tokens[:, 1:])
    assert abs(loss.item() - c["loss"].item()) > 0.1


# ---------------------------------------------------------------- distributed


def _pipeline_logits_and_loss(module, groups, shape, tokens, rank):
    """Run the stages by hand for the logits (the engine never materialises them), then the DeepSpeed engine's
    eval_batch for the loss."""
    import deepspeed
    import torch.distributed as dist

    from rayspeed.parallel.comm import gather_from_tp

    ids, labels = tokens[:, :-1], tokens[:, 1:]
    stage, tp = groups.pp_rank, groups.tp
    logits = None
    with torch.no_grad():
        if stage == 0:
            out = module(ids)
            dist.send(out.contiguous(), dst=rank + groups.tp_size)
        else:
            full = torch.empty(BATCH, SEQ, shape.hidden_size)
            dist.recv(full, src=rank - groups.tp_size)
            hidden, weight = module(full)
            logits = gather_from_tp(F.linear(hidden, weight), tp)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                           config=config)
    loss = engine.eval_batch(iter([(ids, labels)]))
    return logits, loss.detach().float().reshape(())


def _ranks(rank, world_size, cases):
    import deepspeed
    import torch.distributed as dist

    from rayspeed.engine.pipeline_module import build_pipeline_module
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.parallel.groups import ParallelGroups
    from rayspeed.parallel.layers import deferred_init

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for case, model_dir, tp, pp, sp in cases:
        shape = shape_of(model_dir, SEQ)
        groups = ParallelGroups(dp=1, tp=tp, pp=pp)
        tp_handle = groups.tp if tp > 1 else None
        tokens = _tokens(shape.vocab_size)
        if pp == 1:
            model = _build(shape, model_dir, tp_handle, sp)
            with torch.no_grad():
                out[case] = (model(tokens[:, :-1]), model(tokens[:, :-1], tokens[:, 1:]))
        else:
            with deferred_init():
                module = build_pipeline_module(shape, groups, num_stages=pp, sequence_parallel=sp,
                                               partition_method="type:Block")
            report = load_hf_weights(module, model_dir, shape, tp=tp_handle)
            logits, loss = _pipeline_logits_and_loss(module, groups, shape, tokens, rank)
            out[case] = (logits, loss, report["parameters"])
        dist.barrier()
    return out


def _check(per_rank, checkpoints, cases):
    for case, model_dir, tp, pp, _ in cases:
        ref = next(c for c in checkpoints.values() if c["dir"] == model_dir)
        for rank, result in enumerate(per_rank):
            logits, loss = result[case][0], result[case][1]
            torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"{case} rank {rank} loss: {m}")
            last_stage = rank >= (len(per_rank) // pp) * (pp - 1)
            if pp == 1 or last_stage:
                torch.testing.assert_close(logits, ref["logits"], **TOL, msg=lambda m: f"{case} rank {rank}: {m}")
            if pp > 1:  # each stage loaded only its own layers
                n_params = result[case][2]
                assert 0 < n_params < len(_header_names(model_dir)), (case, rank, n_params)


def test_tp2_sp_pp2_and_tied_tp2_match_transformers(checkpoints):
    q, t = checkpoints["qwen"]["dir"], checkpoints["llama_tied"]["dir"]
    cases = [("qwen_tp2_sp", q, 2, 1, True), ("qwen_pp2", q, 1, 2, False), ("llama_tied_tp2", t, 2, 1, False)]
    per_rank = run_distributed(_ranks, 2, cases, timeout_s=90)
    _check(per_rank, checkpoints, cases)


def test_tp2_x_pp2_matches_transformers(checkpoints):
    q = checkpoints["qwen"]["dir"]
    cases = [("qwen_tp2_pp2_sp", q, 2, 2, True)]
    per_rank = run_distributed(_ranks, 4, cases, timeout_s=120)
    _check(per_rank, checkpoints, cases)
