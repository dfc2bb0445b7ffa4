"""The output head: logits over the tp-split vocabulary, optionally the embedding's matrix, and the loss without full
logits."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayspeed.config.shape import ModelShape
from rayspeed.parallel.comm import gather_from_tp
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import NO_TP, VocabParallelEmbedding, enter_tp_region, sharded_parameter
from rayspeed.parallel.loss import linear_cross_entropy, softcap


class OutputHead(nn.Module):
    """Logits over the (tp-split) vocabulary, optionally reusing the embedding matrix.

    The loss path never builds full logits: tp=1 runs the chunked CE, tp>1 keeps this
    rank's vocab slice and uses the vocab-parallel CE. As the decoder's last piece (rayspeed.model.decoder) it
    returns (its input in the tp region, its matrix), what a pipeline's last stage hands its loss.
    """

    canonical_prefix = "head"

    def __init__(
        self,
        cfg,
        tp: Optional[TensorParallel] = None,
        sequence_parallel: bool = False,
        seed: int = 0,
        tied_weight: Optional[nn.Parameter] = None,
        loss_chunk_tokens: Optional[int] = None,
    ):
        super().__init__()
        dims = ModelShape.from_config(cfg)
        self.tp = tp or NO_TP
        self.sequence_parallel = sequence_parallel and self.tp.enabled
        self.chunk_tokens = loss_chunk_tokens
        self.cap = dims.final_logit_softcapping
        self.tied = tied_weight is not None
        if tied_weight is not None:
            self.weight = tied_weight  # same Parameter object as the embedding's: shared storage
        else:
            self.weight = sharded_parameter(
                (dims.vocab_size, dims.hidden_size), 0, self.tp, std=dims.init_std, seed=seed, key="head.weight"
            )

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Full-sequence, tp-region input for the vocab-split matmul."""
        return enter_tp_region(x, self.tp, self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prepare(x), self.weight

    @staticmethod
    def tied_output(embedding: VocabParallelEmbedding, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a tied head returns when the stage holds only the embedding (a pipeline's last stage)."""
        return enter_tp_region(x, embedding.tp, embedding.sequence_parallel), embedding.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Full logits [batch, seq, vocab] (gathered over tp): for inference and tests, not training."""
        return softcap(gather_from_tp(F.linear(self.prepare(x), self.weight), self.tp), self.cap)

    def loss(self, x: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return linear_cross_entropy(self.prepare(x), self.weight, labels, self.tp, chunk_tokens=self.chunk_tokens,
                                    cap=self.cap, reduction=reduction)
