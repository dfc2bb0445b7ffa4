"""One retraining cycle: lock, data check, warm-started training job, evaluation, registration, promotion.

    result = run_cycle("configs/tiny-cpu.yaml", ["train.max_steps=20"], margin=0.01)
    result.exit_code   # 0 promoted, 3 skipped, 4 rejected, 1 failed, 2 bad input

What a cycle does, in order:
  1. Loads the job (with the --set overrides); a wrong job is exit 2 before anything is written.
  2. Takes the lock <storage>/.retrain/<name>.lock that every host sharing the storage sees (retrain/lock.py:
     flock on a filesystem, a conditional PUT on S3; other object stores are refused, exit 2): a cycle that finds
     it held is "skipped: locked" (exit 3). A dead holder's lock is released (flock) or expires (S3).
  3. Builds (or reuses) the job's token file (the cache the workers then read) for its content hash.
  4. Finds the champion (alias `champion` of the registered model: tracking.register_model or
     rayspeed-<name>). Without one the cycle always trains (from model.pretrained's weights when the job has them,
     else from scratch). With one, unchanged data -- the hash of the last cycle that trained
     (<storage>/.retrain/<name>.json, for this MLflow store and model; else the champion's tag
     rayspeed.data_hash) -- is "skipped" (exit 3) unless forced; otherwise the job
     warm-starts from that exact version (train.init_from = models:/<name>/<version>, downloaded once into
     <storage>/.cache/models and checked against the job's model section first: a different architecture is
     exit 2, or pass --cold to train without the champion's weights).
  5. Runs the training job as a subprocess (`python -m rayspeed train`, i.e. jobs/train.py) under its own
     name <name>-cycle-<UTC timestamp>, so each cycle is its own MLflow run, registering a new version of the
     SAME registered model; RAY_ADDRESS (or an embedded local Ray, or --launcher local) decides where.
  6. Reads the job's summary.json (val_loss, MLflow run) and the version it registered; tags the version with
     the data hash and the warm-start source.
  7. Compares with the champion's val/loss: promotes (moves `champion`) only when
     new < champion * (1 - margin); otherwise tags the version rejected=<reason> (exit 4). Like with like: when
     the data changed since the champion was trained, its recorded val/loss was measured on another held-out
     split, so both the champion and the new version are re-evaluated the same way (fp32 on the CPU, on the
     current split, when that is cheap enough: `reeval_max_gflop`); otherwise both recorded values are used and
     the tags say so. Just before moving the alias the lock is checked and the champion re-read: if it moved
     meanwhile (another host, a person), the version is not promoted (exit 4, reason given).
  8. Records the cycle in <storage>/.retrain/<name>.json and prunes old cycle folders (keep_cycles).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from rayspeed.redact import redact_text
from rayspeed.retrain import champion, history
from rayspeed.tracking.client import access_problem, mlflow_client

log = logging.getLogger("rayspeed.retrain")

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_SKIPPED = 3
EXIT_REJECTED = 4

OUTCOME_CODES = {"promoted": EXIT_DONE, "failed": EXIT_FAILED, "bad_input": EXIT_BAD_INPUT,
                 "skipped": EXIT_SKIPPED, "rejected": EXIT_REJECTED}

CHAMPION = champion.CHAMPION
TAG_DATA_HASH = "rayspeed.data_hash"
TAG_DECISION = "rayspeed.retrain.decision"
TAG_WARM_START = "rayspeed.retrain.warm_start_from"
TAG_JOB = "rayspeed.retrain.cycle_job"
TAG_BASELINE = "rayspeed.retrain.baseline"


@dataclasses.dataclass
class CycleResult:
    outcome: str  # promoted | skipped | rejected | failed | bad_input
    reason: str
    job: Optional[str] = None
    registered_model: Optional[str] = None
    version: Optional[str] = None
    champion_before: Optional[str] = None
    champion_after: Optional[str] = None
    val_loss: Optional[float] = None
    champion_val_loss: Optional[float] = None
    baseline: Optional[str] = None
    data_hash: Optional[str] = None
    warm_start_from: Optional[str] = None
    mlflow_run_id: Optional[str] = None
    seconds: Optional[float] = None

    @property
    def exit_code(self) -> int:
        return OUTCOME_CODES[self.outcome]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exit_code"] = self.exit_code
        d["retrain"] = d.pop("outcome")
        return {"retrain": d["retrain"], **{k: v for k, v in d.items() if k != "retrain"}}


class _Stop(Exception):
    def __init__(self, outcome: str, reason: str):
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason


# ---------------------------------------------------------------- decision


def decide(new_val: Optional[float], champion_val: Optional[float], margin: float,
           has_champion: bool = True) -> tuple[bool, str]:
    """(promote?, why). Promote when new < champion * (1 - margin); no champion (or one without a finite
    val/loss) promotes; a missing or non-finite new val/loss never does."""
    if new_val is None or not math.isfinite(new_val):
        return False, f"val/loss {new_val} is not a finite number"
    if not has_champion:
        return True, f"first version (no champion yet), val/loss {new_val:.6g}"
    if champion_val is None or not math.isfinite(champion_val):
        return True, f"the champion has no finite val/loss ({champion_val}) to beat; val/loss {new_val:.6g}"
    need = champion_val * (1.0 - margin)
    if new_val < need:
        return True, (f"val/loss {new_val:.6g} < champion {champion_val:.6g}"
                      + (f" * (1 - {margin:g}) = {need:.6g}" if margin else ""))
    return False, (f"val/loss {new_val:.6g} does not improve on champion {champion_val:.6g}"
                   + (f" by the margin {margin:g} (needs < {need:.6g})" if margin else ""))


# ---------------------------------------------------------------- the cycle


def _quote(value: str) -> str:
    return json.dumps(value)  # a YAML double-quoted scalar: --set values stay strings


def _job_name(base: str, storage: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"{base}-cycle-{stamp}"
    if "://" not in storage:
        i = 2
        while (Path(storage) / name).exists():
            name = f"{base}-cycle-{stamp}-{i}"
            i += 1
    return name


def prune_cycles(storage: str, base: str, keep: int, current: Optional[str] = None) -> list[str]:
    """Delete all but the newest `keep` cycle folders <storage>/<base>-cycle-* (checkpoints of finished cycles;
    their models live in MLflow). keep <= 0 keeps everything."""
    if keep <= 0 or "://" in storage or not Path(storage).is_dir():
        return []
    dirs = sorted(p for p in Path(storage).glob(f"{base}-cycle-*") if p.is_dir())
    gone = []
    for p in dirs[:-keep]:
        if p.name == current:
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name)
    return gone


def run_cycle(config: str, overrides: Sequence[str] = (), *, force: bool = False, margin: float = 0.0,
              launcher: str = "ray", cold: bool = False, keep_cycles: int = 3, reeval_max_gflop: float = 2000.0,
              job_cmd: Optional[Sequence[str]] = None, env: Optional[dict[str, str]] = None,
              gates: Sequence[str] = ()) -> CycleResult:
    """One cycle (see the module doc). Never raises for expected failures: the result carries the outcome.

    job_cmd: the training command the job arguments are appended to (default: this Python, -m rayspeed train).
    gates: --gate values (rayspeed.retrain.gates): promotion on benchmark scores instead of val/loss.
    """
    t0 = time.time()
    try:
        return _cycle(config, list(overrides), force, margin, launcher, cold, keep_cycles, reeval_max_gflop,
                      job_cmd, env, t0, list(gates))
    except _Stop as s:
        return CycleResult(s.outcome, redact_text(s.reason), seconds=round(time.time() - t0, 1))
    except Exception as e:  # anything unexpected: a failed cycle with the reason, never a traceback to cron
        log.exception("retrain cycle failed")
        return CycleResult("failed", redact_text(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"),
                           seconds=round(time.time() - t0, 1))


def _cycle(config: str, overrides: list[str], force: bool, margin: float, launcher: str, cold: bool,
           keep_cycles: int, reeval_max_gflop: float, job_cmd: Optional[Sequence[str]],
           env: Optional[dict[str, str]], t0: float, gate_specs: list[str]) -> CycleResult:
    from rayspeed.config.load import load
    from rayspeed.config.schema import AUTO
    from rayspeed.errors import ConfigError
    from rayspeed.paths import storage_path, tracking_uri
    from rayspeed.retrain.lock import Locked, LockUnsupported, cycle_lock
    from rayspeed.tracking.runs import registered_model_name

    if not 0.0 <= margin < 1.0:
        raise _Stop("bad_input", f"--margin: must be in [0, 1) (a relative improvement), got {margin}")
    if launcher not in ("ray", "local"):
        raise _Stop("bad_input", f"--launcher: ray or local, got {launcher!r}")
    try:
        cfg = load(config, overrides)
    except ConfigError as e:
        raise _Stop("bad_input", e.render()) from None
    from rayspeed.retrain.gates import check_metrics, parse_gates

    try:
        gates = parse_gates(gate_specs, cfg)
        check_metrics(gates, cfg)
    except ValueError as e:
        raise _Stop("bad_input", str(e)) from None
    if cfg.train.objective == "dpo":
        # Promotion re-evaluates both versions' val/loss the same way; a DPO loss is relative to each version's own
        # reference, so two versions' are not comparable: benchmark gates (eval.harness) are the measure to use.
        raise _Stop("bad_input", "train.objective: dpo: retraining promotes on a re-evaluated next-token val/loss, "
                                 "which a DPO job does not train on; retrain its SFT job, or run the DPO job on its "
                                 "own (python jobs/train.py) and promote by hand")
    if cfg.train.objective == "grpo":  # its val/loss is minus a reward of greedy samples, not a re-evaluated loss
        raise _Stop("bad_input", "train.objective: grpo: retraining promotes on a re-evaluated next-token val/loss; "
                                 "a gate on val/reward is not built yet: run the GRPO job on its own (python "
                                 "jobs/train.py) and promote by hand")
    base, reg, uri, storage = cfg.name, registered_model_name(cfg), tracking_uri(cfg), storage_path(cfg)
    refused = access_problem(uri, "tracking.uri" if cfg.tracking.uri != AUTO else "MLFLOW_TRACKING_URI")
    if refused:
        raise _Stop("bad_input", refused)
    sdir = history.state_dir(storage)
    state_file = sdir / f"{base}.json"
    try:
        lock = cycle_lock(storage, base, sdir)
        lock.acquire()
    except LockUnsupported as e:
        raise _Stop("bad_input", str(e)) from None
    except Locked as e:
        raise _Stop("skipped", f"locked: {e}") from None
    except Exception as e:
        raise _Stop("failed", f"cannot take the cycle lock for {storage} ({type(e).__name__}: {e})") from None
    result = CycleResult("failed", "", registered_model=reg)
    trained = False
    try:
        trained = _locked_cycle(cfg, config, overrides, force, margin, launcher, cold, reeval_max_gflop, job_cmd,
                                env, base, reg, uri, storage, state_file, result, lock, gates)
    except _Stop as s:
        result.outcome, result.reason = s.outcome, s.reason
    except Exception as e:  # anything unexpected: a failed cycle, with the reason, never a traceback to cron
        log.exception("retrain cycle failed")
        result.outcome, result.reason = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        result.reason = redact_text(result.reason)
        result.seconds = round(time.time() - t0, 1)
        if result.outcome != "skipped" or not result.reason.startswith("locked"):
            history.record(state_file, result, t0, trained, uri)
        if result.job and result.outcome in ("promoted", "rejected"):
            for name in prune_cycles(storage, base, keep_cycles, current=result.job):
                log.info("pruned old cycle folder %s", name)
        lock.release()
    return result


def _locked_cycle(cfg: Any, config: str, overrides: list[str], force: bool, margin: float, launcher: str,
                  cold: bool, reeval_max_gflop: float, job_cmd: Optional[Sequence[str]],
                  env: Optional[dict[str, str]], base: str, reg: str, uri: str, storage: str, state_file: Path,
                  result: CycleResult, lock: Any, gates: list[Any]) -> bool:
    """Steps 3-7 under the lock; fills `result`. True when a training job ran to a decision."""
    from rayspeed.errors import ConfigError

    # 3. data
    try:
        tf = champion.token_file(cfg, storage)
    except ConfigError as e:
        raise _Stop("bad_input", e.render()) from None
    data_hash = result.data_hash = tf.content_hash
    log.info("data: %s", tf)

    # 4. the champion, and whether the data changed since the last cycle that trained (no champion: always train)
    try:
        champ = champion.champion_version(uri, reg)
    except Exception as e:
        raise _Stop("failed", f"MLflow at {uri} cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    champ_tags = dict(getattr(champ, "tags", None) or {}) if champ is not None else {}
    result.champion_before = result.champion_after = str(champ.version) if champ is not None else None
    if champ is not None and not force:
        state = history.read_state(state_file)
        last = state.get("last_cycle") or {}
        if (state.get("last_data_hash") and state.get("tracking_uri") == history.uri_key(uri)
                and state.get("registered_model") == reg):
            last_hash = state["last_data_hash"]
            where = (f"the last cycle ({last.get('job')} -> version {last.get('version')} {last.get('retrain')})"
                     if last else "the last cycle")
        else:  # no state here (new storage folder): the champion's own record
            last_hash, where = champ_tags.get(TAG_DATA_HASH), f"the champion (version {champ.version}) was trained"
        if last_hash == data_hash:
            raise _Stop("skipped", f"data unchanged since {where} (sha256 {data_hash[:12]}); "
                                   "pass --force to retrain anyway")

    init_spec = cfg.train.init_from
    model_dir = None
    if init_spec:
        log.info("train.init_from is set in the job (%s): warm start from it, not from the champion", init_spec)
    elif champ is not None and not cold:
        init_spec = f"models:/{reg}/{champ.version}"
    if init_spec:
        from rayspeed.model.warm_start import WarmStartError, check_compatible
        from rayspeed.tracking.model_fetch import resolve_init_from

        cache = str(Path(storage) / ".cache" / "models") if "://" not in storage else None
        try:
            model_dir = resolve_init_from(init_spec, uri, cache)  # the workers reuse this download
            check_compatible(model_dir, cfg.model, init_spec)
        except WarmStartError as e:
            hint = "" if cfg.train.init_from else "; or pass --cold to train without the champion's weights"
            raise _Stop("bad_input", f"{e}{hint}") from None
    result.warm_start_from = init_spec
    init_arg = init_spec
    if init_spec and not cfg.train.init_from and model_dir:
        init_arg = champion.adapter_warm_start(cfg, model_dir, cache is not None) or init_spec

    # 5. the training job
    job = result.job = _job_name(base, storage)
    # The store goes to the job in its environment, not on its command line (which `ps` shows to everyone).
    sets = list(overrides) + [f"name={job}", f"tracking.register_model={_quote(reg)}", "tracking.uri=auto"]
    if init_spec and not cfg.train.init_from:
        sets.append(f"train.init_from={_quote(init_arg)}")
    cmd = list(job_cmd or [sys.executable, "-m", "rayspeed", "train"]) + ["--config", config]
    for s in sets:
        cmd += ["--set", s]
    cmd += ["--launcher", launcher]
    log.info("cycle %s: %s", job, _start(cfg, init_spec))
    sys.stdout.flush()
    sys.stderr.flush()
    rc = subprocess.call(cmd, env={**os.environ, "MLFLOW_TRACKING_URI": uri, **(env or {})})
    from rayspeed.storage import locate

    exp = locate(storage).child(job)
    summary = exp.read_json("summary.json")
    result.mlflow_run_id = summary.get("mlflow_run_id")
    if rc == EXIT_BAD_INPUT:
        raise _Stop("bad_input", "the training job rejected its input (exit 2; see its message above)")
    if rc != 0 or summary.get("status") != "finished":
        why = summary.get("error") or summary.get("status") or f"exit {rc}"
        raise _Stop("failed", f"training job {job} failed: {str(why).splitlines()[0][:500]}")
    trained_val = summary.get("val_loss")

    # 6. the registered version
    version = summary.get("registered_model_version")
    if version is None and result.mlflow_run_id:
        version = champion.version_of_run(uri, reg, result.mlflow_run_id)
    if version is None:
        raise _Stop("failed", f"training job {job} finished but registered no version of {reg} (see its log)")
    version = result.version = str(version)
    c = mlflow_client(uri)
    mv = c.get_model_version(reg, version)
    new_val = champion.metric_of(dict(mv.tags or {}))
    if new_val is None and trained_val is not None:
        new_val = float(trained_val)
    result.val_loss = new_val
    tags = {TAG_DATA_HASH: data_hash, TAG_JOB: job, TAG_WARM_START: init_spec or _first_weights(cfg)}

    # 7. compare like with like, re-check the champion, decide
    champ_val, baseline = None, None
    if champ is not None:
        champ_val = champion.metric_of(champ_tags)
        baseline = f"version {champ.version}: recorded val/loss"
        if champ_tags.get(TAG_DATA_HASH) != data_hash:  # recorded on other data: both measured again, the same way
            values, how = champion.reevaluate(uri, reg, [str(champ.version), version], cfg, tf, storage,
                                              reeval_max_gflop)
            if values is not None:
                log.info("re-evaluated on the current held-out split (%s): champion %s %.6g (recorded %s), "
                         "version %s %.6g (recorded %s)", how, champ.version, values[0], champ_val, version,
                         values[1], new_val)
                baseline = (f"versions {champ.version} and {version}: both re-evaluated on the current held-out split "
                            f"({how}; recorded {champ_val} and {new_val})")
                champ_val, new_val = values
            else:
                log.warning("comparing recorded val/loss values (on different data): %s", how)
                baseline = f"version {champ.version}: recorded val/loss (on other data; {how})"
    result.val_loss, result.champion_val_loss, result.baseline = new_val, champ_val, baseline
    if gates and champ is not None:  # the benchmark gates decide (rayspeed.retrain.gates)
        promote, why = _gated(gates, cfg, uri, reg, str(champ.version), version, tags)
    else:
        promote, why = decide(new_val, champ_val, margin, has_champion=champ is not None)
    if baseline:
        tags[TAG_BASELINE] = f"{baseline} = {champ_val}"
    if promote:
        moved = _still_champion(uri, reg, result.champion_before, lock)
        if moved:
            promote, why = False, f"{why}, but {moved}"
    if promote:
        c.set_registered_model_alias(reg, CHAMPION, version)
        result.champion_after = version
        tags.update({TAG_DECISION: "promoted", "promoted": why})
        result.outcome, result.reason = "promoted", f"version {version} is the champion: {why}"
    else:
        tags.update({TAG_DECISION: "rejected", "rejected": why})
        result.outcome, result.reason = "rejected", f"version {version} not promoted: {why}"
    for k, v in tags.items():
        c.set_model_version_tag(reg, version, k, str(v)[:5000])
    if result.mlflow_run_id:
        try:
            c.set_tag(result.mlflow_run_id, TAG_DECISION, tags[TAG_DECISION])
        except Exception as e:
            log.warning("could not tag run %s: %s", result.mlflow_run_id, e)
    return True


def _first_weights(cfg: Any) -> str:
    """Where a cycle without train.init_from starts: model.pretrained's weights (model.init: pretrained) or none."""
    if cfg.model.pretrained and cfg.model.init == "pretrained":
        return f"model.pretrained {cfg.model.pretrained}"
    return "scratch"


