"""What reinforcement learning (train.objective: grpo, colocated rollouts) changes in the memory and time of a step
(docs/PLANNER.md, "GRPO").

- Sampling between steps. A rank samples all its completions of a step at once (global_batch / dp rows): the
  prompt's forward (prefill) and then max_new_tokens decode steps over a key/value cache. Its transient memory is
  the cache (rows x seq_len positions x layers x 2 x kv_heads x head_dim, the working precision: prompt + completion
  fit seq_len), the prefill's logits (rows x seq_len x vocab: rayspeed's forward returns every position's) and one
  block's no-grad activations of the prefill. It comes while training's activations are freed (between steps), so
  the rank needs what exceeds training's own transient peak (activations + logits): that excess is the term.
- Its time: the prefill is a forward of rows x seq_len tokens (compute-bound: the step's forward per row), each
  decode step reads every weight and the cache once (memory-bound: bytes over the device's memory bandwidth, the
  cache half full on average).
- The reference when beta > 0: a frozen copy of the weights (none with an adapter: the base with the adapter off)
  and one forward of each micro-batch per step, as DPO's resident reference (planner/dpo_terms.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rayspeed.planner.dpo_terms import forward_s, reference_weight_bytes
from rayspeed.planner.memory import activation_bytes, logits_bytes
from rayspeed.planner.model_math import max_stage_params, split_of
from rayspeed.planner.terms import MemoryTerm, TimeTerm, register


@dataclass(frozen=True)
class GrpoPlan:
    max_new_tokens: int
    beta: float
    adapter: bool

    @classmethod
    def of(cls, cfg: Any) -> Optional["GrpoPlan"]:
        if getattr(cfg.train, "objective", "sft") != "grpo":
            return None
        from rayspeed.config import adapter

        g = cfg.train.grpo
        return cls(max_new_tokens=g.max_new_tokens, beta=g.beta, adapter=adapter.enabled(cfg.model.adapter))

    @property
    def copy(self) -> bool:
        return self.beta > 0 and not self.adapter


def rows(ctx: Any, lay: Any) -> int:
    """Completions one rank samples at once."""
    return max(1, ctx.global_batch // max(1, lay.dp))


def cache_bytes(ctx: Any, lay: Any) -> float:
    sh = ctx.shape
    per_token = sh.num_layers * 2 * (sh.num_kv_heads // max(1, lay.tp)) * sh.head_dim * ctx.w_bytes
    return rows(ctx, lay) * sh.seq_len * per_token


def rollout_peak_bytes(ctx: Any, lay: Any) -> float:
    sh = ctx.shape
    tokens = rows(ctx, lay) * sh.seq_len
    prefill_logits = tokens * sh.vocab_size / max(1, lay.tp) * ctx.w_bytes
    block = tokens * (4 * sh.hidden_size + 3 * sh.ffn_hidden_size / max(1, lay.tp)) * ctx.w_bytes
    return cache_bytes(ctx, lay) + prefill_logits + block


def rollout_excess_bytes(ctx: Any, lay: Any, stage: int) -> float:
    """What sampling needs beyond training's own transient peak, which it replaces between steps."""
    return max(0.0, rollout_peak_bytes(ctx, lay) - activation_bytes(ctx, lay, stage) - logits_bytes(ctx, lay, stage))


def rollout_s(ctx: Any, lay: Any) -> float:
    """One step's sampling: the prefill (a forward of every row, as a training micro-batch's per row) and the decode
    steps (every weight and half the cache read per token, at the element-wise share of the memory bandwidth)."""
    prefill = forward_s(ctx, lay) * rows(ctx, lay) / max(1, lay.micro_batch_size)
    weights = max_stage_params(ctx.shape, lay.tp, lay.pp, split_of(ctx.shape, lay), lay.ep) * ctx.w_bytes
    per_token = (weights + cache_bytes(ctx, lay) / 2) / (ctx.hw.hbm_gbps * 1e9 * ctx.hw.mem_efficiency)
    return prefill + ctx.grpo.max_new_tokens * per_token


def reference_forward_s(ctx: Any, lay: Any) -> float:
    return lay.grad_accum * forward_s(ctx, lay)


def _grpo(ctx: Any, lay: Any) -> bool:
    return ctx.grpo is not None


register(MemoryTerm("grpo_rollout", applies=_grpo, bytes=rollout_excess_bytes,
                    source="docs/PLANNER.md GRPO: the KV cache, the prefill's logits and one block beyond training's "
                           "transient peak"))
register(MemoryTerm("grpo_reference_weights", applies=lambda ctx, lay: ctx.grpo is not None and ctx.grpo.copy,
                    bytes=reference_weight_bytes, dynamic=False,
                    source="docs/PLANNER.md GRPO: a frozen copy of the weights in the working precision (beta > 0)"))
register(TimeTerm("grpo_rollout_s", applies=_grpo, seconds=rollout_s, kind="compute",
                  source="docs/PLANNER.md GRPO: prefill forward + memory-bound decode of max_new_tokens"))
register(TimeTerm("grpo_reference_forward_s", applies=lambda ctx, lay: ctx.grpo is not None and ctx.grpo.beta > 0,
                  seconds=reference_forward_s, kind="compute",
                  source="docs/PLANNER.md GRPO: one forward of each micro-batch through the reference (no backward)"))
