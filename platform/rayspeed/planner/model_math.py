"""Parameters per rank under tensor and pipeline parallelism (the global counts and FLOPs are on
rayspeed.config.shape.ModelShape)."""

from __future__ import annotations

from rayspeed.config.layout import Layout
from rayspeed.config.shape import ModelShape


def even_split(num_layers: int, pp: int) -> tuple[int, ...]:
    """Blocks per stage as even as they go, the extra ones on the middle-to-last stages (the first stage holds
    the most in-flight micro-batches under 1F1B, so it gets the fewest)."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i >= pp - extra else 0) for i in range(pp))


def stage_params(sh: ModelShape, tp: int, pp: int, stage: int, layers: int | None = None, ep: int = 1) -> int:
    """Parameters held by one rank of pipeline stage `stage` (0-based) with tensor degree tp, holding `layers`
    blocks (default: the even share L // pp). The vocab-parallel embedding sits on the first stage, the final
    norm and output head on the last; a tied head on pp > 1 is a second copy on the last stage (its gradient
    is all-reduced with the first stage's). Under ep a rank holds 1 / ep of each MoE layer's experts, under tp 1 / tp
    of each expert's width; its routers are whole on every tp rank."""
    if layers is None:
        layers = sh.num_layers // pp
    n = layers * (sh.layer_matrix_params // tp + sh.layer_norm_params)
    moe_share = len(sh.moe_layers) / sh.num_layers if sh.num_experts else 0.0  # MoE layers spread over the stages
    if moe_share and tp > 1:
        n += round(layers * moe_share * sh.num_experts * sh.hidden_size * (tp - 1) / tp)
    if ep > 1:
        n -= round(layers * moe_share * sh.num_experts * sh.expert_params * (ep - 1) / (ep * tp))
    if stage == 0:
        n += sh.embedding_params // tp
    if stage == pp - 1:
        n += sh.hidden_size
        if not sh.tie_embeddings or pp > 1:
            n += sh.vocab_size * sh.hidden_size // tp
    return n


def max_stage_params(sh: ModelShape, tp: int, pp: int, split: tuple[int, ...] | None = None, ep: int = 1) -> int:
    """The largest stage: the first, the last, or the middle stage with the most blocks."""
    split = split or tuple([sh.num_layers // pp] * pp)
    cands = {0, pp - 1}
    if pp > 2:
        cands.add(max(range(1, pp - 1), key=lambda i: split[i]))
    return max(stage_params(sh, tp, pp, i, split[i], ep) for i in cands)


def local_tokens(sh: ModelShape, lay: Layout) -> int:
    """Tokens of one micro-batch on one rank: its sequences' share under context parallelism (seq_len / cp)."""
    return lay.micro_batch_size * sh.seq_len // lay.cp


def split_of(sh: ModelShape, lay: Layout) -> tuple[int, ...]:
    """The layout's explicit split, else the even one."""
    if lay.stage_layers is not None:
        return tuple(lay.stage_layers)
    return even_split(sh.num_layers, lay.pp)
