"""The `train.grpo` section: what an online reinforcement-learning job (train.objective: grpo) may set, and what it
may not combine yet (each problem names its key and the fix). Torch-free: `rayspeed plan` and the job checks read it.
The names and defaults are TRL 1.16's GRPOConfig's where TRL has the setting (max_new_tokens is its
max_completion_length, loss its loss_type)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional

LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")
TRL_ONLY_LOSSES = ("cispo", "sapo", "luspo", "vespo")  # TRL 1.16's other loss_type values: not built here
SCALES = ("group", "batch", "none")
REWARD_NAME = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass
class RolloutConfig:
    colocate: bool = True
    """true: each trainer worker samples its own prompts' completions in its own process between steps (TRL's
    default, no extra resources). Separate rollout workers (colocate: false) are not built yet."""
    workers: int = 0
    """Rollout actors beside the trainer workers (colocate: false only; not built yet)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Each rollout actor's Ray resources, e.g. {CPU: 2, GPU: 1} (colocate: false only; not built yet)."""
    sync_every: int = 1
    """Push the policy's weights to the rollout actors every N updates (colocate: false only; not built yet)."""


@dataclass
class GrpoConfig:
    num_generations: int = 8
    """Completions sampled per prompt (the group whose rewards each advantage is relative to)."""
    max_new_tokens: int = 256
    """The longest completion, in tokens (TRL's max_completion_length): prompt + completion must fit
    model.seq_len, so prompts are cut from the left to model.seq_len - max_new_tokens."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (TRL's default 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability (1.0: all)."""
    loss: str = "dapo"
    """dapo (TRL's default): the summed token terms over the step's completion tokens; grpo: each completion's mean
    token term, averaged; dr_grpo: the summed terms over (completions x max_new_tokens); bnpo: the micro-batch's mean
    token term (so it depends on the micro-batch split, as in TRL). Each exactly as TRL 1.16 defines it."""
    beta: float = 0.0
    """The KL penalty to the reference (the initial weights; with an adapter, the base with the adapter off), TRL's
    k3 estimator times the ratio. 0 (TRL's default): no reference is built or run."""
    epsilon: float = 0.2
    """The ratio's clip below 1 (and above, unless epsilon_high is set)."""
    epsilon_high: Optional[float] = None
    """The ratio's clip above 1 (DAPO's clip-higher; unset: epsilon)."""
    num_iterations: int = 1
    """Optimizer updates per generation batch (TRL's num_iterations; only 1 is built yet)."""
    scale_rewards: str = "group"
    """group: each advantage divided by its group's reward standard deviation; batch: by the whole step's; none:
    not divided (Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """A completion that reaches max_new_tokens without an end token trains nothing (DAPO)."""
    rewards: list[str] = field(default_factory=list)
    """The reward functions, each `package.module:function` (beside the job file, shipped by `ray job submit
    --working-dir .`, or an installed package), called as TRL 1.16 calls them (docs/RL.md)."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function (empty: 1 each); a completion's reward is the weighted sum."""
    samples_every_steps: int = 10
    """Every N steps the step's prompts, completions, rewards and advantages go to MLflow as the table
    samples/step_<N>.json (0: never)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Where the completions are sampled."""


def is_grpo(cfg: Any) -> bool:
    return getattr(cfg.train, "objective", "sft") == "grpo"


def prompts_per_step(cfg: Any) -> int:
    return cfg.train.global_batch_size // max(1, cfg.train.grpo.num_generations)


