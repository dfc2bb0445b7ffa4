"""The Transformer as a DeepSpeed PipelineModule: a flat list of layer specs split into stages.

    [embed] [block 0] ... [block L-1] [final norm] [head]

The embedding sits on the first stage and the final norm + head on the last. With
tie_embeddings the head is a TiedLayerSpec of the embedding, so DeepSpeed keeps one copy per
stage that needs it and all-reduces its gradient between them.

Every layer is built by the same classes as the Transformer with the same parameter names
(`embed.weight`, `layers.{i}.*`, `norm.weight`, `head.weight`), and those names seed the
initialisation: for the same seed the pipelined model starts bit-identical to the
non-pipelined one, whatever the partition.

DeepSpeed's contract: the engine feeds `inputs` (token ids) to the first stage and calls
`loss_fn(outputs, labels)` on the last. The last layer returns (hidden, head_weight) rather
than logits, so the loss runs as the chunked cross-entropy (vocab-parallel at tp>1) and full
logits never exist.

Sequence parallelism (tp > 1): inside a stage the activations between blocks are sequence
shards, different on every tp rank. DeepSpeed's pipeline engine assumes the tensor passed
between stages is the same on every tp rank: with tp > 1 it splits the flattened activation
into tp pieces, each tp rank sends its piece and the next stage all-gathers them back
(`pipe_partitioned`, the same for gradients with `grad_partitioned`). Sequence shards fed to
that machinery come out as a mix of different ranks' shards. So under sequence parallelism
the stage output is all-gathered to the full, replicated sequence before it leaves the stage
and split back to this rank's shard where the next stage starts (`_stage_input` /
`_stage_output`); the point-to-point traffic stays 1/tp of the activation per rank.

Context parallelism (cp > 1): DeepSpeed's grid has no cp axis, so cp folds into its data axis (groups.py) and each
stage holds this rank's part of every sequence. What the blocks need to attend across the parts (SequenceLayout: the
global and RoPE positions, the document ids of every part) is built where each stage starts, from the tensors that
travel (the hidden states and this part's document ids): a process group cannot travel between stages. The engine
averages the loss and the gradients over that data axis, dp x cp ranks, where the parts of a sequence must add up:
the loss is multiplied by cp (PipelineLoss).

Mixtures of experts: the balance loss pools every MoE layer's routing statistics, whichever stage holds it, so each
stage adds its layers' (tokens per expert, router probabilities, rows) to what the earlier stages carried and hands
the sum on beside the hidden states (RouterStats.carried); the last stage's loss adds the balance term from it. The
probabilities keep their graph, so the term's gradient travels back to every stage's routers. The term trains but
is not the reported loss: it enters as b - b.detach() (value 0, gradient b's), so train/loss and val/loss stay the
language-model loss, as without a pipeline.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from rayspeed.compat import ExplicitPipelineParts
from rayspeed.config.shape import ModelShape
from rayspeed.model.families import composition_of
from rayspeed.model.moe import MoE, RouterStats
from rayspeed.model.output import Routing
from rayspeed.model.transformer import OutputHead, block_class, check_mode, check_split, embed_scale
from rayspeed.parallel.comm import gather_sequence_to_replicated, split_to_sequence
from rayspeed.parallel.context_parallel import NO_CP, ContextParallel, SequenceLayout, sum_over_cp
from rayspeed.parallel.groups import ParallelGroups, TensorParallel
from rayspeed.parallel.layers import NO_TP, VocabParallelEmbedding, enter_tp_region
from rayspeed.parallel.loss import IGNORE_INDEX, linear_cross_entropy


class EmbeddingPipe(VocabParallelEmbedding):
    """First-stage layer: token ids [batch, seq] -> hidden [batch, seq(/tp under sp), h]. With document masking the
    input is (ids, segment_ids) and the output (hidden, segment_ids): the segment ids ride between the stages."""

    canonical_prefix = "embed"

    def __init__(self, cfg, tp: Optional[TensorParallel] = None, sequence_parallel: bool = False, seed: int = 0):
        dims = ModelShape.from_config(cfg)
        super().__init__(
            dims.vocab_size, dims.hidden_size, tp, sequence_parallel=sequence_parallel,
            init_std=dims.init_std, seed=seed, name="embed", scale=embed_scale(dims),
        )

    def forward(self, x):
        if isinstance(x, tuple):
            ids, seg = x
            return super().forward(ids), seg
        return super().forward(x)


@functools.lru_cache(maxsize=None)
def final_norm_pipe(norm: type) -> type:
    """The last stage's final norm: the family's norm class (parameter `norm.weight`), the segment ids dropped."""
    def forward(self, x):
        return norm.forward(self, x[0] if isinstance(x, tuple) else x)  # the segment ids end here

    return type(f"FinalNormPipe{norm.__name__}", (norm,), {"canonical_prefix": "norm", "forward": forward})


class HeadPipe(OutputHead):
    """Last-stage layer of an untied model: returns (tp-region hidden, head weight) for the loss."""

    canonical_prefix = "head"

    def forward(self, x: torch.Tensor):
        return self.prepare(x), self.weight


def tied_head_forward(embedding: EmbeddingPipe, x: torch.Tensor):
    """Last-stage use of the tied embedding: the head's input and weight, for the loss."""
    return enter_tp_region(x, embedding.tp, embedding.sequence_parallel), embedding.weight


