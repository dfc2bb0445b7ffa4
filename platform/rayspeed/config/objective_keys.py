"""`train.objective` and its `train.dpo` section: what a preference-tuning job may set, and what it may not combine
yet (each problem names its key and the fix). Torch-free: `rayspeed plan` and the job checks read it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

OBJECTIVES = ("sft", "dpo", "grpo")


@dataclass
class DpoConfig:
    loss: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    """sigmoid: -log sigmoid(beta d), d the chosen completion's log-probability gain over the reference minus the
    rejected one's (DPO); ipo: (d over each completion's length - 1 / (2 beta))^2 (IPO, length-normalised as TRL
    1.16 does); robust: the label-smoothed sigmoid of robust DPO, unbiased for preference labels flipped with
    probability label_smoothing. Each exactly as TRL 1.16's DPOTrainer defines it."""
    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta times the log-probability gains (0.1
    is TRL's default; smaller moves further)."""
    label_smoothing: float = 0.0
    """robust only: the assumed probability that a pair's preference is flipped, in [0, 0.5) (TRL 1.16's sigmoid
    loss has no label smoothing)."""
    reference: Literal["precomputed", "resident"] = "precomputed"
    """The reference model's log-probabilities. precomputed: one forward pass over every pair with the initial
    weights before the first step, stored beside the token cache keyed by those weights and the data (no second
    model in memory while training; a resumed or retrained run reads them). resident: a frozen copy of the initial
    weights beside the policy, one more forward per micro-batch; with an adapter, the base model with the
    adapter turned off (no copy)."""


def is_dpo(cfg: Any) -> bool:
    return getattr(cfg.train, "objective", "sft") == "dpo"


def problems(cfg: Any) -> list[str]:
    t, d, par, m = cfg.train, cfg.data, cfg.parallel, cfg.model
    if not is_dpo(cfg):
        set_keys = [f.name for f in fields(DpoConfig) if getattr(t.dpo, f.name) != f.default]
        if t.objective not in OBJECTIVES:
            return [f"train.objective: {t.objective!r} is not one of {', '.join(OBJECTIVES)}"]
        return [f"train.dpo.{k} is set but train.objective is {t.objective}: set train.objective: dpo to use it"
                for k in set_keys]
    p: list[str] = []
    s = t.dpo
    if s.beta <= 0:
        p.append(f"train.dpo.beta: must be > 0, got {s.beta}")
    if s.loss == "robust" and not 0.0 <= s.label_smoothing < 0.5:
        p.append(f"train.dpo.label_smoothing: robust needs it in [0, 0.5), got {s.label_smoothing}")
    if s.loss != "robust" and s.label_smoothing:
        p.append(f"train.dpo.label_smoothing: only the robust loss reads it (TRL 1.16's {s.loss} has no label "
                 "smoothing); set train.dpo.loss: robust or drop it")
    if d.source in ("python-stdlib", "tokens"):
        p.append(f"data.source: {d.source} cannot carry preference pairs; DPO reads records with chosen and rejected "
                 "(and optionally prompt) from data.source: files (JSONL, Parquet, a save_to_disk folder) or hf")
    if d.tokenizer == "bytes":
        p.append("data.tokenizer: DPO needs a transformers tokenizer (its EOS ends each completion, its chat template "
                 "renders conversational pairs): set data.tokenizer: model or a tokenizer folder")
    if d.document_masking:
        p.append("data.document_masking: a preference pair is one padded row per completion, not packed documents; "
                 "set it false for train.objective: dpo")
    if isinstance(par.cp, int) and par.cp > 1:
        p.append(f"parallel.cp: {par.cp} with train.objective: dpo: per-token log-probabilities under context "
                 "parallelism are not built; use parallel.cp: 1 (dp, ZeRO, tp with sequence parallelism and pp train "
                 "DPO)")
    if isinstance(par.pp, int) and par.pp > 1 and s.reference == "resident":
        p.append(f"train.dpo.reference: resident with parallel.pp {par.pp}: a pipeline scores the reference in its "
                 "own pass before training; use reference: precomputed (also with an adapter: it starts equal to "
                 "its base)")
    if m.num_experts:
        p.append("model.num_experts: DPO on a mixture of experts is not built yet (the balance loss beside the "
                 "preference loss); train a dense model")
    if s.reference == "resident" and par.zero_stage == 3:
        p.append("train.dpo.reference: resident keeps a whole unpartitioned copy of the weights on every rank, which "
                 "ZeRO-3 exists to avoid; use reference: precomputed (no second model) or ZeRO 0-2")
    return p
