"""`rayspeed plan --calibrate-from EXPERIMENT`: fit a hardware profile's efficiency factors to finished runs.

Each finished run of the experiment that logged `plan/measured_step_time_s` (every job does, rayspeed.planner.
feedback) is re-planned from its resolved config (the `config/resolved.yaml` artifact) with the base profile,
so every prediction uses the same hardware figures, and split into the time model's three groups:

    compute   forward, backward, recomputation, pipeline bubble, waiting for stragglers
    comm      tensor-parallel, pipeline and exposed data-parallel communication
    overhead  optimizer step and engine, ZeRO-3 bookkeeping

Three factors, one per group (physically: how far this cluster's kernels, network and host fall from the
measured microbenchmarks in steady training), are fitted by least squares on the relative error with a ridge
pull towards 1 (a group a run barely exercises stays at 1 instead of swinging), so a handful of runs is enough.
The fit is judged on runs it did not see: leave-one-out, each run predicted by the factors fitted on the others.
The runs are read from MLflow by rayspeed.health.calibfit_runs: the planner never imports MLflow.
"""

from __future__ import annotations

import statistics

from rayspeed.errors import ConfigError

# Pull of each factor towards 1 against the runs' squared relative errors: a Gaussian prior (MAP), ridge =
# (run-to-run noise / prior spread)^2 = (25% / 50%)^2: a step time repeats within ~25% on a shared machine (the
# tiny-cpu job measured 0.044-0.146 s across this work's runs), and a factor is believed within +-50% of 1.
RIDGE = 0.25
FACTOR_RANGE = (0.1, 10.0)


def solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a 3 x 3 system."""
    m = [row[:] + [bv] for row, bv in zip(a, b)]
    n = len(m)
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        if abs(m[i][i]) < 1e-300:
            raise ZeroDivisionError("singular")
        for r in range(i + 1, n):
            f = m[r][i] / m[i][i]
            for c in range(i, n + 1):
                m[r][c] -= f * m[i][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][c] * x[c] for c in range(i + 1, n))) / m[i][i]
    return x


def fit_factors(rows: list[tuple[tuple[float, float, float], float]],
                ridge: float = RIDGE) -> tuple[float, float, float]:
    """Factors (compute, comm, overhead) minimising sum(((f . groups) / measured - 1)^2) + ridge |f - 1|^2."""
    ata = [[ridge if i == j else 0.0 for j in range(3)] for i in range(3)]
    atb = [ridge] * 3
    for groups, measured in rows:
        x = [g / measured for g in groups]
        for i in range(3):
            atb[i] += x[i]
            for j in range(3):
                ata[i][j] += x[i] * x[j]
    f = solve3(ata, atb)
    lo, hi = FACTOR_RANGE
    return tuple(min(hi, max(lo, v)) for v in f)  # type: ignore[return-value]


def predict(groups: tuple[float, float, float], factors: tuple[float, float, float]) -> float:
    return sum(g * f for g, f in zip(groups, factors))


def leave_one_out(rows: list[tuple[tuple[float, float, float], float]]) -> list[float]:
    """Relative error of each run predicted by the factors fitted on all the others."""
    errs = []
    for i, (groups, measured) in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        f = fit_factors(others) if others else (1.0, 1.0, 1.0)
        errs.append(predict(groups, f) / measured - 1.0)
    return errs


def fit(runs: list[dict], base: dict, experiment: str) -> dict:
    """The base profile with fitted efficiency factors and the fit's record. `runs`: dicts with "run_id",
    "groups" (compute, comm, overhead seconds predicted with factors 1) and "measured" seconds."""
    rows = [(tuple(r["groups"]), float(r["measured"])) for r in runs if r.get("measured")]
    if not rows:
        raise ConfigError(f"--calibrate-from {experiment}: no finished run with plan/measured_step_time_s to fit on "
                          "(every job logs it after 10 warm-up steps)")
    factors = fit_factors(rows)
    loo = leave_one_out(rows) if len(rows) > 1 else []
    before = [predict(g, (1.0, 1.0, 1.0)) / m - 1.0 for g, m in rows]
    after = [predict(g, factors) / m - 1.0 for g, m in rows]
    out = dict(base)
    out["efficiency"] = {"compute": round(factors[0], 4), "comm": round(factors[1], 4),
                         "overhead": round(factors[2], 4)}
    out["fit"] = {
        "experiment": experiment,
        "runs": len(rows),
        "run_ids": [r["run_id"] for r in runs if r.get("measured")],
        "loo_median_abs_error": round(statistics.median(abs(e) for e in loo), 4) if loo else None,
        "loo_errors": [round(e, 4) for e in loo],
        "unfitted_median_abs_error": round(statistics.median(abs(e) for e in before), 4),
        "in_sample_median_abs_error": round(statistics.median(abs(e) for e in after), 4),
        "ridge": RIDGE,
    }
    return out
