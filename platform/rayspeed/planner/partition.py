"""Which transformer blocks go on which pipeline stage.

Any pp up to the number of layers is valid: Megatron, nanotron and DeepSpeed all run stages of unequal block
counts, and an uneven split is often the fastest (28 layers on 8 stages; or fewer blocks on the last stage,
which also carries the output head and the loss). The planner balances the stages by the time of one
micro-batch's forward and backward, with the embedding counted on the first stage and the final norm, the
head and the cross-entropy on the last: the slowest stage sets the pace of 1F1B. Among splits equally fast,
the extra blocks go away from the first stage, which holds the most in-flight activations under 1F1B.
"""

from __future__ import annotations

import functools

from rayspeed.config.layout import Layout


@functools.lru_cache(maxsize=4096)
def balance(num_layers: int, pp: int, block: float, first_extra: float, last_extra: float) -> tuple[int, ...]:
    """Blocks per stage (each >= 1) minimising the slowest stage, where a stage of n blocks takes n * block plus
    the first stage's and the last stage's extra work. Ties: fewer blocks on earlier stages."""
    if pp <= 1:
        return (num_layers,)
    if num_layers < pp:
        raise ValueError(f"pp ({pp}) exceeds the {num_layers} layers: every stage needs one")
    block = max(block, 1e-30)
    extras = [0.0] * pp
    extras[0] += first_extra
    extras[-1] += last_extra

    def capacity(t: float) -> list[int] | None:
        caps = [int((t - e) / block + 1e-9) for e in extras]
        return caps if min(caps) >= 1 else None

    # The bottleneck is n * block + e for some stage; try those values in increasing order.
    candidates = sorted({n * block + e for e in set(extras) for n in range(1, num_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        caps = capacity(candidates[mid])
        if caps is not None and sum(caps) >= num_layers:
            hi = mid
        else:
            lo = mid + 1
    caps = capacity(candidates[lo])
    assert caps is not None and sum(caps) >= num_layers
    # Too much room: the excess is smaller than the number of stages at the bottleneck, so take one block back
    # from each of the busiest stages, earliest first among equals.
    excess = sum(caps) - num_layers
    for j in sorted(range(pp), key=lambda j: (-(caps[j] * block + extras[j]), j)):
        if excess <= 0:
            break
        if caps[j] > 1:
            caps[j] -= 1
            excess -= 1
    while excess > 0:  # only reached when blocks are negligible against the extras
        i = max((j for j in range(pp) if caps[j] > 1), key=lambda j: (caps[j] * block + extras[j], -j))
        caps[i] -= 1
        excess -= 1
    return tuple(caps)


def choose_split(ctx, lay: Layout) -> tuple[int, ...]:
    """The planner's split for this layout: balanced by the per-micro-batch time of blocks, embedding and head
    (their parameters enter through the same GEMMs)."""
    from rayspeed.planner.timing import block_cost, embed_cost, head_cost

    L = ctx.shape.num_layers
    if lay.pp <= 1:
        return (L,)
    bc = block_cost(ctx, lay)
    head, _ = head_cost(ctx, lay)
    return balance(L, lay.pp, bc.total, embed_cost(ctx, lay), head)

