"""Time of one GEMM at the shape a rank really runs.

Without a calibrated profile: a soft roofline (FLOPs at the best measured GEMM efficiency plus the operand
traffic at memory bandwidth), with the dimension quantization NVIDIA's "Matrix Multiplication Background"
guide describes (DU-09799-001, ch. 3): the output is computed in 128 x 128 tiles (tile quantization: a partial
tile costs a full one) scheduled in waves of one tile per SM (wave quantization: a last, partial wave leaves
SMs idle). Thin GEMMs from small micro-batches or narrow tp shards therefore run far below peak.

With a calibrated profile: the throughput measured on the user's own device at the nearest measured shape
(log-distance over M, K, N), corrected for the FLOP ratio only, so the planner reads what the cluster does.
"""

from __future__ import annotations

import math

TILE = 128  # cuBLAS's typical output tile on Ampere/Hopper (the guide's "typical tile dimensions")


def quantization_efficiency(M: float, N: float, sm_count: int) -> float:
    """Useful fraction of the tile-waves a GEMM with an M x N output occupies (1 for huge outputs)."""
    if sm_count <= 0:
        return 1.0
    tm, tn = math.ceil(M / TILE), math.ceil(N / TILE)
    tiles = tm * tn
    waves = math.ceil(tiles / sm_count)
    tile_eff = (M * N) / (tm * TILE * tn * TILE)
    return tile_eff * tiles / (waves * sm_count)


def roofline_s(M: float, K: float, N: float, peak_flops: float, efficiency: float, mem_bytes_per_s: float,
               elem_bytes: int, sm_count: int) -> float:
    flops = 2.0 * M * K * N
    traffic = elem_bytes * (M * K + K * N + M * N)
    eff = efficiency * quantization_efficiency(M, N, sm_count)
    return flops / (peak_flops * eff) + traffic / mem_bytes_per_s


def measured_s(table: tuple, M: float, K: float, N: float) -> float | None:
    """FLOPs of this GEMM at the measured throughput of the closest measured shape; None without a table.
    `table`: ((m, k, n, flops_per_s), ...)."""
    if not table:
        return None
    lm, lk, ln = math.log(max(M, 1)), math.log(max(K, 1)), math.log(max(N, 1))
    best = min(table, key=lambda r: ((math.log(r[0]) - lm) ** 2 + (math.log(r[1]) - lk) ** 2
                                     + (math.log(r[2]) - ln) ** 2))
    return 2.0 * M * K * N / max(best[3], 1.0)