def _start(cfg: Any, init_spec: Optional[str]) -> str:
    """Where this cycle's training starts from, in words (train.init_from replaces model.pretrained's weights, except
    for an adapter job, whose adapter continues on them)."""
    if init_spec:
        return f"warm start from {init_spec}"
    first = _first_weights(cfg)
    if first == "scratch":
        return "from scratch (random init)"
    return f"from the pretrained weights of {cfg.model.pretrained} (model.pretrained)"


def _gated(gates: list[Any], cfg: Any, uri: str, reg: str, champion_version: str, version: str,
           tags: dict[str, str]) -> tuple[bool, str]:
    from rayspeed.benchmarks.harness import metrics_of
    from rayspeed.retrain.gates import judge, score_versions

    try:
        old, new = score_versions(uri, reg, [champion_version, version], cfg)
    except Exception as e:  # an evaluation that fails decides nothing: the champion stays
        return False, f"the gates could not be measured ({type(e).__name__}: {str(e)[:300]})"
    for who, results in (("champion", old), ("challenger", new)):
        tags[f"rayspeed.retrain.gate_scores.{who}"] = json.dumps(metrics_of(results), sort_keys=True)
    return judge(gates, new, old, version, champion_version)


def _still_champion(uri: str, reg: str, before: Optional[str], lock: Any) -> Optional[str]:
    """Why the alias must not move now (None: it may): the lock is no longer ours, or the champion this cycle
    compared with is not the champion any more (MLflow has no compare-and-set for aliases: this re-read, under the
    lock every cycle takes, is the check)."""
    from rayspeed.retrain.lock import LockLost

    try:
        lock.check()
    except LockLost as e:
        return f"the cycle lock was lost ({e}); run the cycle again"
    now = champion.champion_version(uri, reg)
    now_v = str(now.version) if now is not None else None
    if now_v != before:
        return (f"the champion moved from version {before} to {now_v} while this cycle ran (another cycle or a "
                "person); it was compared with the old one, so it is left alone: run the cycle again")
    return None
