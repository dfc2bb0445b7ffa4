"""Prompt records of a GRPO job (TRL's prompt-only forms): `{"prompt": str | [messages], <other columns>}` from a
files or hf source. Each record becomes its prompt as the reward functions see it, its ids (a message list rendered
by the chat template with the generation prompt added; a string tokenized as it is) cut from the left to the room
left beside the completion, and every other column, handed to the reward functions by name.

    prompts = read_prompts(spec, tokenizer, max_prompt_tokens)     # PromptSet: records, content hash
    train, val = prompts.split(val_fraction)

Prompts are few and short beside a pretraining corpus: they are read on every worker (no token cache); a bad record
is a ConfigError naming it, found by the launcher's read before anything is written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from rayspeed.data.records import DataSpec, describe, iter_records, plan_units
from rayspeed.errors import ConfigError


@dataclass(frozen=True)
class PromptRecord:
    prompt: Any  # the record's prompt as the reward functions see it (a string or a message list)
    ids: list[int]  # its tokens (a message list rendered by the chat template, the generation prompt added)
    columns: dict[str, Any] = field(default_factory=dict)  # every other column, handed to the rewards


@dataclass
class PromptSet:
    records: list[PromptRecord]
    source: str
    content_hash: str
    cut: int = 0  # prompts cut from the left to fit beside max_new_tokens

    def split(self, val_fraction: float) -> tuple[list[PromptRecord], list[PromptRecord]]:
        """(train, val): the last val_fraction of the records held out (at least one when the fraction is > 0)."""
        n = len(self.records)
        held = min(n - 1, max(1, round(n * val_fraction))) if val_fraction > 0 and n > 1 else 0
        return self.records[:n - held], self.records[n - held:]

    def __repr__(self) -> str:
        return f"{len(self.records)} prompts from {self.source}"


def is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def prompt_ids(prompt: Any, hf: Any, where: str) -> list[int]:
    if isinstance(prompt, str):
        return list(hf(text=prompt)["input_ids"])
    if not is_messages(prompt):
        raise ConfigError(f"train.objective grpo: {where}: 'prompt' must be a string or a list of {{role, content}} "
                          f"messages, got {type(prompt).__name__}")
    if not getattr(hf, "chat_template", None):
        raise ConfigError(f"train.objective grpo: {where}: a conversational prompt needs a tokenizer with a chat "
                          "template; give data.tokenizer one, or write the prompt as a string")
    return list(hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
                ["input_ids"])


def read_prompts(spec: DataSpec, tokenizer: Any, max_prompt_tokens: int) -> PromptSet:
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise ConfigError("data.tokenizer: GRPO needs a transformers tokenizer (a folder with tokenizer_config.json, "
                          "or the model's own with model.pretrained)")
    units, _ = plan_units(spec)
    records: list[PromptRecord] = []
    digest = hashlib.sha256(tokenizer.fingerprint.encode())
    cut = 0
    for unit in units:
        for record, loc in iter_records(unit, spec):
            where = describe(loc)
            if not isinstance(record, dict) or "prompt" not in record:
                raise ConfigError(f"train.objective grpo: {where}: a prompt record needs a 'prompt' (a string or a "
                                  "list of {role, content} messages); its other columns go to the reward functions")
            ids = prompt_ids(record["prompt"], hf, where)
            if not ids:
                raise ConfigError(f"train.objective grpo: {where}: the prompt has no tokens")
            if len(ids) > max_prompt_tokens:
                ids, cut = ids[-max_prompt_tokens:], cut + 1
            columns = {k: v for k, v in record.items() if k != "prompt"}
            records.append(PromptRecord(record["prompt"], ids, columns))
            digest.update(json.dumps([ids, columns], sort_keys=True, default=str).encode())
    if not records:
        raise ConfigError(f"data: {spec.describe()} holds no prompt records")
    return PromptSet(records, spec.describe(), digest.hexdigest(), cut)
