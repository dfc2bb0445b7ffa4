"""The job's checks section by section (train, parallel, cluster, resilience, storage, chaos), each a pure function
of the config returning its problems; rayspeed.config.validate.check runs them in this order."""

from __future__ import annotations

import os
from typing import Any

from rayspeed.config.context_split import context_problems
from rayspeed.config.moe_keys import expert_problems
from rayspeed.config.schema import AUTO, JobConfig


def train_problems(cfg: JobConfig) -> list[str]:
    """train: batch, steps, learning rates, warm-up, evaluation."""
    p: list[str] = []
    t = cfg.train
    if t.global_batch_size < 1:
        p.append(f"train.global_batch_size: must be >= 1, got {t.global_batch_size}")
    if t.max_steps < 1:
        p.append(f"train.max_steps: must be >= 1, got {t.max_steps}")
    if not isinstance(t.lr, str) and t.lr <= 0:
        p.append(f"train.lr: must be > 0 (or auto), got {t.lr}")
    if not isinstance(t.min_lr, str) and t.min_lr < 0:
        p.append(f"train.min_lr: must be >= 0 (or auto), got {t.min_lr}")
    if not isinstance(t.lr, str) and not isinstance(t.min_lr, str) and t.min_lr > t.lr:
        p.append(f"train.min_lr ({t.min_lr}) must not exceed train.lr ({t.lr})")
    if t.warmup_steps < 0:
        p.append(f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    if t.eval_batches < 1:
        p.append(f"train.eval_batches: must be >= 1, got {t.eval_batches}")
    return p


def parallel_problems(cfg: JobConfig) -> list[str]:
    """parallel: degrees, ZeRO, tp against heads and vocabulary, the attention kernel, pipeline stages, context and
    expert parallelism, sequence parallelism."""
    m, par, c = cfg.model, cfg.parallel, cfg.cluster
    kv = m.num_kv_heads if m.num_kv_heads is not None else m.num_heads
    p = [f"parallel.{key}: must be >= 1 or auto, got {getattr(par, key)}"
         for key in ("dp", "tp", "pp", "micro_batch_size", "grad_accum")
         if isinstance(getattr(par, key), int) and getattr(par, key) < 1]
    if par.zero_stage != AUTO and par.zero_stage not in (0, 1, 2, 3):
        p.append(f"parallel.zero_stage: must be 0, 1, 2, 3 or auto, got {par.zero_stage}")
    p += tensor_parallel_problems(cfg, kv)
    if (kernel := getattr(m, "attention_kernel", "auto")) not in ("auto", "sdpa", "flex"):
        p.append(f"model.attention_kernel: must be auto, sdpa or flex, got {kernel!r}")
    elif kernel == "flex" and not c.use_gpu:
        p.append("model.attention_kernel: flex trains on CUDA only (torch 2.13 has no FlexAttention backward on "
                 "CPU); use auto, or cluster.use_gpu: true")
    p += pipeline_problems(cfg)
    p += context_problems(m, par, kv, None if c.elastic else c.max_workers) + expert_problems(cfg)
    if par.sequence_parallel is True and par.tp == 1:
        p.append("parallel.sequence_parallel: true needs parallel.tp > 1 (or leave it auto)")
    if par.sequence_parallel is True and isinstance(par.tp, int) and sequence_parallel_problem(m.seq_len, par.tp):
        p.append(f"parallel.sequence_parallel: true splits each sequence over tp ranks, but model.seq_len "
                 f"({m.seq_len}) does not divide by parallel.tp ({par.tp}); leave it auto (off for this tp) or "
                 f"use a seq_len that is a multiple of {par.tp}")
    return p


def tensor_parallel_problems(cfg: JobConfig, kv: int) -> list[str]:
    """parallel.tp against the heads, the vocabulary and a node's GPUs."""
    m, par, c = cfg.model, cfg.parallel, cfg.cluster
    if not (isinstance(par.tp, int) and par.tp >= 1):
        return []
    p: list[str] = []
    if m.num_heads % par.tp or kv % par.tp:
        p.append(f"parallel.tp ({par.tp}) must divide model.num_heads ({m.num_heads}) and model.num_kv_heads ({kv})")
    if m.vocab_size % par.tp:
        p.append(f"parallel.tp ({par.tp}) must divide model.vocab_size ({m.vocab_size}) (vocab-parallel embedding)")
    if c.use_gpu and par.tp > c.gpus_per_node:
        p.append(f"parallel.tp ({par.tp}) must not exceed cluster.gpus_per_node ({c.gpus_per_node}): tp never "
                 "spans nodes")
    return p


def pipeline_problems(cfg: JobConfig) -> list[str]:
    """parallel.pp against the layers and ZeRO, and parallel.stage_layers."""
    m, par = cfg.model, cfg.parallel
    p: list[str] = []
    if isinstance(par.pp, int) and par.pp >= 1 and par.pp > m.num_layers:
        p.append(f"parallel.pp ({par.pp}) must not exceed model.num_layers ({m.num_layers})")
    if par.pp not in (AUTO, 1) and par.zero_stage not in (AUTO, 0, 1):
        p.append(
            f"parallel.zero_stage ({par.zero_stage}) with parallel.pp ({par.pp}): DeepSpeed's pipeline engine "
            "supports ZeRO 0 or 1 only; set parallel.zero_stage to 0, 1 or auto"
        )
    split = getattr(par, "stage_layers", None)
    if split is None:
        return p
    if not split or any(n < 1 for n in split) or sum(split) != m.num_layers:
        p.append(f"parallel.stage_layers ({split}): blocks per stage, each >= 1, adding up to model.num_layers "
                 f"({m.num_layers})")
    elif par.pp != AUTO and len(split) != par.pp:
        p.append(f"parallel.stage_layers gives {len(split)} stages but parallel.pp is {par.pp}; set pp to "
                 f"{len(split)} or auto")
    return p


def cluster_problems(cfg: JobConfig) -> list[str]:
    """cluster: workers, CPUs, GPUs per node, nodes."""
    p: list[str] = []
    c = cfg.cluster
    if isinstance(c.num_workers, list):
        if len(c.num_workers) != 2 or c.num_workers[0] < 1 or c.num_workers[0] > c.num_workers[1]:
            p.append(f"cluster.num_workers: expected an int or [min, max] with 1 <= min <= max, got {c.num_workers}")
    elif c.num_workers < 1:
        p.append(f"cluster.num_workers: must be >= 1, got {c.num_workers}")
    if c.cpus_per_worker <= 0:
        p.append(f"cluster.cpus_per_worker: must be > 0, got {c.cpus_per_worker}")
    if c.gpus_per_node < 1 or c.num_nodes < 1:
        p.append("cluster.gpus_per_node and cluster.num_nodes: must be >= 1")
    if isinstance(c.local_num_cpus, int) and c.local_num_cpus < 1:
        p.append(f"cluster.local_num_cpus: must be >= 1 or auto, got {c.local_num_cpus}")
    return p


def resilience_problems(cfg: JobConfig) -> list[str]:
    """resilience and tracking cadences and limits."""
    p: list[str] = []
    r = cfg.resilience
    if r.keep_checkpoints < 2:
        p.append(f"resilience.keep_checkpoints: never fewer than 2 (got {r.keep_checkpoints}): a newer checkpoint "
                 "must verify before an older one goes")
    if r.max_failures < 0:
        p.append(f"resilience.max_failures: must be >= 0, got {r.max_failures}")
    if r.oom_replans < 0:
        p.append(f"resilience.oom_replans: must be >= 0 (0: an out-of-memory error fails the job), got "
                 f"{r.oom_replans}")
    if r.checkpoint_every_steps < 0:
        p.append(f"resilience.checkpoint_every_steps: must be >= 0, got {r.checkpoint_every_steps}")
    if not 0.0 <= r.stability_threshold <= 1.0:
        p.append(f"resilience.stability_threshold: must be in [0, 1] (a fraction of cluster.num_workers' max), "
                 f"got {r.stability_threshold}")
    if r.capacity_wait_s <= 0:
        p.append(f"resilience.capacity_wait_s: must be > 0, got {r.capacity_wait_s}")
    if r.conversion_timeout_s <= 0:
        p.append(f"resilience.conversion_timeout_s: must be > 0, got {r.conversion_timeout_s}")
    if r.collective_timeout_s <= 0:
        p.append(f"resilience.collective_timeout_s: must be > 0, got {r.collective_timeout_s}")
    if cfg.tracking.log_every_steps < 1:
        p.append(f"tracking.log_every_steps: must be >= 1, got {cfg.tracking.log_every_steps}")
    return p


def storage_problems(cfg: JobConfig) -> list[str]:
    """storage: an absolute local path or a scheme a filesystem handles, a node-local staging folder."""
    p: list[str] = []
    local = cfg.storage.path != AUTO and "://" not in cfg.storage.path
    if local and not os.path.isabs(os.path.expanduser(cfg.storage.path)):
        p.append(f"storage.path: must be absolute (all nodes must see it), got {cfg.storage.path!r}")
    if cfg.storage.path != AUTO and "://" in cfg.storage.path and not cfg.storage.path.startswith("file://"):
        scheme = cfg.storage.path.split("://", 1)[0]
        if not known_scheme(scheme):
            p.append(f"storage.path: {cfg.storage.path!r} has a scheme ({scheme}://) no filesystem handles; use an "
                     "absolute local path or an object-store URI such as s3://bucket/prefix or gs://bucket/prefix")
    if cfg.storage.staging_dir != AUTO and not os.path.isabs(os.path.expanduser(cfg.storage.staging_dir)):
        p.append(f"storage.staging_dir: must be an absolute node-local path, got {cfg.storage.staging_dir!r}")
    return p


def chaos_problems(cfg: JobConfig) -> list[str]:
    """chaos drills: ranks that exist, steps from 1, one drill per step."""
    p: list[str] = []
    c = cfg.cluster
    for key in ("kill_rank_at_step", "kill_rank_in_checkpoint", "hang_rank_at_step", "nan_loss_at_step",
                "oom_at_step"):
        drills = chaos_drills(getattr(cfg.chaos, key))
        for k in drills:
            if k.rank < 0 or k.step < 1:
                p.append(f"chaos.{key}: rank must be >= 0 and step >= 1, got {{rank: {k.rank}, step: {k.step}}}")
            elif k.rank >= c.max_workers:
                p.append(f"chaos.{key}: rank {k.rank} does not exist with cluster.num_workers {c.num_workers}")
            if getattr(k, "point", None) is not None and key != "kill_rank_in_checkpoint":
                p.append(f"chaos.{key}.point: only chaos.kill_rank_in_checkpoint has a point (where in the save)")
        steps = [k.step for k in drills]
        if len(set(steps)) < len(steps):
            p.append(f"chaos.{key}: each drill of the list needs its own step, got steps {steps}")
    return p


def sequence_parallel_problem(seq_len: int, tp: int) -> str | None:
    """Sequence parallelism splits each sequence over the tp ranks: seq_len must divide by tp."""
    if tp > 1 and seq_len % tp:
        return f"seq_len={seq_len} must divide by tp={tp} with sequence_parallel"
    return None


def known_scheme(scheme: str) -> bool:
    """Whether pyarrow resolves URIs of this scheme (asked with a dummy URI; an unknown scheme fails at once,
    before any network access, while a known one may fail later for other reasons)."""
    if scheme in ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock", "file"):
        return True
    try:
        from pyarrow import fs as pafs

        pafs.FileSystem.from_uri(f"{scheme}://rayspeed-scheme-probe/x")
    except Exception as e:
        return "Unrecognized filesystem type" not in str(e)
    return True


def chaos_drills(spec: Any) -> list[Any]:
    """A chaos key's drills as a list (the key takes one drill or a list of them)."""
    if spec is None:
        return []
    return list(spec) if isinstance(spec, list) else [spec]
