"""Hardware profiles: what `rayspeed calibrate` measured on a cluster, read by the planner (JSON only here: the
measuring is rayspeed.health.calibrate's business).

    {"kind": "rayspeed-hardware-profile", "version": 1,
     "device": "NVIDIA H100 80GB HBM3" | "cpu", "gpu": "<table name>", "nodes": 2, "ranks": 16,
     "ranks_per_node": 8, "backend": "nccl" | "gloo", "measured_at": "2026-11-30T12:00:00Z",
     "hardware": {<Hardware field>: value, ...},      fitted from the measurements below
     "gemm": [[m, k, n, flop_per_s], ...],             at the shapes the job's candidate layouts run
     "engine": {"<zero stage>": {host_fwd_layer_us, host_bwd_layer_us, host_fixed_mb_us, engine_step_s}, ...},
     "gloo": {"allreduce" | "all_gather" | "reduce_scatter": [latency_us, busbw_gbps]},   CPU workers
     "collectives": {...}, "p2p": {...}, "host": {...}, the raw measurements
     "efficiency": {"compute": 1, "comm": 1, "overhead": 1},   fitted from finished runs (plan --calibrate-from)
     "fit": {"experiment": ..., "runs": n, "loo_median_abs_error": 0.07, ...}}

Precedence: profile > the job's `cluster.hardware` > the built-in table.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from rayspeed.errors import ConfigError
from rayspeed.planner.hardware import Hardware

KIND = "rayspeed-hardware-profile"
VERSION = 1


@dataclass
class Profile:
    source: str
    data: dict = field(default_factory=dict)

    @property
    def hardware(self) -> dict:
        return dict(self.data.get("hardware") or {})

    @property
    def gpu(self) -> str | None:
        return self.data.get("gpu")

    def efficiency(self) -> tuple[float, float, float]:
        e = self.data.get("efficiency") or {}
        return (float(e.get("compute", 1.0)), float(e.get("comm", 1.0)), float(e.get("overhead", 1.0)))

    def held_out_error(self) -> float:
        fit = self.data.get("fit") or {}
        return float(fit.get("loo_median_abs_error") or 0.0)

    def apply(self, hw: Hardware) -> Hardware:
        known = {f.name: f.type for f in dataclasses.fields(Hardware)}
        upd: dict[str, Any] = {}
        for k, v in self.hardware.items():
            if k not in known or k in ("name", "is_gpu"):
                continue
            cur = getattr(hw, k)
            if isinstance(cur, bool):
                upd[k] = bool(v)
            elif isinstance(cur, int):
                upd[k] = int(v)
            elif isinstance(cur, float):
                upd[k] = float(v)
            elif isinstance(cur, (str, dict)):
                upd[k] = v
        return dataclasses.replace(hw, **upd)

    def ctx_fields(self) -> dict:
        table = tuple(tuple(float(x) for x in row[:4]) for row in self.data.get("gemm") or [] if len(row) >= 4)
        engine = []
        for z, e in sorted((self.data.get("engine") or {}).items()):
            try:
                engine.append((int(z), float(e["host_fwd_layer_us"]), float(e["host_bwd_layer_us"]),
                               float(e["host_fixed_mb_us"]), float(e["engine_step_s"])))
            except (KeyError, TypeError, ValueError):
                continue
        gloo = tuple((str(k), float(v[0]), float(v[1])) for k, v in (self.data.get("gloo") or {}).items()
                     if isinstance(v, (list, tuple)) and len(v) == 2 and float(v[1]) > 0)
        return {"gemm_table": table, "efficiency": self.efficiency(), "profile": self.source,
                "model_error": self.held_out_error(), "engine_by_zero": tuple(engine), "gloo_fit": gloo}

    def describe(self) -> str:
        d = self.data
        fit = d.get("fit") or {}
        text = (f"hardware profile {self.source}: {d.get('device', '?')}, {d.get('ranks', '?')} rank(s) on "
                f"{d.get('nodes', '?')} node(s), measured {d.get('measured_at', '?')}")
        if fit:
            text += (f"; efficiency fitted on {fit.get('runs')} run(s) of '{fit.get('experiment')}', held-out "
                     f"(leave-one-out) median error {100 * float(fit.get('loo_median_abs_error') or 0):.1f}%")
        else:
            text += "; efficiency factors not fitted (rayspeed plan --calibrate-from EXPERIMENT)"
        return text


def load(source: Any, key: str = "cluster.profile") -> Profile:
    """A profile from a path (or an already-parsed dict); ConfigError naming `key` when it cannot be used."""
    if isinstance(source, dict):
        data, where = source, "<dict>"
    else:
        where = os.path.expanduser(str(source))
        try:
            with open(where) as fh:
                data = json.load(fh)
        except OSError as e:
            raise ConfigError(f"{key}: cannot read {where} ({e.strerror}); write one with `rayspeed calibrate --out "
                              f"{where}`") from None
        except ValueError as e:
            raise ConfigError(f"{key}: {where} is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ConfigError(f"{key}: {where} is not a rayspeed hardware profile (no \"kind\": \"{KIND}\")")
    if int(data.get("version", 0)) > VERSION:
        raise ConfigError(f"{key}: {where} has profile version {data.get('version')}; this planner reads {VERSION}")
    return Profile(source=where, data=data)


def check_device(prof: Profile, gpu: str) -> None:
    """Refuse a profile measured on another kind of device than the one the job plans for."""
    if prof.gpu and prof.gpu != gpu:
        raise ConfigError(f"cluster.profile: {prof.source} was measured on {prof.gpu} ({prof.data.get('device')}) "
                          f"but the job plans for {gpu}; calibrate on this cluster or drop the profile")


def save(data: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=False)
        fh.write("\n")
    os.replace(tmp, path)
