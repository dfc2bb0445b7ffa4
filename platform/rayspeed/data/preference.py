"""Preference records -> token ids of each pair's prompt, chosen and rejected completions, as TRL 1.16 tokenizes
them (its DPOTrainer's dataset preparation), and a batch of pairs -> the rows a DPO step trains on.

Three record forms (TRL's); data.format: text takes any of them, data.format: chat only the conversational ones:
    standard        {"prompt": str, "chosen": str, "rejected": str}
    conversational  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, rendered with the
                    tokenizer's chat template (the prompt with its generation prompt)
    implicit        {"chosen": ..., "rejected": ...} of either kind: the prompt is their longest common prefix
                    (whole messages, or characters: a space before the split goes to the completions)
Standard completions end with the tokenizer's EOS text (added when missing); plain text goes through the
tokenizer's own call, special tokens included. The completion starts where the prompt's ids and the whole
sequence's ids first differ (a template may render a prompt alone otherwise than followed by an answer).

    pairs = [tokenize_pair(record, tokenizer, where=f"{path}:{line}") for ...]
    ids, labels = pair_rows(pairs, pad_id)   # [2n, L], [2n, L - 1]: the chosen rows, then the rejected ones
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from rayspeed.data.chat import TemplateRoles
from rayspeed.data.token_split import IGNORE_INDEX
from rayspeed.errors import ConfigError


@dataclass(frozen=True)
class PairIds:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def split_record(record: Any, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a record in any of the three forms; ConfigError naming the record otherwise."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise ConfigError(f"train.objective dpo: {where}: a preference record needs 'chosen' and 'rejected' (and "
                          "optionally 'prompt'): strings, or lists of {role, content} messages")
    chosen, rejected = record["chosen"], record["rejected"]
    kinds = {_is_messages(v) for v in (chosen, rejected)} | ({_is_messages(record["prompt"])} if "prompt" in record
                                                            else set())
    if len(kinds) > 1 or not all(isinstance(v, (str, list)) for v in (chosen, rejected)):
        raise ConfigError(f"train.objective dpo: {where}: 'prompt', 'chosen' and 'rejected' must all be strings or all "
                          "be message lists")
    if "prompt" in record:
        return record["prompt"], chosen, rejected
    n = 0
    for n in range(min(len(chosen), len(rejected))):  # TRL's extract_prompt
        if chosen[n] != rejected[n]:
            if chosen[n - 1] == " ":
                n -= 1
            break
    return chosen[:n], chosen[n:], rejected[n:]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(record: Any, tokenizer: Any, where: str, data_format: str = "text",
                  roles: TemplateRoles | None = None) -> PairIds:
    """The record's ids under a transformers tokenizer (rayspeed.data.tokenizer.TransformersTokenizer). roles: the
    template's rendered roles, shared by the records of one source (probed here when not given)."""
    prompt, chosen, rejected = split_record(record, where)
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise ConfigError("data.tokenizer: preference data needs a transformers tokenizer (a folder with "
                          "tokenizer_config.json, or the model's own with model.pretrained)")
    if data_format == "chat" and not _is_messages(chosen):
        raise ConfigError(f"data.format: chat: {where}: 'chosen' and 'rejected' are strings, but chat preference "
                          "records hold lists of {role, content} messages (TRL's conversational form); write them "
                          "so, or set data.format: text for string records")
    if _is_messages(chosen):
        if not getattr(hf, "chat_template", None):
            raise ConfigError(f"train.objective dpo: {where}: conversational records need a tokenizer with a chat "
                              "template; give data.tokenizer one, or use standard (string) records")
        roles = roles if roles is not None else TemplateRoles(hf, repr(tokenizer), key="train.objective dpo")
        roles.check([*prompt, *chosen, *rejected], where)

        def render(messages, **kw):
            return list(hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])

        prompt_ids = render(prompt, add_generation_prompt=True)
        with_chosen, with_rejected = render(prompt + chosen), render(prompt + rejected)
    else:
        eos = hf.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = list(hf(text=prompt)["input_ids"])
        with_chosen, with_rejected = (list(hf(text=prompt + c)["input_ids"]) for c in (chosen, rejected))
    n = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return PairIds(prompt_ids[:n], with_chosen[n:], with_rejected[n:])


def pair_rows(pairs: Sequence[PairIds], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids [2n, L], labels [2n, L - 1]) of the pairs: prompt + chosen rows, then prompt + rejected rows in the
    same order, right-padded with pad_id to the longest; the labels are the next token on the completion and -100
    on the prompt and the padding."""
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    width = max(len(a) + len(b) for a, b in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    counted = np.zeros((len(rows), width), dtype=bool)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, :len(prompt) + len(completion)] = prompt + completion
        counted[i, len(prompt):len(prompt) + len(completion)] = True
    labels = np.where(counted[:, 1:], ids[:, 1:], IGNORE_INDEX)
    return ids, labels
