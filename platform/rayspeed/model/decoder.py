"""The decoder as one flat list of one-input layers, the only place the model is assembled:

    [input stage] [block 0] ... [block L-1] [final norm] [head]

The Transformer builds every piece and runs them in one process; DeepSpeed's pipeline (rayspeed.engine.pipeline_module)
builds each stage's pieces where it runs them. Each takes one input: the hidden states, or (hidden states, where)
when attention needs more than causality (document ids, or a context-parallel SequenceLayout), and the final norm
drops the `where`. The head returns (its input in the tp region, its matrix): the loss reads both, so full logits
never exist. A piece's parameters live under its prefix in the Transformer's state dict (`embed.weight`,
`layers.{i}.*`, `norm.weight`, `head.weight`), and those names seed the initialisation: a pipelined model starts
bit-identical to the one-process model, whatever the cut.

With tie_embeddings the head is the input stage's matrix (`ties_input`): the Transformer hands it over, DeepSpeed's
pipeline ties the two stages' copies and all-reduces their gradient.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch.nn as nn

from rayspeed.config.shape import ModelShape
from rayspeed.model.families import composition_of, input_stage_of
from rayspeed.model.moe import MoE, RouterStats
from rayspeed.model.output import Routing
from rayspeed.model.parts.head import OutputHead
from rayspeed.model.parts.norms import RMSNorm
from rayspeed.parallel.groups import TensorParallel


class Piece(NamedTuple):
    prefix: str  # where its parameters live in the Transformer's state dict
    cls: type  # what it is (DeepSpeed's "type:Block" partitioning counts these)
    build: Callable[..., nn.Module]
    ties_input: bool = False  # the head reusing the input stage's matrix


def decoder_pieces(dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, activation_checkpointing: str,
                   preserve_rng_state: bool, seed: int, loss_chunk_tokens: Optional[int] = None) -> list[Piece]:
    """The family's decoder, first piece to last, as its composition (rayspeed.model.families) names the parts."""
    model = composition_of(dims.family)
    sp = sequence_parallel
    scale = model.embedding_scale(dims.hidden_size)
    stage = input_stage_of(dims)
    pieces = [Piece("embed", stage, functools.partial(stage.build, dims, tp, sp, seed, scale))]
    pieces += [Piece(f"layers.{i}", model.block, functools.partial(
        model.block, dims, i, tp, sp, activation_checkpointing, preserve_rng_state, seed))
        for i in range(dims.num_layers)]
    norm = final_norm(model.norm)
    pieces.append(Piece("norm", norm, functools.partial(norm, dims.hidden_size, dims.norm_eps, tp, sp)))
    pieces.append(Piece("head", OutputHead, functools.partial(OutputHead, dims, tp, sp, seed,
                                                             loss_chunk_tokens=loss_chunk_tokens),
                        ties_input=dims.tie_embeddings))
    return pieces


@functools.lru_cache(maxsize=None)
def final_norm(norm: type[RMSNorm]) -> type:
    """The family's norm class as the last norm: the `where` that rode beside the hidden states ends here."""
    def forward(self, x):
        return norm.forward(self, x[0] if isinstance(x, tuple) else x)

    return type(f"Final{norm.__name__}", (norm,), {"canonical_prefix": "norm", "forward": forward})


def attach_routing(modules: list[nn.Module], dims: ModelShape, cp: Any = None,
                   pooled: Any = None) -> tuple[Optional[RouterStats], Optional[Routing]]:
    """One collector for the routing of every MoE layer among `modules` (a whole model's, or one stage's) and the
    record naming them: their places among the model's MoE layers (`rows`), and, under a pipeline, the last stage's
    loss that pools every stage's (`pooled`)."""
    if not dims.num_experts:
        return None, None
    stats = RouterStats(dims.num_experts, cp)
    here = [m for module in modules for m in module.modules() if isinstance(m, MoE)]
    for m in here:
        m.stats = stats
    moe_layers = [i for i in range(dims.num_layers) if dims.is_moe(i)]
    rows = None if pooled is None else [moe_layers.index(int(m.name.split(".")[1])) for m in here]
    return stats, Routing(stats, moe_layers, rows=rows, pooled=pooled)


def canonical_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """This stage's parameters under the Transformer's names (`embed.weight`, `layers.3.attn.wq.weight`, ...).

    Lets checkpoints and tests line a pipeline stage up with the one-process model.
    """
    for _, child in module.named_modules():
        prefix = getattr(child, "canonical_prefix", None)
        if prefix is None:
            continue
        for name, param in child.named_parameters():
            yield f"{prefix}.{name}", param
