"""Parameters per rank under tensor and pipeline parallelism (the global counts and FLOPs are on
rayspeed.config.shape.ModelShape)."""

from __future__ import annotations

from rayspeed.config.shape import ModelShape


def stage_params(sh: ModelShape, tp: int, pp: int, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` (0-based) with tensor degree tp.
    Layers are split evenly (pp divides L); the vocab-parallel embedding sits on the first stage, the final
    norm and output head on the last; a tied head on pp > 1 is a second copy on the last stage (its
    gradient is all-reduced with the first stage's)."""
    layers = sh.num_layers // pp
    n = layers * (sh.layer_matrix_params // tp + sh.layer_norm_params)
    if stage == 0:
        n += sh.embedding_params // tp
    if stage == pp - 1:
        n += sh.hidden_size
        if not sh.tie_embeddings or pp > 1:
            n += sh.vocab_size * sh.hidden_size // tp
    return n


def max_stage_params(sh: ModelShape, tp: int, pp: int) -> int:
    return max(stage_params(sh, tp, pp, 0), stage_params(sh, tp, pp, pp - 1))
