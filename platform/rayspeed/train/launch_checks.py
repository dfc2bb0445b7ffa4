"""What a launch checks before anything is written, in one list that the launch and `--dry-run` share: a dry run
that says 0 means the launch will not stop at one of these. Every check only reads (a tracking server, a bucket,
the registry, the data paths); all problems are reported at once.

    problems = launch_problems(job, cfg)     # [] or one line per problem, each naming its key and the fix
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from rayspeed.config.examples import prepare_hint
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.errors import ConfigError
from rayspeed.paths import storage_path, tracking_uri

log = logging.getLogger("rayspeed")

# Store URIs MLflow's client opens (a plain path is a file store).
TRACKING_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
                    "uc")


def plugin_schemes() -> set[str]:
    """Tracking-store schemes that installed MLflow plugins register (entry point group mlflow.tracking_store)."""
    from importlib.metadata import entry_points

    try:
        return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}
    except Exception:
        return set()


def tracking_uri_problem(job: JobConfig) -> str | None:
    uri = job.tracking.uri
    if uri == AUTO or "://" not in uri:
        return None
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in TRACKING_SCHEMES and scheme not in plugin_schemes():
        return (f"tracking.uri: {uri!r}: MLflow has no store for {scheme}://; use http(s)://host:port (a tracking "
                "server), sqlite:///abs/path/mlflow.db, or auto")
    return None


def tracking_access_problem(job: JobConfig, cfg: JobConfig) -> str | None:
    from rayspeed.tracking.client import access_problem

    # A server that refuses this job (401/403) is an input error; one that does not answer is bad luck.
    return access_problem(tracking_uri(cfg), "tracking.uri" if job.tracking.uri != AUTO else "MLFLOW_TRACKING_URI")


def storage_problem(cfg: JobConfig) -> str | None:
    from rayspeed.storage import check_reachable

    return check_reachable(storage_path(cfg))


def init_from_problem(cfg: JobConfig) -> str | list[str] | None:
    if not cfg.train.init_from:
        return None
    from rayspeed.config.adapter import init_adapter_dir, init_adapter_problems

    if init_adapter_dir(cfg):  # a PEFT adapter to continue: its settings against the job's
        from rayspeed.config.shape import ModelShape

        return init_adapter_problems(cfg, ModelShape.from_config(cfg.model))
    from rayspeed.tracking.model_fetch import init_from_problem as problem

    return problem(str(cfg.train.init_from), tracking_uri(cfg))


def data_problems(cfg: JobConfig) -> list[str]:
    """The data inputs exist: every data.path glob matches, the tokenizer is there, data.cache_dir is usable."""
    from rayspeed.data.records import DataSpec, expand
    from rayspeed.storage import local_write_problem

    d, out = cfg.data, []
    if d.source in ("files", "tokens"):
        for pattern in DataSpec.paths(d.path):
            try:
                expand((pattern,))
            except ConfigError as e:
                out += e.problems
    t = d.tokenizer
    if t not in ("bytes", "byte", "model") and not os.path.exists(os.path.expanduser(t)):
        out.append(f"data.tokenizer: {t!r} is neither 'bytes', 'model' nor an existing tokenizer.json or tokenizer "
                   f"directory{prepare_hint(t)}")
    if d.cache_dir != AUTO:
        if "://" in d.cache_dir or not os.path.isabs(os.path.expanduser(d.cache_dir)):
            out.append(f"data.cache_dir: must be an absolute local path (a memory-mapped cache), got {d.cache_dir!r}")
        else:
            bad = local_write_problem(os.path.expanduser(d.cache_dir), "data.cache_dir")
            if bad:
                out.append(bad)
    return out


def local_gpus() -> int:
    """GPUs this machine's CUDA sees (what the embedded Ray cluster would offer)."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def gpu_problem(cfg: JobConfig, launcher: str) -> str | None:
    """cluster.use_gpu on a machine without one, when the job would run here (--launcher local, or the Ray cluster
    started for the job). A cluster joined by address is checked when joined (its workers' nodes may have GPUs
    that this driver's does not: a CPU driver with GPU workers is normal)."""
    if not cfg.cluster.use_gpu:
        return None
    joined = cfg.cluster.address != AUTO or bool(os.environ.get("RAY_ADDRESS"))
    if launcher == "ray" and joined:
        return None
    if local_gpus() == 0:
        where = "this machine" if launcher == "local" else "the Ray cluster started here for the job (no RAY_ADDRESS)"
        return (f"cluster.use_gpu: true, but {where} has no GPU that CUDA sees; set cluster.use_gpu: false to train "
                "on CPU, or submit to a cluster with GPUs (RAY_ADDRESS / cluster.address)")
    return None


