"""The decoder in one process: the pieces of rayspeed.model.decoder (the input stage, the family's blocks, its final
norm and the output head, composed as the family's model module says), run one after the other. The same function as
transformers' ForCausalLM class of each family rayspeed.config.hf_config accepts; a pipeline runs the same pieces
cut into stages (rayspeed.engine.pipeline_module).

One model for every layout: pass a TensorParallel handle to split heads, the MLP and the
vocabulary over a tp group, and sequence_parallel=True to also split the norm / residual
regions along the sequence. Weights are initialised from (seed, parameter name) on the full
tensor, so every layout of the same seed starts from the same function and produces the
same loss (see parallel/layers.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from rayspeed.config.shape import ModelShape
from rayspeed.config.validate import shape_split_problems
from rayspeed.model.decoder import attach_routing, decoder_pieces
from rayspeed.model.families import composition_of
from rayspeed.model.output import ModelOutput
from rayspeed.model.parts.blocks import CHECKPOINTING_MODES, Block, check_mode
from rayspeed.model.parts.head import OutputHead
from rayspeed.model.parts.mlp import MLP, MLP_TILE_BYTES
from rayspeed.model.parts.norms import RMSNorm
from rayspeed.parallel.context_parallel import NO_CP, ContextParallel, SequenceLayout, sum_over_cp
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP, gather_full
from rayspeed.parallel.loss import IGNORE_INDEX

# The parts' names, where earlier code and users import them from.
__all__ = ["CHECKPOINTING_MODES", "MLP", "MLP_TILE_BYTES", "Block", "OutputHead", "RMSNorm", "Transformer",
           "block_class", "check_mode", "check_split", "count_parameters", "embed_scale", "num_parameters",
           "parameter_bytes"]


def check_split(shape: ModelShape, tp: TensorParallel, sequence_parallel: bool) -> None:
    """Raise ValueError when this shape cannot be split over this tp group (the job checks say the same in
    config terms before anything starts; this guards direct library use)."""
    problems = shape_split_problems(shape, tp.world_size, sequence_parallel)
    if problems:
        raise ValueError("invalid model for this layout: " + "; ".join(problems))


def block_class(dims: ModelShape) -> type:
    """The block of the shape's family, as its composition names it (rayspeed.model.families)."""
    return composition_of(dims.family).block


def embed_scale(dims: ModelShape) -> Optional[float]:
    """What the embedding's output is multiplied by: sqrt(hidden) for a family that scales it (Gemma), else None."""
    return composition_of(dims.family).embedding_scale(dims.hidden_size)


class Transformer(nn.Module):
    """embed -> N blocks -> RMSNorm -> head. forward(ids, labels) is the mean fp32 CE over the counted labels;
    without labels, logits."""

    def __init__(
        self,
        cfg,
        tp: Optional[TensorParallel] = None,
        sequence_parallel: bool = False,
        activation_checkpointing: str = "none",
        preserve_rng_state: bool = False,
        seed: int = 0,
        loss_chunk_tokens: Optional[int] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        dims = ModelShape.from_config(cfg)
        tp = tp or NO_TP
        sp = sequence_parallel and tp.enabled
        check_split(dims, tp, sp)
        self.dims, self.tp, self.sequence_parallel, self.seed = dims, tp, sp, seed
        self.cp = cp or NO_CP
        self.activation_checkpointing = check_mode(activation_checkpointing)

        embed, *blocks, norm, head = decoder_pieces(dims, tp, sp, activation_checkpointing, preserve_rng_state, seed,
                                                    loss_chunk_tokens)
        self.embed = embed.build()
        self.layers = nn.ModuleList(block.build() for block in blocks)
        # Every MoE layer reports its routing to one collector: the balance loss pools them all.
        self.router_stats, self.routing = attach_routing(list(self.layers), dims, self.cp)
        self.aux_loss: Optional[torch.Tensor] = None  # the last forward's balance loss (moe/aux_loss), unweighted
        self.norm = norm.build()
        output_head = head.build(tied_weight=self.embed.weight if head.ties_input else None)
        assert isinstance(output_head, OutputHead)  # decoder_pieces' last piece
        self.head = output_head
        if dims.tie_embeddings:
            self.register_state_dict_post_hook(_frozen_tied_head_once)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None, reduction: str = "mean", parts: bool = False,
                inputs: Optional[dict[str, Any]] = None) -> Any:
        """Labels of -100 are not counted (the mean is over the others). segment_ids [b, s]: document masking
        (attention within a document, positions from its start); None: plain causal attention. reduction "none":
        each label's cross entropy [b, s] (0 where not counted; a preference objective's per-token log-probabilities
        negated), without the balance loss. parts: the loss as a ModelOutput (what trains, the language loss, the
        balance loss) instead of the one tensor transformers returns. inputs: what the family's input stage takes
        besides the ids (a vision-language family's image features).

        Context parallel (cp): the three are this rank's part of each sequence (context_parallel.py `shard`), the
        logits those of its tokens, and the loss this rank's share of the whole sequence's mean: its tokens' sum
        over the count of every part's labels, so the sum over the cp group (DeepSpeed's gradient reduction over
        data x cp) is the unsplit loss."""
        x = self.embed(input_ids, **(inputs or {}))
        if self.router_stats is not None:
            self.router_stats.start(windowed=self.training and torch.is_grad_enabled())
        where = SequenceLayout(self.cp, input_ids.shape[1], segment_ids, x.device) if self.cp.enabled else segment_ids
        for layer in self.layers:
            x = layer(x, where)
        x = self.norm(x)
        aux = self.router_stats.aux_loss() if self.router_stats is not None else None
        self.aux_loss = aux.detach() if aux is not None else None  # kept for metrics, without the graph
        if labels is None:
            return self.head.logits(x)
        if reduction == "none":
            if self.cp.enabled:
                raise ValueError("per-token losses under context parallelism are not built")
            per_token = self.head.loss(x, labels, reduction="none").view(labels.shape)
            return ModelOutput(per_token, per_token) if parts else per_token
        if self.cp.enabled:
            count = sum_over_cp((labels != IGNORE_INDEX).sum(), self.cp).clamp(min=1)
            language = self.head.loss(x, labels, reduction="sum") / count
        else:
            language = self.head.loss(x, labels)
        # Under cp every part holds the whole sequence's balance loss: each adds its 1/cp share, as the loss's.
        balance = None if aux is None else aux * self.dims.router_aux_loss_coef / self.cp.world_size
        loss = language if balance is None else language + balance
        return ModelOutput(loss, language, balance, self.aux_loss) if parts else loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter unsharded (all-gathered over tp; collective), keyed by parameter name.

        For the same seed this is bit-identical for every tp size and equals the weights of
        the same-named layers of the pipeline module.
        """
        return {name: gather_full(p, p, self.tp).clone() for name, p in self.named_parameters()}

    full_state_dict_reference = full_state_dict


def _frozen_tied_head_once(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """A frozen tied head is the frozen embedding: a checkpoint that leaves frozen parameters out (an adapter
    job's) must not keep the matrix under its second name."""
    assert isinstance(module, Transformer)  # the hook Transformer registers on itself
    if not module.embed.weight.requires_grad:
        state.pop(prefix + "head.weight", None)


def num_parameters(model: nn.Module) -> int:
    """Parameters held by this process (tied ones once; a tp rank counts only its shards)."""
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters held by this process."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def count_parameters(cfg) -> int:
    """Parameters of the whole (unsharded) model, from the config alone."""
    return ModelShape.from_config(cfg).params
