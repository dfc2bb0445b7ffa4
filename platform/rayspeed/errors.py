"""Errors the user can fix. Entry points turn them into one message and exit code 2."""

from __future__ import annotations

from rayspeed.redact import redact_text


class ConfigError(Exception):
    """The job (file, overrides or cluster) is wrong. Carries every problem found, each naming its key."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        """The message, secrets masked: it goes to stderr, which `ray job submit` keeps in the job's log."""
        if len(self.problems) == 1:
            return redact_text(f"config error: {self.problems[0]}")
        lines = [f"config error: {len(self.problems)} problems"]
        lines += [f"  - {p}" for p in self.problems]
        return redact_text("\n".join(lines))


class FinalError(RuntimeError):
    """A failure of the job itself that a restart would only repeat (a user's function raising on their data):
    raised on every rank at once, it ends the job with its message instead of costing the restarts. `status` is
    the summary's."""

    status = "failed"


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
