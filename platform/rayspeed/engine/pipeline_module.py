"""The decoder's pieces (rayspeed.model.decoder) cut into DeepSpeed pipeline stages, and the one edge between stages.

DeepSpeed's PipelineModule takes a flat list of one-input layers, builds each stage's on the rank that runs it, ties
the embedding of the first and last stage (TiedLayerSpec) and passes only tensors between stages; the decoder's pieces
are such a list. What this module adds is the stage edge, where a stage's input and output differ from what the
pieces pass inside a stage:

- Sequence parallelism (tp > 1): inside a stage the activations are sequence shards, different on every tp rank.
  DeepSpeed's pipeline engine assumes the tensor passed between stages is the same on every tp rank (with tp > 1 it
  sends 1/tp of the flattened activation per rank and all-gathers it on the next stage: `pipe_partitioned`). So the
  stage output is gathered to the replicated sequence before it leaves and split back to this rank's shard where the
  next stage starts; the point-to-point traffic stays 1/tp of the activation per rank.
- Context parallelism (cp > 1): DeepSpeed's grid has no cp axis, so cp folds into its data axis (parallel/groups.py)
  and each stage holds this rank's part of every sequence. What the blocks need to attend across the parts (the
  SequenceLayout) is built where each stage starts, from the tensors that travel (the hidden states and this part's
  document ids): a process group cannot travel between stages.
- Mixtures of experts: each stage's MoE layers report to one collector, whose sums travel on beside the hidden states
  to the last stage's loss (rayspeed.model.stage_loss).

The layers are built on the CPU in DeepSpeed's constructor (it moves them to the device itself), not on the meta
device: PipelineModule builds, and for the "parameters" partition counts, each layer from its spec, and the
name-seeded initialisation needs the values there.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Sequence, Union

import torch

from rayspeed.compat import ExplicitPipelineParts
from rayspeed.config.shape import ModelShape
from rayspeed.model.decoder import Piece, attach_routing, decoder_pieces
from rayspeed.model.parts.head import OutputHead
from rayspeed.model.stage_loss import PipelineLoss
from rayspeed.model.transformer import check_mode, check_split
from rayspeed.parallel.comm import gather_sequence_to_replicated, split_to_sequence
from rayspeed.parallel.context_parallel import NO_CP, ContextParallel, SequenceLayout
from rayspeed.parallel.groups import ParallelGroups, TensorParallel
from rayspeed.parallel.layers import NO_TP


@functools.lru_cache(maxsize=None)
def _specs():
    """LayerSpec and TiedLayerSpec that build a decoder piece (imported on first use: importing this module does
    not import DeepSpeed)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    class PieceSpec(LayerSpec):
        def __init__(self, piece: Piece):
            super().__init__(piece.cls)
            self.piece = piece

        def build(self, log=False):
            return self.piece.build()

    class TiedPieceSpec(TiedLayerSpec):
        def __init__(self, piece: Piece, forward_fn=None):
            super().__init__("embed", piece.cls, forward_fn=forward_fn, tied_weight_attr=["weight"])
            self.piece = piece

        def build(self, log=False):
            return self.piece.build()

    return PieceSpec, TiedPieceSpec


def stage_specs(pieces: list[Piece]) -> list:
    """The pieces as DeepSpeed's layer specs: a head that ties to the input stage is that stage's tied copy."""
    piece_spec, tied_spec = _specs()
    embed, head = pieces[0], pieces[-1]
    if not head.ties_input:
        return [piece_spec(p) for p in pieces]
    return [tied_spec(embed), *(piece_spec(p) for p in pieces[1:-1]), tied_spec(embed, OutputHead.tied_output)]


@functools.lru_cache(maxsize=None)
def _pipeline_module_class():
    """deepspeed.pipe.PipelineModule with the stage edge (the module docstring)."""
    from deepspeed.pipe import PipelineModule

    class StagedDecoder(ExplicitPipelineParts, PipelineModule):
        def __init__(self, *args, dims: ModelShape, tp: TensorParallel = NO_TP, sequence_parallel: bool = False,
                     cp: ContextParallel = NO_CP, **kwargs):
            super().__init__(*args, **kwargs)
            self.sp_tp = tp
            self.sequence_parallel = sequence_parallel and tp.enabled
            self.cp = cp
            # This stage's MoE layers report to one collector; the last stage's loss pools every stage's.
            self.stage_router_stats, self.routing = attach_routing(list(self.children()), dims, pooled=self.loss_fn)

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

    return StagedDecoder


def _grid(groups_or_topology: Any, num_stages: Optional[int], tp: Optional[TensorParallel],
          cp: Optional[ContextParallel]) -> tuple[Any, TensorParallel, ContextParallel]:
    """(DeepSpeed topology or None, tp, cp), checked against each other."""
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
    return topology, tp, cp


def _explicit_parts(stage_layers: Sequence[int], stages: int, dims: ModelShape, num_specs: int) -> str:
    """DeepSpeed's partition boundaries for the planner's blocks per stage: the input stage on the first, the final
    norm and the head on the last."""
    split = [int(n) for n in stage_layers]
    if len(split) != stages or min(split) < 1 or sum(split) != dims.num_layers:
        raise ValueError(f"stage_layers {split} must give {stages} stages of >= 1 block adding up to "
                         f"{dims.num_layers}")
    bounds = [0] + [1 + sum(split[:i + 1]) for i in range(stages - 1)] + [num_specs]  # spec 0: the input stage
    return "parts:" + ",".join(map(str, bounds))


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
    """A deepspeed.pipe.PipelineModule of the decoder described by `cfg`.

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
    topology, tp, cp = _grid(groups_or_topology, num_stages, tp, cp)
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("DeepSpeed's PipelineModule reads LOCAL_RANK from the environment; set it first")

    dims = ModelShape.from_config(cfg)
    sp = sequence_parallel and tp.enabled
    check_split(dims, tp, sp)
    check_mode(activation_checkpointing)
    specs = stage_specs(decoder_pieces(dims, tp, sp, activation_checkpointing, preserve_rng_state, seed))
    if stage_layers is not None:
        stages = topology.get_dim("pipe") if topology is not None else num_stages
        assert stages is not None  # _grid refuses no topology without num_stages
        partition_method = _explicit_parts(stage_layers, stages, dims, len(specs))

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
            dims=dims,
            tp=tp,
            sequence_parallel=sp,
            cp=cp,
        )