def callback_problems(cfg: JobConfig) -> list[str]:
    """Each train.callbacks entry imports and builds here, as it will on every worker."""
    from rayspeed.train.events import load_callback

    out = []
    for name in cfg.train.callbacks:
        try:
            load_callback(name)
        except Exception as e:
            out.append(f"train.callbacks: {name!r} cannot be built here ({type(e).__name__}: {e}); it must be "
                       "importable where the job starts and on every worker (the job's working dir or an installed "
                       "package) and build with no arguments")
    return out


def reward_problems(cfg: JobConfig) -> list[str]:
    """Each train.grpo.rewards entry imports here, as it will on every worker."""
    from rayspeed.objectives.rewards import load_reward

    out = []
    for name in cfg.train.grpo.rewards if cfg.train.objective == "grpo" else []:
        try:
            load_reward(name)
        except Exception as e:
            out.append(f"train.grpo.rewards: {name!r} cannot be imported here ({type(e).__name__}: {e}); it must be "
                       "importable where the job starts and on every worker (a module beside the job file, shipped "
                       "by ray job submit --working-dir ., or an installed package)")
    return out


def qlora_problems(cfg: JobConfig) -> list[str]:
    """A QLoRA job (model.adapter.base_precision nf4) needs bitsandbytes on the workers (the driver's environment
    here) and real base weights: its merged export folds the adapter into them, re-read from where they came from.
    (`rayspeed plan` of a shape-only job with nf4 answers; a launch stops here.)"""
    import importlib.util

    a, m = cfg.model.adapter, cfg.model
    if a.type == "none" or a.base_precision != "nf4":
        return []
    p = []
    if importlib.util.find_spec("bitsandbytes") is None:
        p.append("model.adapter.base_precision: nf4 needs bitsandbytes, which is not installed; "
                 "pip install 'bitsandbytes>=0.50' (or set base_precision: auto)")
    if not cfg.train.init_from and not (m.pretrained and m.init == "pretrained"):
        p.append("model.adapter.base_precision: nf4 quantizes pretrained base weights; set model.pretrained (with "
                 "model.init: pretrained) or train.init_from, or use base_precision: auto")
    return p


def harness_problems(cfg: JobConfig) -> list[str]:
    """eval.harness needs lm-eval where the evaluations run (the driver's environment here) and tasks it knows:
    task YAML files, names under include_path, or lm-eval's own tasks."""
    import dataclasses
    import importlib.util

    h = cfg.eval.harness
    if not h.tasks:
        return []
    if importlib.util.find_spec("lm_eval") is None:
        return ["eval.harness: lm-evaluation-harness is not installed; pip install 'lm-eval[hf]==0.4.13' (the "
                "rayspeed[eval] extra, which `make setup` installs), or drop eval.harness.tasks"]
    from rayspeed.benchmarks.harness import unknown_tasks

    unknown = unknown_tasks(dataclasses.asdict(h))
    if unknown:
        return [f"eval.harness.tasks: {unknown} are neither task YAML files, nor tasks under "
                f"eval.harness.include_path ({h.include_path}), nor lm-eval's own tasks; give the path of a task "
                "file or its folder as include_path"]
    return []


def launch_problems(job: JobConfig, cfg: JobConfig, launcher: str = "ray") -> list[str]:
    """Every problem a launch would stop at before the cluster starts (see the module doc). `job` is the job as
    written, `cfg` the resolved one (its layout from the plan)."""
    checks: list[Callable[[], str | list[str] | None]] = [
        lambda: gpu_problem(cfg, launcher),
        lambda: tracking_uri_problem(job),
        lambda: None if tracking_uri_problem(job) else tracking_access_problem(job, cfg),
        lambda: storage_problem(cfg),
        lambda: init_from_problem(cfg),
        lambda: data_problems(cfg),
        lambda: callback_problems(cfg),
        lambda: reward_problems(cfg),
        lambda: qlora_problems(cfg),
        lambda: harness_problems(cfg),
    ]
    problems: list[str] = []
    for check in checks:
        try:
            found = check()
        except ConfigError as e:
            found = e.problems
        if isinstance(found, str):
            problems.append(found)
        elif found:
            problems += list(found)
    return problems