class PipelineLoss:
    """loss_fn(outputs, labels) for the last stage: fp32 cross-entropy of hidden @ weight^T, the mean over the counted
    labels (-100 is ignored); or, when the trainer sets `scale`, the sum times `scale` (it sets it per step to
    dp * grad_accum / counted labels of the global batch, so the step's loss is the mean over all of them).

    Under cp the labels are this rank's part: the mean divides by the count of every part's labels, and both are
    times cp, because the engine averages over dp x cp ranks what must be summed over cp.

    balance (num_experts, coefficient): a mixture of experts' outputs carry, third, the routing statistics of every
    stage; their balance loss times the coefficient trains beside the returned loss, unscaled, as the training step
    adds it without a pipeline; `aux_sum` / `aux_forwards` add up the unweighted balance losses (moe/aux_loss)."""

    def __init__(self, tp: Optional[TensorParallel] = None, chunk_tokens: Optional[int] = None,
                 cap: Optional[float] = None, cp: Optional[ContextParallel] = None,
                 balance: Optional[tuple[int, float]] = None):
        self.tp = tp or NO_TP
        self.cp = cp or NO_CP
        self.chunk_tokens, self.cap = chunk_tokens, cap
        self.scale: Optional[float] = None
        # A preference objective's loss from each label's cross entropy: labels arrive as (labels, *what it needs).
        self.per_token: Optional[Callable[..., torch.Tensor]] = None
        self.balance = balance
        self.aux_sum: Any = 0.0
        self.aux_forwards = 0

    def __call__(self, outputs, labels: Any) -> torch.Tensor:
        if self.balance is None:
            return self.language(outputs, labels)
        loss = self.language(outputs[:2], labels)
        num_experts, coef = self.balance
        aux = RouterStats.pooled_aux(outputs[2], num_experts)
        if torch.is_grad_enabled():  # a training forward (evaluation's routing is not the balance metric's)
            self.aux_sum = aux.detach() + self.aux_sum
            self.aux_forwards += 1
        term = aux * coef
        return loss + (term - term.detach())

    def language(self, outputs, labels: Any) -> torch.Tensor:
        hidden, weight = outputs
        if self.per_token is not None:
            labels, *extra = labels
            ce = linear_cross_entropy(hidden, weight, labels, self.tp, chunk_tokens=self.chunk_tokens,
                                      reduction="none", cap=self.cap)
            return self.per_token(ce.view(labels.shape), labels, *extra)
        if self.scale is None and not self.cp.enabled:
            return linear_cross_entropy(hidden, weight, labels, self.tp, chunk_tokens=self.chunk_tokens, cap=self.cap)
        total = linear_cross_entropy(hidden, weight, labels, self.tp, chunk_tokens=self.chunk_tokens,
                                     reduction="sum", cap=self.cap)
        if self.scale is not None:
            return total * (self.scale * self.cp.world_size)
        count = sum_over_cp((labels != IGNORE_INDEX).sum(), self.cp).clamp(min=1)
        return total * self.cp.world_size / count


