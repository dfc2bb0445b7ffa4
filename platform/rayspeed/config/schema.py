"""The job file, as typed dataclasses.

Every field carries a docstring right under it (read by `rayspeed config-help` and by error messages
through `field_doc`). "auto" means the planner decides; the resolved config (no "auto" left) is what
gets logged and what the workers run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal, Optional, Union

from rayspeed import families
from rayspeed.config.adapter_keys import AdapterConfig
from rayspeed.config.chaos_keys import ChaosConfig
from rayspeed.config.eval_keys import EvalConfig
from rayspeed.config.grpo_keys import GrpoConfig
from rayspeed.config.objective_keys import DpoConfig
from rayspeed.config.vision_shape import VisionShape, VisionTraining

Auto = Literal["auto"]
AUTO: Final = "auto"


@dataclass
class ModelConfig:
    pretrained: Optional[str] = None
    """A Hugging Face causal LM: a local directory or a hub id (resolved and cached by huggingface_hub as
    transformers does). Its config.json sets the architecture and every shape key below that the job leaves
    unset (one set to a different value is an error naming both); its safetensors weights are the initial
    weights (see model.init). Supported: the model families of rayspeed/families/ (docs/MODELS.md)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """With model.pretrained: start from its weights (pretrained) or from a fresh random initialisation of the
    same architecture (random). train.init_from, when set, overrides the weights either way."""
    architecture: str = families.DEFAULT.architecture
    """Hugging Face architecture of the model, one of the families rayspeed runs (LlamaForCausalLM and the others
    of rayspeed/families/; its record decides q/k/v biases and the rest). The name goes into exported config.json
    files."""
    hidden_size: int = 64
    """Width of the residual stream (h)."""
    num_layers: int = 2
    """Number of transformer blocks (L)."""
    num_heads: int = 4
    """Attention query heads (a); hidden_size must divide by it."""
    num_kv_heads: Optional[int] = None
    """Key/value heads; fewer than num_heads means grouped-query attention. null: same as num_heads."""
    head_dim: Optional[int] = None
    """Width of one attention head. null: hidden_size / num_heads; only a family whose config.json gives its own
    head_dim (model.pretrained fills it) may differ from that."""
    ffn_hidden_size: Optional[int] = None
    """SwiGLU inner width. null: 8/3 * hidden_size rounded up to a multiple of 64."""
    hidden_act: Optional[str] = None
    """The MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU); null: the family's (Gemma's GeGLU,
    silu for the others)."""
    sliding_window: Optional[int] = None
    """Sliding-window attention: a query sees itself and the sliding_window - 1 positions before it, on the layers
    layer_types marks sliding_attention (every layer when layer_types is null). null: full causal attention."""
    layer_types: Optional[list[str]] = None
    """One entry per layer: full_attention or sliding_attention (Gemma 3 alternates five local layers and one
    global; Qwen2's sliding layers are those from max_window_layers on). null: every layer the same."""
    rope_local_theta: Optional[float] = None
    """RoPE base of the sliding-window layers when it differs from rope_theta (Gemma 3: 10000, its global layers
    1e6); they then use plain RoPE (rope_scaling applies to the full-attention layers). null: rope_theta."""
    query_pre_attn_scalar: Optional[float] = None
    """Attention scores are scaled by query_pre_attn_scalar^-0.5 (Gemma). null: head_dim^-0.5."""
    attn_logit_softcapping: Optional[float] = None
    """Attention scores soft-capped by c tanh(x / c) before the softmax (Gemma 2: 50; a family that reads it). The
    scores are then materialised per layer (no fused kernel takes the cap). null: none."""
    final_logit_softcapping: Optional[float] = None
    """Output logits soft-capped the same way before the loss (Gemma 2: 30). null: none."""
    partial_rotary_factor: Optional[float] = None
    """RoPE rotates only this share of each head's dimensions, the first ones (Phi-4-mini: 0.75; a family that
    reads it: Phi-3). null: the whole head."""
    num_experts: int = 0
    """Mixture of experts: routed experts per MoE layer (Qwen3-MoE's num_experts, Mixtral's num_local_experts; a
    family with experts: docs/MODELS.md); 0: a dense model. model.pretrained fills it and the keys below."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k; config.json's num_experts_per_tok)."""
    expert_ffn_hidden_size: Optional[int] = None
    """One expert's SwiGLU inner width (Qwen3-MoE's moe_intermediate_size); null: ffn_hidden_size (Mixtral)."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)."""
    moe_layers: Optional[list[int]] = None
    """The layers whose MLP is a mixture of experts (Qwen3-MoE's decoder_sparse_step and mlp_only_layers leave the
    others dense); null: every layer."""
    router_aux_loss_coef: Optional[float] = None
    """Weight of the load-balancing loss added to the training loss (Switch Transformer's, pooled over the layers
    and tokens of each forward, one micro-batch of one rank, as transformers computes it for its batch; moe/aux_loss
    is its mean over the step's forwards, train/loss stays the language-model loss); null: config.json's
    router_aux_loss_coef (0.001 by default); 0: none."""
    family_keys: Optional[dict[str, Union[str, float, bool, list[float]]]] = None
    """config.json keys only the architecture's family reads, by their config.json names (gpt-oss's swiglu_alpha
    and swiglu_limit: docs/MODELS.md); model.pretrained fills them. null or a key left out: the family's default."""
    image_path: Optional[VisionShape] = None
    """A vision-language checkpoint's image path (LLaVA: its tower's vision_config, the feature layer and strategy,
    the projector, the image placeholder token), as its config.json says; model.pretrained fills it, a job file
    leaves it out. null: a text model."""
    attention_kernel: str = "auto"
    """The kernel of masked and soft-capped attention (sliding windows, packed documents, Gemma 2's cap): auto =
    sdpa; sdpa = PyTorch's SDPA with a dense mask (every tile computed) and the math path for soft-capped scores
    (scores materialised); flex = FlexAttention, compiled, on CUDA: the mask as a function (tiles outside it skipped)
    and the cap as a score modifier, no score matrix (GPU jobs only: torch 2.13 has no FlexAttention backward on CPU;
    not yet measured on a GPU here, so not the default). Plain causal attention is SDPA's fused kernel either way."""
    router_bias_update: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: after every optimizer step each MoE layer's score correction
    (e_score_correction_bias) moves by this speed toward an even load, + speed where an expert took fewer tokens
    than the mean over the step's tokens on every rank, - speed where more (DeepSeek-V3 trained with 0.001); it is
    saved in checkpoints and exported. 0: the corrections stay as loaded. A family with score corrections only."""
    freeze_router: bool = False
    """Keep every MoE layer's router weights as loaded (a fine-tune that must not move the routing; the balance
    loss then trains nothing: set router_aux_loss_coef: 0 with it)."""
    vocab_size: int = 256
    """Vocabulary size (256 with the byte tokenizer)."""
    seq_len: int = 128
    """Tokens per training sequence (s); a job key even with model.pretrained (at most its
    max_position_embeddings)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: Optional[dict[str, Union[str, float, bool, list[float]]]] = None
    """RoPE frequency scaling in config.json's form: {rope_type: linear, factor: 4}, {rope_type: llama3,
    factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}, {rope_type: yarn,
    factor: 4, original_max_position_embeddings: 32768} (beta_fast, beta_slow, attention_factor optional) or
    {rope_type: longrope, original_max_position_embeddings: 4096, long_factor: [...], short_factor: [...]} (one
    factor per pair of head dimensions). null: none."""
    max_position_embeddings: Optional[int] = None
    """Longest sequence the model was made for (config.json's value with model.pretrained); model.seq_len must
    not exceed it. null: no limit."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """Adapter fine-tuning (LoRA, rsLoRA, DoRA, QLoRA) instead of training every parameter."""
    vision: VisionTraining = field(default_factory=VisionTraining)
    """A vision-language model's image path: {train_tower: false, train_projector: true} by default (a text model
    ignores it)."""


@dataclass
class DataConfig:
    source: Literal["python-stdlib", "files", "hf", "tokens"] = "python-stdlib"
    """python-stdlib: the .py files of the running Python's standard library (built-in demo corpus); files: the
    files of `path` (text, JSONL, Parquet, a save_to_disk folder; a .bin is a raw pre-tokenized token file); hf: the
    Hugging Face dataset `dataset`; tokens: token shards already in rayspeed's format (docs/DATA.md 'Token shards')."""
    path: Union[str, list[str], None] = None
    """One or more paths or globs (`**` allowed). source files: .txt (or any other text file: one document each),
    .jsonl and .parquet (one document per record), a folder written by datasets' save_to_disk, or a raw .bin token
    file (uint16; a `<file>.json` sidecar may say {"dtype": "uint32"}; a glob of .bin files is read as tokens, never
    as text). source tokens: .rstok token shards."""
    text_field: str = "text"
    """The field of a JSONL/Parquet/dataset record that holds the document (data.format: text)."""
    dataset: Optional[str] = None
    """source hf: a Hugging Face dataset, a hub name (org/name, read through the datasets library and its cache,
    HF_TOKEN for gated ones) or a local dataset folder."""
    split: str = "train"
    """The split trained on (source hf, or a save_to_disk folder holding several splits)."""
    val_split: Optional[str] = None
    """The source's own validation split (e.g. validation); null: the tail val_fraction of the training data."""
    streaming: bool = False
    """source hf: stream the dataset while tokenizing (nothing is downloaded to disk first: for corpora larger than
    memory or disk); only the token shards are stored."""
    hf_cache_dir: Optional[str] = None
    """Where the datasets library downloads and prepares hf datasets (null: its default, ~/.cache/huggingface).
    On several nodes, a folder every node sees."""
    format: Literal["text", "chat"] = "text"
    """text: documents of text; chat: records with `messages` ([{role, content}, ...]) rendered with the tokenizer's
    chat template, loss on the assistant turns only (dpo: text takes any preference form, chat message lists only)."""
    tokenizer: str = "bytes"
    """bytes (vocab 256), model (the tokenizer saved with model.pretrained), or the path of a Hugging Face
    tokenizer.json or of a tokenizer directory saved by transformers (with its chat template). BOS/EOS as the
    tokenizer defines them; ids stored as uint16 when they fit, else uint32."""
    document_masking: bool = False
    """Documents are packed into sequences, separated by EOS; true: attention never crosses a document boundary
    (positions restart at each document) and the first token of a document is not predicted from the previous
    one."""
    val_fraction: float = 0.01
    """Fraction of the token stream (its tail) held out for validation (when there is no val_split)."""
    cache_dir: str = AUTO
    """Where tokenized corpora (token shards) are cached. auto: <storage.path>/.cache/data."""


