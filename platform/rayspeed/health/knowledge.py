"""The knowledge file (knowledge.yaml, shipped as package data) and the Finding every check reports.

One data file holds what the platform knows about failures (signature, category, cause, remedy, source) and
about environment variables, so the doctor, the env lint, the preflight and the healthcheck say the same thing.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from rayspeed.config import env_lint

CATEGORIES = ("nccl_timeout", "oom", "nan_loss", "grad_explosion", "hang", "slow_throughput", "checkpoint_corrupt",
              "env_invalid", "slow_rank", "topology", "bandwidth", "rank_failed", "network", "worker_died",
              "shm_exhausted", "checkpoint_missing")
SEVERITIES = ("error", "warn", "info")


@dataclass
class Finding:
    category: str
    cause: str
    remedy: str
    severity: str = "error"
    id: str = ""
    source: str = ""
    evidence: list[str] = field(default_factory=list)
    """Log lines (with their line numbers) or measurements that triggered it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything specific to the finding (the variable and its replacement, the planner's view, ...)."""

    def to_json(self) -> dict[str, Any]:
        d = {"category": self.category, "cause": self.cause, "remedy": self.remedy, "severity": self.severity,
             "id": self.id, "source": self.source, "evidence": list(self.evidence)}
        d.update(self.extra)
        return d

    def line(self) -> str:
        return f"[{self.severity}] {self.category}: {self.cause} -> {self.remedy}"


@dataclass(frozen=True)
class Entry:
    id: str
    category: str
    severity: str
    cause: str
    remedy: str
    source: str
    signature: tuple = ()
    """Compiled regexes."""
    detector: str | None = None

    def finding(self, evidence: list[str] | None = None, cause: str | None = None, remedy: str | None = None,
                **extra: Any) -> Finding:
        return Finding(category=self.category, cause=cause or self.cause, remedy=remedy or self.remedy,
                       severity=self.severity, id=self.id, source=self.source, evidence=list(evidence or []),
                       extra=extra)


@dataclass(frozen=True)
class Knowledge:
    entries: tuple
    env_table: env_lint.EnvTable
    """Variables from an `env:` section of the parsed text (tests); the lint's own table is config/env_vars.yaml."""

    @property
    def env(self) -> dict:
        """The variables the lint knows (config/env_vars.yaml), or the parsed text's own when it has some."""
        return self.env_table.env or env_lint.table().env

    def entry(self, entry_id: str) -> Entry:
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise KeyError(entry_id)


def _text() -> str:
    return resources.files("rayspeed.health").joinpath("knowledge.yaml").read_text(encoding="utf-8")


def parse(text: str) -> Knowledge:
    """Parse and check the knowledge file; a malformed entry is a bug in the file, so it raises ValueError."""
    # The C loader when PyYAML has it: the pure-Python one takes a fifth of a second on this file.
    raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    entries = []
    seen = set()
    for i, r in enumerate(raw.get("findings") or []):
        missing = [k for k in ("id", "category", "cause", "remedy", "source") if not r.get(k)]
        if missing:
            raise ValueError(f"knowledge.yaml findings[{i}] ({r.get('id')}): missing {missing}")
        if r["category"] not in CATEGORIES:
            raise ValueError(f"knowledge.yaml {r['id']}: unknown category {r['category']!r}")
        sev = r.get("severity", "error")
        if sev not in SEVERITIES:
            raise ValueError(f"knowledge.yaml {r['id']}: unknown severity {sev!r}")
        if r["id"] in seen:
            raise ValueError(f"knowledge.yaml: duplicate id {r['id']!r}")
        seen.add(r["id"])
        sigs = r.get("signature") or []
        if isinstance(sigs, str):
            sigs = [sigs]
        if not sigs and not r.get("detector"):
            raise ValueError(f"knowledge.yaml {r['id']}: needs a signature or a detector")
        entries.append(Entry(
            id=r["id"], category=r["category"], severity=sev, cause=" ".join(str(r["cause"]).split()),
            remedy=" ".join(str(r["remedy"]).split()), source=str(r["source"]),
            signature=tuple(re.compile(s, re.IGNORECASE) for s in sigs), detector=r.get("detector"),
        ))
    env = env_lint.parse_table(raw)
    return Knowledge(entries=tuple(entries), env_table=env)


@functools.lru_cache(maxsize=1)
def load() -> Knowledge:
    return parse(_text())