@functools.lru_cache(maxsize=None)
def _pipeline_module_class():
    """deepspeed.pipe.PipelineModule whose stage boundaries carry replicated activations under sp.

    Built on first use so importing this module does not import DeepSpeed.
    """
    from deepspeed.pipe import PipelineModule

    class SequenceParallelPipelineModule(ExplicitPipelineParts, PipelineModule):
        """A PipelineModule whose stages exchange full-sequence activations, identical on every tp rank.

        Without sequence parallelism the activations between blocks are already replicated over
        tp and this is a plain PipelineModule.
        """

        def __init__(self, *args, tp: TensorParallel = NO_TP, sequence_parallel: bool = False,
                     cp: ContextParallel = NO_CP, num_experts: int = 0, moe_layers: Sequence[int] = (), **kwargs):
            super().__init__(*args, **kwargs)
            self.sp_tp = tp
            self.sequence_parallel = sequence_parallel and tp.enabled
            self.cp = cp
            # This stage's MoE layers report to one collector; its sums travel on (module docstring).
            self.stage_router_stats = RouterStats(num_experts) if num_experts else None
            here = [m for m in self.modules() if isinstance(m, MoE)]
            for m in here:
                m.stats = self.stage_router_stats
            # The stage's MoE layers, in the order they route, among the model's; the last stage's loss pools all.
            self.routing = None if self.stage_router_stats is None else Routing(
                self.stage_router_stats, list(moe_layers),
                rows=[list(moe_layers).index(int(m.name.split(".")[1])) for m in here], pooled=self.loss_fn)

        def _stage_input(self, x):
            if self.cp.enabled:  # (tokens or hidden[, segment ids]) -> (them, this stage's SequenceLayout)
                first = x[0] if isinstance(x, tuple) else x
                seg = x[1] if isinstance(x, tuple) else None
                x = (first, SequenceLayout(self.cp, first.shape[1], seg, first.device))
            # Stage > 0 receives the replicated full sequence; its layers expect this rank's shard.
            if self.sequence_parallel and self.stage_id > 0:
                if isinstance(x, tuple):  # (hidden, segment_ids): the segment ids stay whole
                    return (split_to_sequence(x[0], self.sp_tp), *x[1:])
                return split_to_sequence(x, self.sp_tp)
            return x

        def _stage_output(self, x):
            if self.cp.enabled and isinstance(x, tuple) and isinstance(x[1], SequenceLayout):
                layout = x[1]
                x = x[0] if layout.segments is None else (x[0], layout.segments[self.cp.rank])
            # Every stage but the last hands the full sequence to the engine, which (pipe_partitioned)
            # sends 1/tp of it per tp rank and reassembles it on the next stage.
            if self.sequence_parallel and self.stage_id < self.num_stages - 1:
                if isinstance(x, tuple):
                    return (gather_sequence_to_replicated(x[0], self.sp_tp), *x[1:])
                return gather_sequence_to_replicated(x, self.sp_tp)
            return x

        def forward(self, forward_input):
            stats = self.stage_router_stats
            if stats is None:
                return self._stage_output(super().forward(self._stage_input(forward_input)))
            earlier = None
            if self.stage_id > 0:  # (hidden[, segment ids], the earlier stages' routing statistics)
                *rest, earlier = forward_input
                forward_input = rest[0] if len(rest) == 1 else tuple(rest)
            stats.start(windowed=torch.is_grad_enabled())  # a training forward's load goes to the moe/* metrics
            out = self._stage_output(super().forward(self._stage_input(forward_input)))
            carried = stats.carried(earlier)
            return (*out, carried) if isinstance(out, tuple) else (out, carried)

    return SequenceParallelPipelineModule


def build_pipeline_module(
    cfg,
    groups_or_topology: Union[ParallelGroups, "object", None] = None,
    num_stages: Optional[int] = None,
    tp: Optional[TensorParallel] = None,
    sequence_parallel: bool = False,
    activation_checkpointing: str = "none",
    preserve_rng_state: bool = False,
    seed: int = 0,
    partition_method: str = "parameters",
    loss_chunk_tokens: Optional[int] = None,
    stage_layers: Optional[Sequence[int]] = None,
    cp: Optional[ContextParallel] = None,
):
    """A deepspeed.pipe.PipelineModule of the Transformer described by `cfg`.

    groups_or_topology: a ParallelGroups (its DeepSpeed topology and tp handle are used), a
    DeepSpeed ProcessTopology, or None (then num_stages is required and there is no tp).
    partition_method: any DeepSpeed method: "parameters" (balance parameter counts; DeepSpeed
    builds, and so initialises, every layer on every rank to count them, which is slow for big
    models), "uniform" (same number of specs per stage) or "type:Block" (same number of blocks,
    embedding on the first stage and norm + head on the last; builds nothing extra).
    stage_layers: blocks per stage, first to last (the planner's split; stages may differ): overrides
    partition_method, the embedding on the first stage and the final norm + head on the last.
    Activation checkpointing is done inside the blocks, not by DeepSpeed's interval.
    cp: the context-parallel group (a ParallelGroups gives its own); the stages then take this rank's part of
    every sequence (context_parallel.shard) and the labels of the same part.
    torch.distributed must be initialized (e.g. deepspeed.init_distributed()) and LOCAL_RANK set.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    topology = None
    if isinstance(groups_or_topology, ParallelGroups):
        topology = groups_or_topology.topology()
        tp = tp or groups_or_topology.tp
        cp = cp or groups_or_topology.cp
    elif groups_or_topology is not None:
        topology = groups_or_topology
    tp, cp = tp or NO_TP, cp or NO_CP
    if cp.enabled and topology is None:
        raise ValueError("cp > 1 needs a ParallelGroups or topology: cp folds into the pipeline grid's data axis")

    if topology is not None:
        stages = topology.get_dim("pipe")
        if num_stages is not None and num_stages != stages:
            raise ValueError(f"num_stages={num_stages} but the topology has {stages} pipeline stages")
        model_dim = max(topology.get_dim("model"), 1) if "model" in topology.get_axis_names() else 1
        if model_dim != tp.world_size:
            raise ValueError(f"topology has model (tp) size {model_dim} but the tp handle has {tp.world_size}")
    elif num_stages is None:
        raise ValueError("give a ParallelGroups, a topology or num_stages")
    elif tp.enabled:
        raise ValueError("tp > 1 needs a ParallelGroups or topology so stages and tp slices line up")
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("DeepSpeed's PipelineModule reads LOCAL_RANK from the environment; set it first")

    dims = ModelShape.from_config(cfg)
    sp = sequence_parallel and tp.enabled
    check_split(dims, tp, sp)
    check_mode(activation_checkpointing)

    embed_args = (dims, tp, sp, seed)
    specs = []
    if dims.tie_embeddings:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, *embed_args, tied_weight_attr=["weight"]))
    else:
        specs.append(LayerSpec(EmbeddingPipe, *embed_args))
    specs += [
        LayerSpec(block_class(dims), dims, i, tp, sp, activation_checkpointing, preserve_rng_state, seed)
        for i in range(dims.num_layers)
    ]
    specs.append(LayerSpec(final_norm_pipe(composition_of(dims.family).norm), dims.hidden_size, dims.norm_eps, tp, sp))
    if dims.tie_embeddings:
        specs.append(
            TiedLayerSpec("embed", EmbeddingPipe, *embed_args, forward_fn=tied_head_forward,
                          tied_weight_attr=["weight"])
        )
    else:
        specs.append(LayerSpec(HeadPipe, dims, tp, sp, seed))

    if stage_layers is not None:
        n_stages = topology.get_dim("pipe") if topology is not None else num_stages
        split = [int(n) for n in stage_layers]
        if len(split) != n_stages or min(split) < 1 or sum(split) != dims.num_layers:
            raise ValueError(f"stage_layers {split} must give {n_stages} stages of >= 1 block adding up to "
                             f"{dims.num_layers}")
        bounds = [0] + [1 + sum(split[:i + 1]) for i in range(n_stages - 1)] + [len(specs)]  # spec 0: embedding
        partition_method = "parts:" + ",".join(map(str, bounds))

    # PipelineModule broadcasts tied weights in place while it is built; under grad mode
    # autograd would record that broadcast into the tied parameter's history.
    with torch.no_grad():
        return _pipeline_module_class()(
            layers=specs,
            topology=topology,
            num_stages=None if topology is not None else num_stages,
            loss_fn=PipelineLoss(tp, loss_chunk_tokens, dims.final_logit_softcapping, cp,
                                 balance=(dims.num_experts, dims.router_aux_loss_coef) if dims.num_experts else None),
            partition_method=partition_method,
            activation_checkpoint_interval=0,
            tp=tp,
            sequence_parallel=sp,
            cp=cp,
            num_experts=dims.num_experts,
            moe_layers=[i for i in range(dims.num_layers) if dims.is_moe(i)],
        )


def canonical_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """This stage's parameters under the Transformer's names (`embed.weight`, `layers.3.attn.wq.weight`, ...).

    Lets checkpoints and tests line a pipeline stage up with the non-pipelined model.
    """
    for _, child in module.named_modules():
        prefix = getattr(child, "canonical_prefix", None)
        if prefix is None:
            continue
        for name, param in child.named_parameters():
            yield f"{prefix}.{name}", param
