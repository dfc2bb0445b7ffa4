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
  whole conversation is then tokenized once and each token takes the mask of the character it starts at.
- a template that rewrites earlier turns once a later one is added (Qwen3's drops the reasoning of every assistant
  turn before the last user message): one document per assistant turn, the conversation up to that turn as the
  template renders it when that turn is the one being generated, only that turn trained. Each turn's loss tokens
  are then exactly what the template produces for it, and no turn is trained in a form the model never sees.
  A template whose generation prompt is not a prefix of the turn it announces is refused with a message saying to
  add generation markers.

Roles: a template renders the roles it was written for and may raise on another one or silently leave its turn out
(Qwen's and gpt-oss's skip a role they do not know), which would train on a conversation the records do not hold.
Each distinct role is probed once (TemplateRoles): a turn of that role with a marker text, alone and in the few
contexts templates require (before a user turn, as Llama 2 folds a system prompt into it; after one, as Mistral's
alternation wants a user turn first; after an assistant tool call, as gpt-oss wants before a tool result). The role
renders when one of them renders without error and the marker is in the text; a record with any other role is
refused, naming it and the roles that render.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rayspeed.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool", "developer")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# Letters, digits and dashes only: unchanged by the filters templates apply to content (trim, tojson, escaping).
_PROBE = "rayspeed-role-probe-5b1d"
_USER: dict[str, Any] = {"role": "user", "content": "rayspeed-probe-question"}
_TOOL_CALL: dict[str, Any] = {
    "role": "assistant", "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "rayspeed_probe", "arguments": {}}}]}


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """The record's messages as a list of {role, content}; ConfigError naming the record otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"data.format: chat: {where}: 'messages' must be a non-empty list of "
                          "{role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"),
                                                                                          (str, list)):
            raise ConfigError(f"data.format: chat: {where}: message {i} is not a {{role, content}} object with a "
                              "string role and a string (or a list of text and image parts) content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"data.format: chat: {where} has no assistant turn (nothing to train on); every record "
                          "needs at least one message with role 'assistant'")
    return messages


class TemplateRoles:
    """Which roles a tokenizer's chat template renders (the module's docstring), probed once per role."""

    def __init__(self, hf: Any, name: str, key: str = "data.format: chat"):
        self.hf, self.name, self.key = hf, name, key
        self._renders: dict[str, bool] = {}

    def renders(self, role: str) -> bool:
        if role not in self._renders:
            turn: dict[str, Any] = {"role": role, "content": _PROBE}
            self._renders[role] = any(self._shows(c) for c in ([turn], [turn, _USER], [_USER, turn],
                                                                  [_USER, _TOOL_CALL, turn]))
        return self._renders[role]

    def _shows(self, messages: list[dict[str, Any]]) -> bool:
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - a template refuses a context in its own way (raise_exception, a KeyError)
            return False
        return isinstance(text, str) and _PROBE in text

    def check(self, messages: list[Any], where: str) -> None:
        """ConfigError naming the record, the first role the template does not render and the roles it does."""
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            if isinstance(role, str) and not self.renders(role):
                known = [r for r in ROLES if self.renders(r)]
                raise ConfigError(f"{self.key}: {where}: role {role!r} is not rendered by the chat template of "
                                  f"{self.name} (it refuses that turn or leaves it out); the template renders "
                                  f"{', '.join(known) or 'none of ' + ', '.join(ROLES)}: give the turn one of those "
                                  "roles, or use a tokenizer whose template renders it")


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
        self.roles = TemplateRoles(hf, repr(tokenizer))

    def _text(self, messages: list[dict[str, Any]], prompt: bool = False, where: str = "") -> str:
        return self._apply(where, messages, tokenize=False, add_generation_prompt=prompt)

    def _apply(self, where: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        """apply_chat_template, with the template's own refusal (Gemma 2's `raise_exception('System role not
        supported')`) as a ConfigError naming the record."""
        from jinja2.exceptions import TemplateError

        try:
            return self.hf.apply_chat_template(messages, **kwargs)
        except TemplateError as e:
            raise ConfigError(f"data.format: chat: {where}: the chat template of {self.tokenizer!r} refuses this "
                              f"conversation: {e}; change the record (for instance fold a system message into the "
                              "first user turn) or use a template that accepts it") from None

    def render(self, messages: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, mask uint8) of one conversation, as one document (ConfigError for a template that rewrites
        earlier turns: render_documents splits those)."""
        documents = self.render_documents(messages, where)
        if len(documents) > 1:
            raise ConfigError(f"data.format: chat: {where}: the chat template of {self.tokenizer!r} rewrites earlier "
                              "turns; the conversation is one document per assistant turn")
        return documents[0]

    def render_documents(self, messages: Any, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """The conversation's documents: (ids int64, mask uint8) each; one, or one per assistant turn for a
        template that rewrites earlier turns (the module's docstring)."""
        messages = check_messages(messages, where)
        self.roles.check(messages, where)
        if self.markers:
            out = self._apply(where, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            documents = [(np.asarray(out["input_ids"], dtype=np.int64),
                          np.asarray(out["assistant_masks"], dtype=np.uint8))]
        else:
            documents = self._render_by_turns(messages, where)
        if not all(mask.any() for _, mask in documents):
            raise ConfigError(f"data.format: chat: {where}: the chat template renders no assistant tokens")
        return documents

    def _render_by_turns(self, messages: list[dict[str, Any]], where: str) -> list[tuple[np.ndarray, np.ndarray]]:
        full = self._text(messages, where=where)
        turns = []  # (the text up to and with assistant turn i, where the turn starts in it)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._text(messages[:i], prompt=True, where=where) if i else ""
            upto = self._text(messages[: i + 1], where=where)
            if not upto.startswith(before):
                raise ConfigError(f"data.format: chat: {where}: the chat template of {self.tokenizer!r} does not "
                                  "render the conversation turn by turn (the generation prompt is not how the "
                                  "assistant turn it announces starts); add {% generation %} markers around the "
                                  "assistant turns to the template")
            turns.append((upto, len(before)))
        if all(full.startswith(upto) for upto, _ in turns):
            return [self._masked(full, [(start, len(upto)) for upto, start in turns])]
        return [self._masked(upto, [(start, len(upto))]) for upto, start in turns]

    def _masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """text tokenized once, each token masked 1 when it starts inside one of the character spans."""
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(ids.size, dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask
