"""A GRPO job's data and rollouts on a worker (train.objective: grpo, colocated: each trainer worker samples its own
prompts' completions between steps, as TRL does): the prompt records, this rank's batches, the reward functions,
the end tokens, the reference when beta > 0, and the objective with its validator (val/reward, greedy).

    data = GrpoData(cfg, groups, storage)                  # .batches (GrpoBatches), .train/.val prompt records
    engine = build_engine(...)
    objective = data.objective(engine, device)             # wires the batches' sampler to the engine
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Optional

import torch

from rayspeed.config import adapter, grpo_keys
from rayspeed.config.schema import JobConfig
from rayspeed.data.batches import GlobalBatchSchedule
from rayspeed.data.prompts import PromptRecord, is_messages
from rayspeed.model.generate import Sampling
from rayspeed.objectives.grpo import GrpoSettings
from rayspeed.objectives.rewards import TrainerState, load_reward
from rayspeed.train import data_setup
from rayspeed.train.grpo_batches import GrpoBatches
from rayspeed.train.grpo_objective import GrpoObjective, completion_logps, dapo_tokens
from rayspeed.train.grpo_rollout import RolloutContext, sample_step
from rayspeed.train.grpo_validation import GrpoValidator


def settings_of(cfg: JobConfig) -> GrpoSettings:
    s = cfg.train.grpo
    return GrpoSettings(num_generations=s.num_generations, loss=s.loss, beta=s.beta, epsilon_low=s.epsilon,
                        epsilon_high=s.epsilon if s.epsilon_high is None else s.epsilon_high,
                        scale_rewards=s.scale_rewards, max_completion_length=s.max_new_tokens)


def end_ids(cfg: JobConfig, hf: Any) -> list[int]:
    """The checkpoint's generation config's end tokens (several for Qwen3 and gpt-oss), else the tokenizer's EOS."""
    ids: list[int] = []
    if cfg.model.pretrained:
        from rayspeed.model.hf_weights import local_model_dir

        path = os.path.join(local_model_dir(str(cfg.model.pretrained)), "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f).get("eos_token_id")
            ids = [found] if isinstance(found, int) else list(found or [])
    if not ids and hf.eos_token_id is not None:
        ids = [int(hf.eos_token_id)]
    return ids


class GrpoData:
    def __init__(self, cfg: JobConfig, groups: Any, storage: str):
        c = cfg
        self.cfg, self.groups = cfg, groups
        self.corpus = data_setup.load_prompts(c)
        self.train, self.val = data_setup.prompt_splits(self.corpus, c)
        schedule = GlobalBatchSchedule(len(self.train), grpo_keys.prompts_per_step(c), c.train.seed)
        self.batches = GrpoBatches(self.train, schedule, groups.dp_rank, groups.dp, c.train.global_batch_size)
        self.validator_batches: list[Any] = []  # the loss landscape's; the validator holds its own prompts
        self.reference: Any = None

    def rebatched(self, schedule: Any, start_step: int) -> Any:
        """Another global batch size (the playbook batch policy): the prompt stream continues where it stopped."""
        c, old = self.cfg, self.batches
        prompts = GlobalBatchSchedule(len(self.train), grpo_keys.prompts_per_step(c), c.train.seed,
                                      start_step=start_step, start_sample=schedule.start_sample)
        self.batches = GrpoBatches(self.train, prompts, self.groups.dp_rank, self.groups.dp,
                                   c.train.global_batch_size)
        self.batches.sampler = old.sampler
        return self.batches

    def objective(self, engine: Any, device: Any, pipelined: bool = False) -> GrpoObjective:
        from rayspeed.data import load_tokenizer

        c, g = self.cfg, self.groups
        s = c.train.grpo
        hf = load_tokenizer(data_setup.tokenizer_spec(c)).hf
        pad = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
        conversational = bool(self.train) and is_messages(self.train[0].prompt)

        def decode(ids: list[int]) -> Any:
            text = hf.decode(ids, skip_special_tokens=True)
            return [{"role": "assistant", "content": text}] if conversational else text

        functions = [load_reward(name) for name in s.rewards]
        weights = torch.tensor(s.reward_weights or [1.0] * len(functions), dtype=torch.float32)
        settings = settings_of(c)
        context = RolloutContext(settings, Sampling(s.max_new_tokens, s.temperature, s.top_p), functions, weights,
                                 decode, end_ids(c, hf), pad, group=g.dp_group if g.dp > 1 else None,
                                 mask_truncated=s.mask_truncated_completions)
        objective = GrpoObjective(settings, context.group, device, s.samples_every_steps)
        if s.beta > 0 and not adapter.enabled(c.model.adapter):
            from rayspeed.train.dpo_setup import resident_reference

            self.reference = resident_reference(c, g, device)
        self.batches.sampler = Sampler(self, engine, context, objective, device)
        greedy = Sampling(s.max_new_tokens, greedy=True)
        share = self.val[g.dp_rank::g.dp][:max(1, c.train.eval_batches * grpo_keys.prompts_per_step(c) // g.dp)]
        objective.validator = GrpoValidator(c, share, context, greedy, held_out=bool(self.val))
        return objective


class Sampler:
    """(step, this rank's prompts) -> the step's micro-batches: sampled by the policy as it is now, scored, with the
    reference's log-probabilities when beta > 0 and dapo's token count over every rank."""

    def __init__(self, data: GrpoData, engine: Any, context: RolloutContext, objective: GrpoObjective, device: Any):
        self.data, self.engine, self.context, self.objective, self.device = data, engine, context, objective, device

    def __call__(self, index: int, records: list[PromptRecord]) -> list[tuple]:
        c = self.data.cfg
        self.context.generator = self.data.batches.generator(c.train.seed, index, self.device)
        state = TrainerState(global_step=index, max_steps=c.train.max_steps)
        rollout = sample_step(self.engine.module, records, self.context, state)
        self.objective.last = rollout
        self.objective.rollouts.append(rollout)
        micro, accum = c.parallel.micro_batch_size, c.parallel.grad_accum
        assert isinstance(micro, int) and isinstance(accum, int)  # resolved
        tokens = dapo_tokens(rollout.tokens, self.context.group, self.data.groups.dp, accum, self.device)
        return [(ids, mask, adv, None, self.reference_logps(ids), tokens)
                for ids, mask, adv in rollout.micro_batches(micro)]

    @torch.no_grad()
    def reference_logps(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        if self.context.settings.beta == 0:
            return None
        ids = ids.to(self.device)
        if self.data.reference is not None:
            return completion_logps(self.data.reference, ids)
        from rayspeed.adapters.lora import adapters_disabled

        module = self.engine.module
        was = module.training
        module.eval()
        off = adapters_disabled(module) if adapter.enabled(self.data.cfg.model.adapter) else contextlib.nullcontext()
        try:
            with off:
                return completion_logps(module, ids)
        finally:
            module.train(was)
