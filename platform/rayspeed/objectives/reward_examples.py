"""Two reward functions in TRL 1.16's form, ready to name in train.grpo.rewards and to copy (docs/RL.md):

    rewards: [rayspeed.objectives.reward_examples:exact_number, rayspeed.objectives.reward_examples:matches_format]

exact_number: 1.0 when the completion's last number equals the record's `answer` column, else 0.0 (None for a
record without one: the function does not apply). matches_format: 1.0 when the whole completion matches the record's
`format` column, a regular expression (None without one).
"""

from __future__ import annotations

import re
from typing import Any, Optional

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def text_of(completion: Any) -> str:
    """A completion as text: itself, or the content of TRL's conversational form's last message."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def exact_number(completions: list[Any], answer: Optional[list[Any]] = None, **kwargs: Any) -> list[Optional[float]]:
    out: list[Optional[float]] = []
    for i, completion in enumerate(completions):
        expected = None if answer is None else answer[i]
        if expected is None:
            out.append(None)
            continue
        numbers = NUMBER.findall(text_of(completion))
        out.append(1.0 if numbers and float(numbers[-1]) == float(expected) else 0.0)
    return out


def matches_format(completions: list[Any], format: Optional[list[Any]] = None, **kwargs: Any) -> list[Optional[float]]:
    if format is None:
        return [None] * len(completions)
    return [None if f is None else float(re.fullmatch(str(f), text_of(c), flags=re.DOTALL) is not None)
            for c, f in zip(completions, format)]
