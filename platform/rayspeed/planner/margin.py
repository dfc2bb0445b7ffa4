"""How sure the memory model is of one estimate: a margin in bytes, the sum over components of each component's
relative uncertainty times its bytes (linear, not in quadrature: the components' errors share causes, such as a
micro-batch shape the allocator rounds badly, so they add up rather than cancel).

The pick must fit with this margin (pick_order.rank); `rayspeed plan` shows every memory figure as "68.2 GiB +- 8.1".
Each uncertainty and its source is in docs/PLANNER.md ("The memory margin")."""

from __future__ import annotations

# Relative uncertainty per component of memory.COMPONENTS.
UNCERTAINTY = {
    # Exact arithmetic checked against the real engine's tensors (within 2%: tests/train/test_layouts.py).
    "weights": 0.02,
    "gradients": 0.02,
    "master_weights": 0.02,
    "optimizer_states": 0.02,
    # Measured: the most the engine's step peak grew beyond the predicted growth, with micro-batches in flight or
    # per micro-batch, was 12.4% (a deep pipeline's next-to-last stage: the second pipe buffer's hidden states),
    # rounded up (tests/planner/measured_memory.json, `make bench`; tests/planner/test_measured_memory.py keeps the
    # two together). Not measured here: what a GPU adds (the caching allocator's rounding and segments, workspaces).
    "activations": 0.15,
    "logits_loss": 0.10,  # the chunked loss's buffers: counted from rayspeed.parallel.loss
    # DeepSpeed's buffers: sized from its configuration, not measured here (no GPU).
    "zero3_gathered": 0.25,
    "comm_buckets": 0.25,
    # CUDA context and NCCL channel buffers vary with the driver, NCCL_BUFFSIZE and the channel count NCCL picks
    # (2 to 32 per communicator).
    "cuda_context": 0.35,
    # Measured on the H200 anchor's DeepSpeed runs (ZeRO-1 to 3, GPT-2 124M and 774M): the caching allocator
    # reserved 2.3-3.9 GiB beyond its allocated peak, up to 2.47x the planner's slack term for the same layout
    # (tests/planner/test_planner_search.py ANCHOR_MEMORY).
    "allocator_slack": 1.5,
    # What a step that ran out of memory showed the model missing (planner/oom_feedback.py), spread over the
    # layouts of its kind in proportion to their activations: as sure as the activations it is spread by.
    "measured_oom": 0.15,
}
FEATURE_TERM = 0.25  # a feature's registered term (planner/terms.py) until it has a measurement of its own


def margin_bytes(memory: dict) -> float:
    """The margin of one estimate's breakdown (bytes by component)."""
    return sum(UNCERTAINTY.get(k, FEATURE_TERM) * max(0.0, v) for k, v in memory.items())
