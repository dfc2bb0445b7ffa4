"""The repository stands alone: nothing in it points at the development machine's files (a user's clone has none
of them), and every `PLAYBOOK <section>` citation in code, configs and docs resolves to a heading of
docs/PLAYBOOK.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r"\.\./shared|shared/(?:spec|reference)|/work/(?:main|shared)\b")
CITATION = re.compile(r"PLAYBOOK ([AB](?:\.\d+)?)\b")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def test_nothing_points_outside_the_repository():
    me = Path(__file__).resolve()
    bad = []
    for path in _tracked():
        # real-format logs quote the machines they came from; this file names what it forbids
        if path == me or "fixtures/logs" in path.as_posix():
            continue
        text = _text(path)
        for n, line in enumerate((text or "").splitlines(), 1):
            if FORBIDDEN.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


def test_every_playbook_citation_resolves():
    headings = set()
    for line in (ROOT / "docs" / "PLAYBOOK.md").read_text().splitlines():
        m = re.match(r"#{2,3} ([AB](?:\.\d+)?)[. ]", line)
        if m:
            headings.add(m.group(1))
    assert {"A", "B.1", "B.9", "B.11"} <= headings
    cited, missing = 0, []
    for path in _tracked():
        if path.suffix not in (".py", ".yaml", ".yml", ".md") or path.name == "PLAYBOOK.md":
            continue
        for m in CITATION.finditer(_text(path) or ""):
            cited += 1
            if m.group(1) not in headings:
                missing.append(f"{path.relative_to(ROOT)}: PLAYBOOK {m.group(1)}")
    assert cited > 20 and not missing, missing


def test_the_readme_is_for_users_and_loses_nothing():
    """Under 200 lines; every heading the long README had is still a heading of the README or of docs/."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    headings = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        headings |= {line.lstrip("#").strip() for line in page.read_text().splitlines() if re.match(r"#{1,4} ", line)}
    before = ["Two commands", "Running jobs", "On a Ray cluster (`ray job submit`)", "More CPU workers than cores",
              "Planning", "Failures and elasticity", "Health", "Scheduled retraining", "Security", "Benchmarks",
              "More than one machine", "Bring your model", "Bring your data", "Token shards", "Where things go",
              "Layout of the repository"]
    assert [h for h in before if h not in headings] == []
    for link in re.findall(r"\]\(([^)#]+)\)", readme):  # every page the README links to exists
        assert (ROOT / link).exists(), link