def problems(cfg: Any) -> list[str]:
    if not is_grpo(cfg):
        return [f"train.grpo.{f.name} is set but train.objective is {cfg.train.objective}: set train.objective: grpo "
                "to use it" for f in fields(GrpoConfig) if getattr(cfg.train.grpo, f.name) != _default(f)]
    return _setting_problems(cfg) + _data_problems(cfg) + _layout_problems(cfg)


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def _setting_problems(cfg: Any) -> list[str]:
    s, t, m = cfg.train.grpo, cfg.train, cfg.model
    p: list[str] = []
    if s.loss in TRL_ONLY_LOSSES:
        p.append(f"train.grpo.loss: {s.loss} is one of TRL 1.16's loss types rayspeed does not build; use one of "
                 f"{', '.join(LOSSES)}")
    elif s.loss not in LOSSES:
        p.append(f"train.grpo.loss: {s.loss!r} is not one of {', '.join(LOSSES)}")
    if s.scale_rewards not in SCALES:
        p.append(f"train.grpo.scale_rewards: {s.scale_rewards!r} is not one of {', '.join(SCALES)}")
    if s.num_generations < 2:
        p.append(f"train.grpo.num_generations: a group needs at least 2 completions, got {s.num_generations}")
    elif t.global_batch_size % s.num_generations:
        p.append(f"train.global_batch_size: {t.global_batch_size} completions is not a whole number of groups of "
                 f"train.grpo.num_generations {s.num_generations}; make it a multiple")
    if not 0 < s.max_new_tokens < m.seq_len:
        p.append(f"train.grpo.max_new_tokens: {s.max_new_tokens} must be at least 1 and leave room for the prompt "
                 f"in model.seq_len {m.seq_len}")
    if s.temperature <= 0:
        p.append(f"train.grpo.temperature: must be > 0, got {s.temperature} (the rollouts sample)")
    if not 0 < s.top_p <= 1:
        p.append(f"train.grpo.top_p: must be in (0, 1], got {s.top_p}")
    if s.beta < 0:
        p.append(f"train.grpo.beta: must be >= 0, got {s.beta}")
    for key, value in (("epsilon", s.epsilon), ("epsilon_high", s.epsilon_high)):
        if value is not None and value < 0:
            p.append(f"train.grpo.{key}: must be >= 0, got {value}")
    if s.num_iterations != 1:
        p.append(f"train.grpo.num_iterations: {s.num_iterations}: several updates per generation batch are not "
                 "built yet; use 1 (TRL's default)")
    if s.samples_every_steps < 0:
        p.append(f"train.grpo.samples_every_steps: must be >= 0, got {s.samples_every_steps}")
    return p + _reward_problems(s) + _rollout_problems(s.rollout)


def _reward_problems(s: Any) -> list[str]:
    if not s.rewards:
        return ["train.grpo.rewards: name at least one reward function, package.module:function (docs/RL.md)"]
    p = [f"train.grpo.rewards: {name!r} is not `package.module:function` (e.g. rewards:exact_sum)"
         for name in s.rewards if not REWARD_NAME.fullmatch(str(name))]
    if s.reward_weights and len(s.reward_weights) != len(s.rewards):
        p.append(f"train.grpo.reward_weights: {len(s.reward_weights)} weights for {len(s.rewards)} reward functions; "
                 "give one per function (or none: 1 each)")
    return p


def _rollout_problems(r: Any) -> list[str]:
    if r.colocate and (r.workers or r.resources or r.sync_every != 1):
        return ["train.grpo.rollout: workers, resources and sync_every describe separate rollout workers; with "
                "colocate: true the trainer workers sample themselves: drop them"]
    if not r.colocate:
        return ["train.grpo.rollout.colocate: false (separate rollout workers) is not built yet; use colocate: true "
                "(each trainer worker samples its own prompts, as TRL does)"]
    return []


def _data_problems(cfg: Any) -> list[str]:
    d = cfg.data
    p: list[str] = []
    if d.source not in ("files", "hf"):
        p.append(f"data.source: {d.source} holds no prompts; GRPO reads records with a prompt (a string or a message "
                 "list) from data.source: files (JSONL, Parquet, a save_to_disk folder) or hf")
    if d.tokenizer == "bytes":
        p.append("data.tokenizer: GRPO needs a transformers tokenizer (it decodes the completions for the reward "
                 "functions and knows the end tokens): set data.tokenizer: model or a tokenizer folder")
    if d.document_masking:
        p.append("data.document_masking: a GRPO row is one prompt and its completion, not packed documents; set it "
                 "false for train.objective: grpo")
    return p


def _layout_problems(cfg: Any) -> list[str]:
    par, m = cfg.parallel, cfg.model
    p: list[str] = []
    for key, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        value = getattr(par, key)
        if isinstance(value, int) and value > 1:
            p.append(f"parallel.{key}: {value} with train.objective: grpo: sampling under {what} parallelism is not "
                     f"built yet; use parallel.{key}: 1 (data parallelism with ZeRO 0-2 trains GRPO)")
    if par.zero_stage == 3:
        p.append("parallel.zero_stage: 3 with train.objective: grpo: the rollouts would gather every layer's weights "
                 "per generated token; use ZeRO 0-2")
    if m.num_experts:
        p.append("model.num_experts: GRPO on a mixture of experts is not built yet (the router's balance loss beside "
                 "the policy loss); train a dense model")
    return p