@dataclass
class TrainConfig:
    global_batch_size: int = 16
    """Sequences per optimizer step; kept fixed when workers come and go (default batch policy)."""
    max_steps: int = 50
    """Optimizer steps to train."""
    lr: Union[float, Auto] = 3.0e-4
    """Peak learning rate, or auto: the playbook rule from global batch and GPU count."""
    min_lr: Union[float, Auto] = AUTO
    """Learning rate at the end of the cosine decay; auto: lr / 10. Never changed by the planner: above the lr
    the rule gives (lr: auto) it is an error."""
    warmup_steps: int = 5
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold (0 disables)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = AUTO
    """auto: bf16 on GPUs that support it, else fp32."""
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype gradients are accumulated in."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    eval_every_steps: int = 25
    """Validation every N steps (0: only at the end)."""
    eval_batches: int = 4
    """Validation global batches per evaluation."""
    objective: Literal["sft", "dpo", "grpo"] = "sft"
    """sft: next-token loss on the data (text, or chat with the loss on the assistant's tokens); dpo: preference
    tuning on pairs of a prompt with a chosen and a rejected completion (train.dpo; README "Preference tuning");
    grpo: reinforcement learning from reward functions on sampled completions (train.grpo; docs/RL.md)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """The DPO loss and its reference (read with train.objective: dpo)."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """The rollouts, rewards and GRPO loss (read with train.objective: grpo). global_batch_size counts completions."""
    init_from: Optional[str] = None
    """A reloadable model directory (rayspeed export) or models:/<name>@<alias> / models:/<name>/<version>: initial
    weights for a warm start; the optimizer starts fresh."""
    compile: Union[bool, Auto] = AUTO
    """torch.compile the model before DeepSpeed wraps it. auto: on GPUs for layouts without pipeline, ZeRO-3 or
    tensor parallelism (falls back to eager on a compile error); eager on CPU."""
    callbacks: list[str] = field(default_factory=list)
    """Your own training-loop callbacks, each `package.module:Class`: a rayspeed.train.events.Callback subclass
    built with no arguments, importable where the job starts and on every worker (in the job's working dir or an
    installed package). Every rank calls it at step_end, log, validation, before_checkpoint, checkpoint_saved,
    checkpoint_committed, end and failure (docs/ARCHITECTURE.md, "Extension points")."""


@dataclass
class ParallelConfig:
    dp: Union[int, Auto] = AUTO
    """Data-parallel degree: dp x cp x tp x pp = workers."""
    tp: Union[int, Auto] = AUTO
    """Tensor-parallel degree (Megatron-style column/row layers); never spans nodes."""
    pp: Union[int, Auto] = AUTO
    """Pipeline stages."""
    zero_stage: Union[int, Auto] = AUTO
    """DeepSpeed ZeRO stage 0..3 (0 or 1 with pipeline parallel)."""
    micro_batch_size: Union[int, Auto] = AUTO
    """Sequences per worker per forward pass."""
    grad_accum: Union[int, Auto] = AUTO
    """Micro-batches per optimizer step = global_batch_size / (dp * micro_batch_size)."""
    sequence_parallel: Union[bool, Auto] = AUTO
    """Shard norm/dropout regions along the sequence across the tp group (only with tp > 1)."""
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = AUTO
    """none | selective (attention and MLP blocks recomputed) | full (whole blocks recomputed)."""
    cp: Union[int, Auto] = AUTO
    """Context-parallel degree: each sequence split over this many ranks, activations per rank divided by cp (16k+
    tokens). auto: the planner weighs it where every rank keeps 2048+ tokens of each sequence; else 1."""
    ep: Union[int, Auto] = AUTO
    """Expert-parallel degree (a mixture of experts): each MoE layer's experts split over this many data-parallel
    ranks, tokens sent to them by all-to-all; divides dp and model.num_experts. auto: the planner's pick (1 for a
    dense model)."""
    cp_scheme: Literal["auto", "ulysses", "ring"] = AUTO
    """ulysses (all-to-alls; a tp rank's heads split over cp) or ring (k/v go around). auto: ulysses if heads split."""
    stage_layers: Optional[list[int]] = None
    """Transformer blocks per pipeline stage, first to last, e.g. [4, 4, 4, 3] for 15 layers on pp 4 (adding up to
    model.num_layers). null: the planner balances the stages by time (embedding first, head and loss last)."""


@dataclass
class ClusterConfig:
    address: str = AUTO
    """auto: RAY_ADDRESS if set, else a local Ray started for this job; or a Ray address."""
    num_workers: Union[int, list[int]] = 2
    """Training workers (one per GPU on GPU clusters), or [min, max] for elastic training."""
    use_gpu: bool = False
    """One GPU per worker."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves per worker."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources per worker, e.g. {trainer: 1}."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the workers (PACK keeps a node's workers together)."""
    gpu: str = AUTO
    """For planning: h100-sxm-80gb | h100-pcie-80gb | h200 | a100-80gb | a100-40gb | l40s | cpu. auto: detect
    (cpu when use_gpu is false)."""
    gpus_per_node: int = 8
    """Workers (GPUs) per node, for planning a cluster that is not up yet and for keeping tp in a node."""
    num_nodes: int = 1
    """Nodes, for planning a cluster that is not up yet."""
    hardware: dict[str, float] = field(default_factory=dict)
    """Overrides of the planner's hardware table for cluster.gpu, e.g. {memory_gib: 75, inter_node_gbps: 25}
    (see `rayspeed plan --explain` and docs/PLANNER.md for the fields)."""
    profile: Optional[str] = None
    """Path of a hardware profile measured by `rayspeed calibrate --out FILE` on this cluster: the planner's
    GEMM, collective and overhead figures then come from it (precedence: profile > cluster.hardware > the
    built-in table). null: the built-in table."""
    local_num_cpus: Union[int, Auto] = AUTO
    """Logical CPUs a local Ray (started for this job) declares. auto: enough for all workers, even on a
    machine with fewer cores (CPU workers then share cores)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers, on top of the communication profile for the cluster
    size (see `rayspeed doctor --env`); linted before the job starts. Values are strings: quote numbers ("1")."""

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[-1] if isinstance(self.num_workers, list) else self.num_workers

    def effective_min_workers(self, stability_threshold: float) -> int:
        """The fewest workers a (re)start accepts: max(min, ceil(stability_threshold x max)), at most max."""
        import math

        return min(self.max_workers, max(self.min_workers, math.ceil(stability_threshold * self.max_workers - 1e-9)))

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, list) and self.num_workers[0] != self.num_workers[-1]


