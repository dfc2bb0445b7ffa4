"""A language-model job's data and objective on a worker (pretraining and SFT, train.objective: sft): the tokenized
corpus from the cache (the launcher tokenized it), this rank's batches and validation batches, and the LanguageModel
objective over them. Each objective has such a setup (DPO's: rayspeed.train.dpo_setup), named by `OBJECTIVE_DATA`, so
the trainer asks it instead of choosing.

    data = SftData(cfg, groups, storage)          # .corpus, .train, .batches, .validator_batches
    objective = data.objective(engine, device, pipelined)
    data.rebatched(schedule, start_step)          # another global batch size (the batch policy)
"""

from __future__ import annotations

from typing import Any

from rayspeed.config.schema import JobConfig
from rayspeed.train import data_setup

# train.objective -> the module and class of its setup; each takes (cfg, groups, storage) and has the members above.
OBJECTIVE_DATA = {"sft": ("rayspeed.train.sft_setup", "SftData"), "dpo": ("rayspeed.train.dpo_setup", "DpoData"),
                  "grpo": ("rayspeed.train.grpo_setup", "GrpoData")}


def objective_data(cfg: JobConfig, groups: Any, storage: str) -> Any:
    """The setup of the job's objective (train.objective), built."""
    import importlib

    module, name = OBJECTIVE_DATA[cfg.train.objective]
    return getattr(importlib.import_module(module), name)(cfg, groups, storage)


class SftData:
    def __init__(self, cfg: JobConfig, groups: Any, storage: str):
        from rayspeed.data import RankBatches, make_schedule, val_batches

        c, g, dm = cfg, groups, cfg.data.document_masking
        self.cfg, self.groups = cfg, groups
        self.corpus = data_setup.load_corpus(c, storage)  # the launcher tokenized it: a cache hit
        self.train, val = data_setup.splits(self.corpus, c)
        schedule = make_schedule(self.train, c.model.seq_len, c.train.global_batch_size, c.train.seed)
        assert isinstance(c.parallel.micro_batch_size, int) and isinstance(c.parallel.grad_accum, int)  # resolved
        self.batches = RankBatches(self.train, c.model.seq_len, schedule, g.dp_rank, g.dp,
                                   c.parallel.micro_batch_size, c.parallel.grad_accum, document_masking=dm)
        share = c.parallel.micro_batch_size * c.parallel.grad_accum
        self.validator_batches = val_batches(val, c.model.seq_len, share, c.train.eval_batches, g.dp_rank, g.dp, dm)

    def rebatched(self, schedule: Any, start_step: int) -> Any:
        """The batches of another global batch size (the playbook batch policy), from `start_step` on."""
        from rayspeed.data import RankBatches

        c, g, old = self.cfg, self.groups, self.batches
        self.batches = RankBatches(self.train, c.model.seq_len, schedule, g.dp_rank, g.dp,
                                   c.parallel.micro_batch_size, c.parallel.grad_accum, start_step=start_step,
                                   document_masking=old.document_masking, label_counts=old.label_counts)
        return self.batches

    def objective(self, engine: Any, device: Any, pipelined: bool = False) -> Any:
        """The LanguageModel objective with its Validator; each micro-batch's loss weighted by its share of the
        global batch's counted labels (of whichever batches are current)."""
        from rayspeed.train.evaluation import Validator, dp_mean
        from rayspeed.train.objective import LanguageModel, label_scale

        c, g = self.cfg, self.groups
        grad_accum = c.parallel.grad_accum  # a local: the lambda below keeps its narrowed type
        assert isinstance(grad_accum, int) and isinstance(c.parallel.zero_stage, int)  # resolved
        validator = Validator(c, self.validator_batches, device, pipelined, lambda t: dp_mean(t, g, device),
                              weighted=self.batches.weighted, cp=g.cp)
        return LanguageModel(validator, lambda index: label_scale(self.batches, g.dp, grad_accum, index),
                             device, g.cp, c.parallel.zero_stage)
