"""A DPO job's data and reference on a worker: the pairs from the cache (the launcher tokenized them), this rank's
batches, and the reference log-probabilities, precomputed with the initial weights before any checkpoint is loaded
(or read from the file an earlier attempt wrote), or a resident reference.

    data = DpoData(cfg, groups, storage)                  # .batches (PairBatches), .train/.val (PairSplits)
    engine = build_engine(...)                            # the initial weights
    objective, validator = data.objective(engine, device) # before checkpointer.load
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from rayspeed.config import adapter
from rayspeed.config.load import to_dict
from rayspeed.config.schema import JobConfig
from rayspeed.logs import log_rank
from rayspeed.train import data_setup

log = logging.getLogger("rayspeed.worker")


def reference_identity(cfg: JobConfig) -> dict[str, Any]:
    """What decides the reference's log-probabilities besides the data: the model, its initial weights, precision."""
    from rayspeed.engine.build import loads_pretrained

    m = cfg.model
    out = {"model": {k: v for k, v in to_dict(cfg)["model"].items() if k != "adapter"}, "seed": cfg.train.seed,
           "init_from": cfg.train.init_from, "precision": cfg.train.precision}
    if loads_pretrained(cfg):
        from rayspeed.checkpoint.base_identity import base_identity
        from rayspeed.config import hf_config

        out["weights"] = base_identity(str(m.pretrained), str(hf_config.resolve_file(str(m.pretrained)).parent))
    return out


class DpoData:
    def __init__(self, cfg: JobConfig, groups: Any, storage: str):
        from rayspeed.data.batches import GlobalBatchSchedule
        from rayspeed.data.pair_batches import PairBatches

        self.cfg, self.groups, self.storage = cfg, groups, storage
        self.corpus = data_setup.load_pairs(cfg, storage)
        self.train, self.val = data_setup.pair_splits(self.corpus, cfg)
        c = cfg
        schedule = GlobalBatchSchedule(self.train.num_pairs, c.train.global_batch_size, c.train.seed)
        assert isinstance(c.parallel.micro_batch_size, int) and isinstance(c.parallel.grad_accum, int)  # resolved
        self.batches = PairBatches(self.train, c.model.seq_len, schedule, groups.dp_rank, groups.dp,
                                   c.parallel.micro_batch_size, c.parallel.grad_accum)
        self.validator_batches: list[Any] = []  # the loss landscape's; DPO's validator holds its own pairs

    def rebatched(self, schedule: Any, start_step: int) -> Any:
        """The batches of another global batch size (the playbook batch policy), with the same reference."""
        from rayspeed.data.pair_batches import PairBatches

        c, g = self.cfg, self.groups
        assert isinstance(c.parallel.micro_batch_size, int) and isinstance(c.parallel.grad_accum, int)  # resolved
        self.batches = PairBatches(self.train, c.model.seq_len, schedule, g.dp_rank, g.dp, c.parallel.micro_batch_size,
                                   c.parallel.grad_accum, start_step=start_step, reference=self.batches.reference)
        return self.batches

    def objective(self, engine: Any, device: Any, pipelined: bool = False) -> Any:
        """The DpoObjective with its DpoValidator, the reference ready: call with the engine at its initial
        weights."""
        from rayspeed.data.pair_batches import pair_val_batches
        from rayspeed.train.dpo_objective import DpoObjective, DpoValidator

        c, g = self.cfg, self.groups
        uses_adapter = adapter.enabled(c.model.adapter)
        resident = None
        if c.train.dpo.reference == "resident" and not uses_adapter:
            resident = resident_reference(c, g, device)
        objective = DpoObjective(c, g, device, resident=resident, adapter=uses_adapter, engine=engine,
                                 pipelined=pipelined)
        refs: list[Any] = [None, None]
        if c.train.dpo.reference == "precomputed":
            refs = [self.precomputed(objective, engine, split) for split in (self.train, self.val)]
        self.batches.reference = refs[0]
        assert isinstance(c.parallel.micro_batch_size, int) and isinstance(c.parallel.grad_accum, int)  # resolved
        rounds = c.train.eval_batches * c.parallel.grad_accum  # eval_batches global batches of pairs
        val = pair_val_batches(self.val, c.parallel.micro_batch_size, rounds, g.dp_rank, g.dp, refs[1])
        objective.validator = DpoValidator(c, objective, val)
        return objective

    def precomputed(self, objective: Any, engine: Any, split: Any) -> np.ndarray:
        from rayspeed.objectives import reference

        c = self.cfg
        cache = data_setup.cache_dir(c, self.storage)
        key = reference.reference_key(reference_identity(c), split.content_hash)
        found = reference.load(cache, key, split.num_pairs)
        if found is not None:
            log_rank(log, "dpo reference: %d %s pairs read from %s", split.num_pairs, split.name,
                     reference.path_of(cache, key))
            return found
        t = time.time()
        b = c.parallel.micro_batch_size
        assert isinstance(b, int) and isinstance(c.parallel.grad_accum, int)  # resolved
        per_call = b * c.parallel.grad_accum if objective.pipelined else b  # a pipeline reads grad_accum at once
        engine.eval()
        logps = reference.compute(lambda positions: objective.score(engine, split, positions, b), split.num_pairs,
                                  per_call, self.groups.dp_rank, self.groups.dp, objective.reduce_groups,
                                  objective.device)
        engine.train()
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            where = reference.save(cache, key, logps)
            log_rank(log, "dpo reference: %d %s pairs scored with the initial weights in %.1f s -> %s",
                     split.num_pairs, split.name, time.time() - t, where)
        return logps


def resident_reference(cfg: JobConfig, groups: Any, device: Any) -> Any:
    """A frozen copy of the initial weights, built as the policy was (same seed, checkpoint or warm start)."""
    import torch

    from rayspeed.engine.build import build_model, warm_start

    model = build_model(cfg, groups)
    if cfg.train.init_from:
        warm_start(model, cfg, groups)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.train.precision), torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
