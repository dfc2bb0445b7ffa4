"""Sampling completions from rayspeed's own model: a batch of prompts, left-padded, one forward over the prompts
(the prefill) and then one token per forward, each over the keys and values the attention layers cached
(rayspeed.model.kv_cache). A model whose attention does not cache (DeepSeek-V3's latent attention) runs the whole
sequence at every token instead: slower, the same tokens.

Greedy decoding gives transformers' `generate(do_sample=False)` tokens on the same weights; sampling draws from the
temperature-scaled distribution, cut to the top_k tokens and the top_p nucleus as transformers' warpers cut it, with
the caller's generator (a rollout's seed makes its completions again).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from rayspeed.model.kv_cache import DecodeState, segments_of
from rayspeed.model.parts.self_attention import Attention


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


@dataclass
class Completions:
    ids: list[list[int]]  # each row's new tokens, up to and including its first end token
    truncated: list[bool]  # the row reached max_new_tokens without an end token
    entropies: list[list[float]] = field(default_factory=list)
    """Each new token's entropy of the temperature-scaled distribution over the whole vocabulary (before top-k and
    top-p: TRL's `entropy`) it was drawn from, in nats; empty for greedy decoding."""


def entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The entropy [b] of softmax(logits / temperature) over the last dimension."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def caches(model: nn.Module) -> bool:
    """Whether every layer's attention keeps a cache (else generate recomputes the whole sequence per token)."""
    layers = getattr(model, "layers", [])
    return len(layers) > 0 and all(isinstance(getattr(layer, "attn", None), Attention) for layer in layers)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, longest], real-token mask [b, longest]) with each prompt at the right end of its row."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((len(prompts), longest), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        if p:
            ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
            valid[i, longest - len(p):] = True
    return ids, valid


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row [b] from its last logits [b, vocab]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        scores = nucleus(scores, sampling.top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores outside the smallest set of most likely tokens whose probability reaches top_p set to -inf
    (transformers' TopPLogitsWarper: ascending order, drop while the running sum stays within 1 - top_p, keep
    the most likely token always)."""
    ordered, order = torch.sort(scores, descending=False, dim=-1)
    running = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = running <= (1 - top_p)
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], sampling: Sampling, eos_ids: Collection[int], pad_id: int,
             generator: torch.Generator | None = None, cache: bool | None = None) -> Completions:
    """Completions of the prompts (token ids) by `model` (a rayspeed Transformer, in eval mode for the duration)."""
    was_training = model.training
    model.eval()
    try:
        return _decode(model, prompts, sampling, set(eos_ids), pad_id, generator,
                       caches(model) if cache is None else cache)
    finally:
        model.train(was_training)


def _decode(model: nn.Module, prompts: list[list[int]], sampling: Sampling, eos: set[int], pad_id: int,
            generator: torch.Generator | None, cache: bool) -> Completions:
    device = next(model.parameters()).device
    ids, valid = left_padded(prompts, pad_id, device)
    state = DecodeState(valid) if cache else None
    rows = len(prompts)
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    step_ids = ids
    spread: list[torch.Tensor] = []  # each step's entropies [b], read back once at the end
    for _ in range(sampling.max_new_tokens):
        logits = model(step_ids, segment_ids=state) if state is not None else model(ids, segment_ids=segments_of(valid))
        token = pick(logits[:, -1], sampling, generator)
        if not sampling.greedy:
            spread.append(entropy(logits[:, -1], sampling.temperature))
        chosen = token.tolist()  # the one host sync of a token
        for i, t in enumerate(chosen):
            if not done[i]:
                out[i].append(t)
                done[i] = t in eos
            else:
                chosen[i] = pad_id
        if all(done):
            break
        step_ids = torch.tensor(chosen, dtype=torch.long, device=device)[:, None]
        real = torch.ones_like(step_ids, dtype=torch.bool)
        if state is not None:
            state.extend(real)
        else:  # recomputing: the whole sequence again next time
            ids, valid = torch.cat([ids, step_ids], dim=1), torch.cat([valid, real], dim=1)
    truncated = [not (row and row[-1] in eos) for row in out]
    if not spread:
        return Completions(out, truncated)
    per_step = torch.stack(spread, dim=1).tolist()  # [b, steps]
    return Completions(out, truncated, [values[:len(row)] for values, row in zip(per_step, out)])