@dataclass
class ResilienceConfig:
    max_failures: int = 3
    """Restarts after worker, node or collective failures before the job fails."""
    checkpoint_every_steps: int = 10
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Verified checkpoints kept (never fewer than 2)."""
    elastic_monitor_interval_s: float = 300.0
    """How often an elastic job looks for room to grow."""
    batch_policy: Literal["keep_global", "playbook"] = "keep_global"
    """keep_global: same global batch via accumulation; playbook: bsz * (1 - lost/total) ** 0.8, lr rescaled."""
    collective_timeout_s: float = 600.0
    """Process-group timeout: a collective blocked longer than this fails the step instead of hanging."""
    oom_replans: int = 2
    """A step that runs out of device memory re-plans the job onto another layout (that one refused, the memory
    model corrected by what was measured) and resumes from the newest verified checkpoint: at most this many times
    per submission, counted apart from max_failures; then the job fails (exit 1) listing the layouts tried."""
    stability_threshold: float = 0.7
    """Elastic jobs: a job does not (re)start below this fraction of cluster.num_workers' max; the effective
    minimum is max(min, ceil(stability_threshold x max)) workers (`rayspeed plan --explain` shows it). Lower it to
    let a job run on fewer workers."""
    capacity_wait_s: float = 600.0
    """How long a (re)start waits for the effective minimum of workers before the job fails (exit 1)."""
    conversion_timeout_s: float = 3600.0
    """How long the other ranks wait for a universal-checkpoint conversion (after a change of data-parallel size
    or ZeRO stage) before the attempt fails. They wait outside any collective, so this is independent of
    collective_timeout_s."""
    worker_start_timeout_s: float = 30.0
    """How long Ray Train may take to start a worker group before the attempt counts as failed (Ray's
    default, 60 s, is what a restart waits when capacity is gone)."""
    checkpoint_mode: Literal["auto", "sync", "async"] = "auto"
    """sync: training waits while every rank writes, fsyncs, hashes (and uploads) its shards. async: training stops
    only to copy its state into host memory (device -> pinned host copy on GPU, an in-memory copy on CPU); the
    shards are written, made durable and uploaded in the background while the next steps run, and the manifest
    commits only when every rank's files are durable and verified (a crash leaves the previous checkpoint or the
    new one). At most one save is in flight: the next waits for it (the wait counts as stall). The snapshot needs
    host memory for this rank's checkpoint (`rayspeed plan --explain` shows it): a job whose snapshot would not fit
    saves synchronously, saying why in one line. auto: async when the snapshot fits and a rank writes at least
    0.5 GiB (below that a synchronous save is short, and a crash just after it never loses the newest one)."""


@dataclass
class TrackingConfig:
    uri: str = AUTO
    """auto: MLFLOW_TRACKING_URI if set, else sqlite mlflow.db at the repository root."""
    experiment: str = "rayspeed"
    """MLflow experiment name."""
    log_every_steps: int = 10
    """Metrics every N steps (loss is read from the device only then)."""
    system_metrics: bool = True
    """Log CPU/GPU/memory system metrics under system/."""
    charts_every_checkpoints: int = 5
    """Re-render the five dashboard charts (charts/*.png), and a mixture of experts' moe/expert_load/, every N
    checkpoints (0: only at the end)."""
    loss_landscape: bool = True
    """At the end, evaluate the loss around the final weights along random filter-normalised directions."""
    register_model: str = AUTO
    """Registered model name; auto: rayspeed-<name>."""


@dataclass
class StorageConfig:
    path: str = AUTO
    """Checkpoints, summary and Ray Train results, seen by all nodes: an absolute local/NFS path, or an
    object-store URI (s3://bucket/prefix, gs://bucket/prefix, ...; credentials and endpoint from the
    environment, e.g. AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL). auto: <repo>/runs."""
    staging_dir: str = AUTO
    """Node-local folder where checkpoints are written before upload and downloaded before loading, when
    storage.path is a URI (room for one checkpoint per node). auto: $RAYSPEED_STAGING, else <tmp>/rayspeed-staging."""


@dataclass
class HealthConfig:
    preflight: bool = True
    """Bandwidth and environment checks on the job's own workers before step 0."""
    production: bool = True
    """Production run: debug-only knobs (NCCL_DEBUG=INFO/TRACE, CUDA_LAUNCH_BLOCKING, NCCL_P2P_DISABLE, ...) fail
    the environment lint. Set false while debugging."""
    preflight_min_busbw_gbps: float = 0.0
    """Preflight fails when the all-reduce bus bandwidth at its largest message is below this (GB/s); 0: no floor."""
    slow_rank_factor: float = 0.5
    """A rank (or node) is flagged slow when its measurement is below this fraction of the median of the others."""
    fail_on_slow_rank: bool = False
    """Fail the preflight when a rank is flagged slow (default: flag and log it only)."""
    watchdog: Literal["off", "skip", "rollback"] = "skip"
    """On a NaN/Inf loss or a grad-norm spike, checked every step before its update: skip (the update is not applied:
    weights and optimizer state stay as they were, the step's data is consumed), rollback (not applied either, and
    the newest verified checkpoint is restored), or off (applied, nothing checked: no per-step host sync)."""
    grad_norm_spike_factor: float = 10.0
    """A grad norm above this multiple of the median of the recent window is a spike."""
    watchdog_window: int = 20
    """Accepted steps the grad-norm median is taken over."""
    watchdog_max_skips: int = 5
    """Consecutive skipped steps after which the watchdog rolls back instead (0: never escalate)."""


@dataclass
class JobConfig:
    name: str = "job"
    """Job name: MLflow run name, Ray Train run name, checkpoint folder name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The decoder-only transformer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and tokenizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout; each key a value or auto."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Where it runs."""
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    """Checkpoints, restarts, elasticity."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Checkpoint storage."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Preflight checks."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Benchmark evaluation of committed checkpoints (validation loss: train.eval_every_steps)."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Fault injection for drills; off unless set."""
