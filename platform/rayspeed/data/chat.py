"""Chat records -> token ids and a loss mask: the tokenizer's own chat template renders the conversation, and only
the assistant turns are trained on (mask 1 on their tokens, 0 on system, user and tool turns and on the
template's role headers).

    renderer = ChatRenderer(tokenizer)               # a TransformersTokenizer with a chat template
    ids, mask = renderer.render(record["messages"], where="chats.jsonl:12")

Two ways to find the assistant tokens:
- templates with `{% generation %}` markers: transformers' `return_assistant_tokens_mask`;
- every other template (most published ones): the conversation is rendered turn by turn, and assistant turn i
  is the text between render(messages[:i], add_generation_prompt=True) and render(messages[:i+1]): its content
  and the template's end-of-turn tokens (so the model learns to stop), not the header that announces it. The
  whole conversation is then tokenized once and each token takes the mask of the character it starts at. A
  template whose renderings are not prefixes of each other (one that rewrites earlier turns) is refused with a
  message saying to add generation markers.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rayspeed.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool", "developer")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """The record's messages as a list of {role, content}; ConfigError naming the record otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"data.format: chat: {where}: 'messages' must be a non-empty list of "
                          "{role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"data.format: chat: {where}: message {i} is not a {{role, content}} object with "
                              "string values")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"data.format: chat: {where} has no assistant turn (nothing to train on); every record "
                          "needs at least one message with role 'assistant'")
    return messages


class ChatRenderer:
    def __init__(self, tokenizer: Any):
        hf = getattr(tokenizer, "hf", None)
        template = getattr(tokenizer, "chat_template", None)
        if hf is None or not template:
            raise ConfigError(f"data.format: chat needs a tokenizer with a chat template; {tokenizer!r} has none "
                              "(point data.tokenizer at a transformers tokenizer directory whose tokenizer_config.json "
                              "or chat_template.jinja holds one, or use data.tokenizer: model)")
        if not getattr(hf, "is_fast", False):
            raise ConfigError(f"data.format: chat needs a fast (tokenizer.json) tokenizer; {tokenizer!r} is not")
        self.tokenizer, self.hf = tokenizer, hf
        self.markers = bool(_GENERATION_TAG.search(template))

    def _text(self, messages: list[dict[str, Any]], prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def render(self, messages: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, mask uint8) of one conversation."""
        messages = check_messages(messages, where)
        if self.markers:
            out = self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            ids = np.asarray(out["input_ids"], dtype=np.int64)
            mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
        else:
            ids, mask = self._render_by_turns(messages, where)
        if not mask.any():
            raise ConfigError(f"data.format: chat: {where}: the chat template renders no assistant tokens")
        return ids, mask

    def _render_by_turns(self, messages: list[dict[str, Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
        full = self._text(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._text(messages[:i], prompt=True) if i else ""
            upto = self._text(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ConfigError(f"data.format: chat: {where}: the chat template of {self.tokenizer!r} does not "
                                  "render the conversation turn by turn (an earlier turn changes when a later one is "
                                  "added); add {% generation %} markers around the assistant turns to the template")
            spans.append((len(before), len(upto)))
        enc = self.hf(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(ids.size, dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask
