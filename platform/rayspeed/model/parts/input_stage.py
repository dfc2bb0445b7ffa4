"""The input stage: what turns a micro-batch into the first block's hidden states. A text model's is the token
embedding (times the family's scale); a vision-language family's replaces it with one that also takes the images'
features and writes their projections at the image tokens' places (its own part, over this one).

    stage = TokenInput.build(dims, tp, sequence_parallel, seed, scale)
    hidden = stage(input_ids, **inputs)      # inputs: what the family's stage takes besides the ids (none here)
    hidden, where = stage((input_ids, where))   # as the decoder's first piece: what attention needs rides along
"""

from __future__ import annotations

from typing import Any, Optional

from rayspeed.config.shape import ModelShape
from rayspeed.parallel.groups import TensorParallel
from rayspeed.parallel.layers import VocabParallelEmbedding


class TokenInput(VocabParallelEmbedding):
    canonical_prefix = "embed"  # where its matrix lives in the Transformer's state dict, on any pipeline stage

    @classmethod
    def build(cls, dims: ModelShape, tp: TensorParallel, sequence_parallel: bool, seed: int,
              scale: Optional[float]) -> "TokenInput":
        return cls(dims.vocab_size, dims.hidden_size, tp, sequence_parallel=sequence_parallel,
                   init_std=dims.init_std, seed=seed, name="embed", scale=scale)

    def forward(self, input_ids: Any, **inputs: Any) -> Any:
        if isinstance(input_ids, tuple):
            ids, where = input_ids
            return self.forward(ids, **inputs), where
        if inputs:
            raise TypeError(f"a text model's input stage takes token ids only, not {sorted(inputs)}")
        return super().forward(input_ids)
