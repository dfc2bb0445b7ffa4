"""What a model forward hands its objective, and what a model says about its routing: records, so the training
step and the trainer read declared fields instead of probing a module for attributes.

    out = engine(ids, labels, parts=True)   # ModelOutput(loss, language, balance, aux)
    engine.backward(out.loss)               # what trains: the language loss and a mixture's balance term
    report(out.language)                    # what train/loss and val/loss are

A NamedTuple: DeepSpeed's ZeRO-3 walks a forward's output and rebuilds tuples (named ones too) around the tensors
it hooks; it would leave another record's tensors unhooked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch


class ModelOutput(NamedTuple):
    loss: torch.Tensor
    """What trains: the language loss plus a mixture of experts' weighted balance term (transformers' loss with
    output_router_logits)."""
    language: torch.Tensor
    """The language-model loss alone, what train/loss and val/loss report."""
    balance: Optional[torch.Tensor] = None
    """The weighted balance term in `loss`, with its graph (None: a dense model)."""
    aux: Optional[torch.Tensor] = None
    """The unweighted balance loss of the forward, detached (None: a dense model)."""


@dataclass
class Routing:
    """A mixture of experts' routing statistics, for the moe/* metrics and the expert-load artifacts."""
    stats: Any
    """The RouterStats its MoE layers report to (one per model; under a pipeline one per stage)."""
    moe_layers: list[int]
    """The model's MoE layers, in order."""
    rows: Optional[list[int]] = None
    """Under a pipeline: this stage's MoE layers' places in moe_layers (None: every layer is here)."""
    pooled: Any = None
    """Under a pipeline: the last stage's loss function, which pools the balance loss of every stage."""
