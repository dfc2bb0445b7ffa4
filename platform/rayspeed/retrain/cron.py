"""The crontab line that runs `make retrain` on a schedule: built, installed idempotently, removed.

    line = cron_line("0 3 * * *", "configs/tiny-cpu.yaml", "/repo", "/repo/runs/retrain.log")
    install(line)              # replaces the line for the same repo + config, leaves every other line alone
    remove("/repo")            # removes only rayspeed-retrain lines of that repo (of one config if given)

Every line ends with the marker `# rayspeed-retrain <repo>:<config>`, which is how it is found again. The
command cds into the repository, runs make with an absolute path (cron's PATH is minimal) and appends stdout
and stderr to the log file. RAY_ADDRESS, MLFLOW_TRACKING_URI and the MLflow credentials (MLFLOW_TRACKING_USERNAME,
MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN), when set at install time, go with the line (cron starts jobs
with an almost empty environment). '%' is escaped (cron turns it into a newline).

No secret is ever written into the crontab (which `crontab -l` prints and mail and backups copy): a credential
(a secret-named variable, or a URI with a password or a token) goes into an environment file of mode 0600,
$XDG_CONFIG_HOME/rayspeed/retrain-<id>.env (one per repo + config, removed with the line), which the line
sources (`set -a && . FILE && set +a`). An ARGS value that looks like a secret is refused.

`crontab_cmd` (or the environment variable RAYSPEED_CRONTAB) names the crontab program; tests point it at a
fake that keeps the table in a temporary file.

CLI (what `make schedule` / `make unschedule` call):
    python -m rayspeed.retrain.cron install --cron "0 3 * * *" --config C --repo DIR --log FILE
        [--args "..."] [--dry-run]
    python -m rayspeed.retrain.cron remove --repo DIR [--config C] [--dry-run]
    python -m rayspeed.retrain.cron show [--repo DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from rayspeed.redact import is_secret_key, redact_text, redact_uri

MARKER = "# rayspeed-retrain"
PASS_ENV = ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
            "MLFLOW_TRACKING_TOKEN")
_MARKER_RE = re.compile(r"#\s*rayspeed-retrain\s+(?P<repo>.+):(?P<config>[^:]*)\s*$")
_CRON_ALIASES = ("@reboot", "@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


class CronError(ValueError):
    pass


def check_schedule(cron: str) -> str:
    """The five-field schedule (or an @alias), whitespace-normalised; CronError if it cannot be one."""
    s = " ".join((cron or "").split())
    if not s:
        raise CronError('CRON is required, e.g. CRON="0 3 * * *" (minute hour day-of-month month day-of-week)')
    if s.startswith("@"):
        if s not in _CRON_ALIASES:
            raise CronError(f"CRON {cron!r}: unknown alias; one of {', '.join(_CRON_ALIASES)}")
        return s
    fields = s.split(" ")
    if len(fields) != 5:
        raise CronError(f"CRON {cron!r}: expected 5 fields (minute hour day-of-month month day-of-week), "
                        f"got {len(fields)}")
    for f in fields:
        if not re.fullmatch(r"[0-9A-Za-z*/,\-]+", f):
            raise CronError(f"CRON {cron!r}: field {f!r} is not a cron field")
    return s


def _norm_repo(repo: str) -> str:
    return str(Path(repo).expanduser().resolve())


def _norm_config(config: str, repo: str) -> str:
    """The config as the line names it: relative to the repository when inside it (so CONFIG=./configs/x.yaml
    and CONFIG=configs/x.yaml are the same line), else absolute."""
    p = Path(config).expanduser()
    absolute = (Path(repo) / p if not p.is_absolute() else p).resolve()
    try:
        return str(absolute.relative_to(repo))
    except ValueError:
        return str(absolute)


def marker(repo: str, config: str) -> str:
    repo = _norm_repo(repo)
    return f"{MARKER} {repo}:{_norm_config(config, repo)}"


def line_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The variables the line carries: `env`, else PASS_ENV from this environment."""
    return dict(env) if env is not None else {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}


