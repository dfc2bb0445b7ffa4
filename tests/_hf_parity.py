"""What a family's parity test against transformers repeats: the reference (logits, loss and every gradient of a
locally made checkpoint), rayspeed's model built from that checkpoint, the pp2 stages (logits by hand, the loss
through DeepSpeed's pipeline engine) and a gradient's tp shard.

    ref = reference(model_dir, tokens)                     # {"logits", "loss", "grads"}, transformers, fp32
    model = build(shape, model_dir, groups.tp, sp=True)
    pp_logits, pp_loss = pipeline_logits_and_loss(shape, model_dir, groups, tokens)
    assert_tp1_matches(model, ref, shape, ids)                  # logits, loss, every gradient, every tensor
    assert_rank_matches(tp2_and_pp2(shape, model_dir, ids), rank, ref, shape)   # in each of 2 gloo processes
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tokens(vocab: int, batch: int, seq: int, seed: int = 5) -> torch.Tensor:
    """[batch, seq + 1] ids: inputs [:, :-1], labels [:, 1:]."""
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def reference(model_dir: str, ids: torch.Tensor) -> dict:
    """transformers' own logits, loss and gradients on `ids` for the checkpoint in `model_dir` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logits = model(ids[:, :-1]).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"dir": model_dir, "model": model, "logits": logits.detach(), "loss": loss.detach(), "grads": grads}


def build(shape, model_dir, tp=None, sp=False, ep=None):
    """rayspeed's Transformer for `shape`, this rank's weights read from the checkpoint (with `ep`, each MoE layer's
    experts sharded over it first, so a rank reads only those it holds)."""
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.model.transformer import Transformer
    from rayspeed.parallel.layers import deferred_init

    with deferred_init():
        model = Transformer(shape, tp=tp, sequence_parallel=sp)
    if ep is not None:
        for block in model.layers:
            if shape.is_moe(block.layer_idx):
                block.mlp.shard_experts(ep)
    load_hf_weights(model, model_dir, shape, tp=tp)
    return model


def init_deepspeed_gloo() -> None:
    """DeepSpeed's distributed layer on the gloo world run_distributed made (without its JIT shared-memory op)."""
    import logging

    import deepspeed

    from rayspeed.compat import skip_deepspeed_shm_comm_op

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_deepspeed_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")


def pipeline_logits_and_loss(shape, model_dir, groups, ids):
    """pp2: the stages by hand for the logits (the engine never materialises them: None on the first stage),
    DeepSpeed's eval_batch for the loss (every stage), then one train_batch (lr 0) for this stage's gradients as
    they accumulate, by Transformer name (a tied embedding's two parts each on its stage, before DeepSpeed adds
    them): (logits, loss, gradients)."""
    import deepspeed
    import torch.distributed as dist

    from rayspeed.engine.pipeline_module import build_pipeline_module
    from rayspeed.model.hf_weights import load_hf_weights
    from rayspeed.parallel.layers import deferred_init
    from rayspeed.parallel.loss import softcap

    with deferred_init():
        module = build_pipeline_module(shape, groups, num_stages=2, partition_method="type:Block")
    load_hf_weights(module, model_dir, shape)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    logits = None
    with torch.no_grad():
        if groups.pp_rank == 0:
            dist.send(module(inputs).contiguous(), dst=1)
        else:
            full = torch.empty(inputs.shape[0], inputs.shape[1], shape.hidden_size)
            dist.recv(full, src=0)
            hidden, weight = module(full)
            logits = softcap(F.linear(hidden, weight), shape.final_logit_softcapping)
    config = {"train_micro_batch_size_per_gpu": inputs.shape[0], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                           config=config)
    loss = engine.eval_batch(iter([(inputs, labels)])).detach().float().reshape(())
    from rayspeed.model.decoder import canonical_named_parameters

    grads: dict = {}
    for name, p in canonical_named_parameters(module):
        p.register_post_accumulate_grad_hook(lambda q, k=name: grads.__setitem__(k, q.grad.detach().clone()))
    engine.train_batch(iter([(inputs, labels)]))
    return logits, loss, grads


