"""The parts a family's decoder is composed from (rayspeed.model.families): norms, attention, MLPs, blocks and the
output head, plain modules built from the ModelShape (the mixture of experts and its routing rules are
model/moe.py and model/routers.py). The tensor-parallel split is still inside the projections
(parallel/layers.py); each part's parameter names are the checkpoint map's (`attn.wq.weight`, `mlp_norm.weight`).

    norms.py            RMSNorm (weight after the cast), Fp32WeightRMSNorm (OLMo 2), OffsetRMSNorm (Gemma's 1 + w),
                        ProjectionNorm (over a whole projection split by tp)
    self_attention.py   Attention (GQA, RoPE, masks; `core` a family may replace), QKNormAttention (per-head q/k
                        norms), ProjectionNormAttention (q/k norms over the projections), SinkAttention
    mlp.py              MLP (SwiGLU or GeGLU) and its row tiles
    blocks.py           Block (pre-norm), SandwichBlock (pre- and post-norms), PostNormBlock (branch outputs
                        normalised); recomputation modes
    head.py             OutputHead (vocab-parallel logits and chunked cross entropy)
    input_stage.py      TokenInput: what turns the ids (and a family's other inputs) into the first hidden states
"""