def secret_env(env: dict[str, str]) -> dict[str, str]:
    """The variables whose value is a credential: a secret-looking name, or a URI carrying credentials."""
    return {k: v for k, v in env.items() if is_secret_key(k) or redact_uri(v) != v}


def env_file_for(repo: str, config: str) -> Path:
    """The 0600 environment file of the line of repo + config (outside the repository and its runs)."""
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "rayspeed"
    ident = hashlib.sha256(marker(repo, config).encode()).hexdigest()[:16]
    return base / f"retrain-{ident}.env"


def write_env_file(path: Path, env: dict[str, str]) -> None:
    """KEY='value' lines, readable by the owner only (created 0600; an existing file is made 0600 first)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("# written by `rayspeed schedule install`; sourced by its crontab line\n")
        fh.writelines(f"{k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))


def cron_line(cron: str, config: str, repo_dir: str, log_file: str, args: str = "",
              make: Optional[str] = None, env: Optional[dict[str, str]] = None,
              env_file: Optional[str] = None) -> str:
    """The exact crontab line: `<schedule> cd <repo> && mkdir -p <log dir> && [set -a && . <env file> && set +a
    &&] [VAR=..] make retrain CONFIG=<config> [ARGS=..] >> <log> 2>&1 # rayspeed-retrain <repo>:<config>`.
    Credentials of `env` are left out of the line: they belong in the env file it sources (secret_env,
    write_env_file; default path env_file_for)."""
    sched = check_schedule(cron)
    repo = _norm_repo(repo_dir)
    cfg = _norm_config(config, repo)
    if redact_text(args, environ={}) != args:
        raise CronError(f"ARGS {redact_text(args, environ={})!r}: a secret would be written into the crontab in "
                        "clear; put it in the job file or the cron job's environment instead")
    log = str(Path(log_file).expanduser().resolve()) if Path(log_file).is_absolute() else str(Path(repo) / log_file)
    make = make or shutil.which("make") or "make"
    envs = line_env(env)
    secrets = secret_env(envs)
    parts = [f"cd {shlex.quote(repo)}", f"mkdir -p {shlex.quote(str(Path(log).parent))}"]
    if secrets:
        parts.append(f"set -a && . {shlex.quote(str(env_file or env_file_for(repo, cfg)))} && set +a")
    inline = {k: v for k, v in envs.items() if k not in secrets}
    cmd = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(inline.items())), shlex.quote(make), "retrain",
                    f"CONFIG={shlex.quote(cfg)}"] + ([f"ARGS={shlex.quote(args.strip())}"] if args.strip() else []))
    parts.append(f"{cmd} >> {shlex.quote(log)} 2>&1")
    line = f"{sched} {' && '.join(parts)} {MARKER} {repo}:{cfg}"
    if "\n" in line:
        raise CronError("the cron line may not contain a newline")
    return line.replace("%", "\\%")


def parse_marker(line: str) -> Optional[tuple[str, str]]:
    """(repo, config) of a rayspeed-retrain line, None for any other line."""
    m = _MARKER_RE.search(line.replace("\\%", "%"))
    if not m:
        return None
    return m.group("repo").strip(), m.group("config").strip()


# ---------------------------------------------------------------- the table


def _crontab(crontab_cmd: Optional[str]) -> list[str]:
    return shlex.split(crontab_cmd or os.environ.get("RAYSPEED_CRONTAB") or "crontab")


def read_table(crontab_cmd: Optional[str] = None) -> list[str]:
    """The current crontab's lines ([] when the user has none)."""
    try:
        p = subprocess.run(_crontab(crontab_cmd) + ["-l"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise CronError(f"no crontab program ({e.filename}); install cron, or add the line by hand") from None
    if p.returncode != 0:
        if "no crontab" in (p.stderr or "").lower():
            return []
        raise CronError(f"`crontab -l` failed (exit {p.returncode}): {(p.stderr or '').strip()[:300]}")
    return p.stdout.splitlines()


def write_table(lines: Sequence[str], crontab_cmd: Optional[str] = None) -> None:
    text = "\n".join(lines) + ("\n" if lines else "")
    p = subprocess.run(_crontab(crontab_cmd) + ["-"], input=text, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise CronError(f"`crontab -` failed (exit {p.returncode}): {(p.stderr or '').strip()[:300]}")


def _same(line: str, repo: str, config: Optional[str]) -> bool:
    found = parse_marker(line)
    if found is None:
        return False
    r, c = found
    return r == repo and (config is None or c == config)


def install(line: str, crontab_cmd: Optional[str] = None, dry_run: bool = False) -> str:
    """Put `line` into the crontab, replacing any line for the same repo + config (idempotent: the table is
    not rewritten when it already holds exactly this line). Returns "installed", "updated" or "unchanged"."""
    found = parse_marker(line)
    if found is None:
        raise CronError("not a rayspeed-retrain line (no marker)")
    repo, config = found
    table = read_table(crontab_cmd)
    others = [x for x in table if not _same(x, repo, config)]
    mine = [x for x in table if _same(x, repo, config)]
    if mine == [line]:
        return "unchanged"
    new = others + [line]
    if not dry_run:
        write_table(new, crontab_cmd)
    return "updated" if mine else "installed"


def remove(repo_dir: str, config: Optional[str] = None, crontab_cmd: Optional[str] = None,
           dry_run: bool = False) -> list[str]:
    """Remove the rayspeed-retrain lines of repo_dir (only those of `config` when given). Returns them."""
    repo = _norm_repo(repo_dir)
    cfg = _norm_config(config, repo) if config else None
    table = read_table(crontab_cmd)
    gone = [x for x in table if _same(x, repo, cfg)]
    if gone and not dry_run:
        write_table([x for x in table if not _same(x, repo, cfg)], crontab_cmd)
        for x in gone:
            found = parse_marker(x)
            if found:
                env_file_for(*found).unlink(missing_ok=True)
    return gone


# ---------------------------------------------------------------- CLI


def schedule_command(args: argparse.Namespace) -> int:
    """`rayspeed schedule install|remove|show` (what `make schedule` / `make unschedule` run)."""
    try:
        if args.action == "install":
            repo = _norm_repo(args.repo)
            if not (Path(repo) / Path(args.config).expanduser()).is_file():
                raise CronError(f"CONFIG {args.config!r}: no such job file in {repo}")
            envs = line_env()
            line = cron_line(args.cron, args.config, repo, args.log or str(Path(repo) / "runs" / "retrain.log"),
                             args.args, env=envs)
            if args.dry_run:
                print(line)
                return 0
            secrets = secret_env(envs)
            env_file = env_file_for(repo, _norm_config(args.config, repo))
            if secrets:
                write_env_file(env_file, secrets)
            what = install(line, args.crontab_cmd)
            if not secrets and env_file.exists():  # credentials no longer needed by this line
                env_file.unlink()
            print(line)
            print(f"cron line {what}" + (f"; credentials ({', '.join(sorted(secrets))}) in {env_file} (mode 0600)"
                                         if secrets else ""), file=sys.stderr)
            return 0
        if args.action == "remove":
            gone = remove(args.repo, args.config, args.crontab_cmd, dry_run=args.dry_run)
            for x in gone:
                print(x)
            verb = "would remove" if args.dry_run else "removed"
            print(f"{verb} {len(gone)} rayspeed-retrain line(s)" if gone else "no rayspeed-retrain line to remove",
                  file=sys.stderr)
            return 0
        repo = _norm_repo(args.repo) if args.repo else None
        for x in read_table(args.crontab_cmd):
            found = parse_marker(x)
            if found and (repo is None or found[0] == repo):
                print(x)
        return 0
    except CronError as e:
        print(f"schedule: {e}", file=sys.stderr)
        return 2