def shard(full: torch.Tensor, dim, rank: int, world: int) -> torch.Tensor:
    """This tp rank's part of a whole tensor split along `dim` (None: replicated, the whole)."""
    return full if dim is None else full.chunk(world, dim=dim)[rank]


TOL = dict(rtol=1e-5, atol=1e-5)


def reference_grad(ref: dict, shape, name: str, rank: int = 0, world: int = 1) -> torch.Tensor:
    """transformers' gradient of rayspeed parameter `name` (its rows of a fused tensor), this tp rank's shard."""
    from rayspeed.config.hf_checkpoint import checkpoint_layout, param_shapes

    hf, offset = checkpoint_layout(shape)[name]
    whole = ref["grads"][hf][offset:offset + param_shapes(shape)[name][0]]
    return shard(whole, shape.family.tensor_names.partition_dim(name), rank, world)


def assert_tp1_matches(model, ref: dict, shape, ids: torch.Tensor) -> None:
    """Logits, loss and every gradient equal transformers' (fp32, TOL), and the model's parameters cover every
    tensor of the checkpoint."""
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :-1]), ref["logits"], **TOL)
    loss = model(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference_grad(ref, shape, name), **TOL, msg=lambda m: f"{name}: {m}")
    names = shape.family.tensor_names
    assert {names.hf_name(n) for n, _ in model.named_parameters()} == set(ref["grads"])


def tp2_and_pp2(shape, model_dir: str, ids: torch.Tensor):
    """In a 2-process gloo world: (logits, loss, every gradient) at tp2 with sequence parallelism, then pp2's
    (logits, loss) through pipeline_logits_and_loss."""
    import torch.distributed as dist

    from rayspeed.parallel.groups import ParallelGroups

    model = build(shape, model_dir, ParallelGroups(dp=1, tp=2, pp=1).tp, sp=True)
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    return logits, loss.detach(), grads, pipeline_logits_and_loss(shape, model_dir, ParallelGroups(dp=1, tp=1, pp=2),
                                                                  ids)


def assert_rank_matches(result, rank: int, ref: dict, shape, where: str = "") -> None:
    """One rank's tp2_and_pp2 result against transformers: pp2's loss (and logits on the last stage), tp2's
    logits, loss and this rank's shard of every gradient."""
    logits, loss, grads, (pp_logits, pp_loss, _) = result
    where = f"{where} rank {rank}".strip()
    torch.testing.assert_close(pp_loss, ref["loss"], **TOL, msg=lambda m: f"{where} pp2 loss: {m}")
    if rank == 1:  # the last stage holds the head
        torch.testing.assert_close(pp_logits, ref["logits"], **TOL, msg=lambda m: f"{where} pp2 logits: {m}")
    torch.testing.assert_close(logits, ref["logits"], **TOL, msg=lambda m: f"{where} logits: {m}")
    torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"{where} loss: {m}")
    from rayspeed.config.hf_checkpoint import checkpoint_layout

    assert {checkpoint_layout(shape)[n][0] for n in grads} == set(ref["grads"])  # every checkpoint tensor
    for name, g in grads.items():
        torch.testing.assert_close(g, reference_grad(ref, shape, name, rank, 2), **TOL,
                                   msg=lambda m: f"{where} {name}: {m}")


def assert_pp2_gradients(per_rank: list, ref: dict, shape, where: str = "") -> None:
    """pp2's gradients (pipeline_logits_and_loss, one dict per stage) against transformers': every checkpoint
    tensor's from the stage that holds it, a tied embedding's two parts added."""
    from rayspeed.config.hf_checkpoint import checkpoint_layout

    total: dict = {}
    for grads in per_rank:
        for name, g in grads.items():
            total[name] = total[name] + g if name in total else g
    assert {checkpoint_layout(shape)[n][0] for n in total} == set(ref["grads"]), where
    for name, g in total.items():
        torch.testing.assert_close(g, reference_grad(ref, shape, name), **TOL,
                                   msg=lambda m: f"{where} pp2 {name}: {m}".strip())
