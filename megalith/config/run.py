"""The sections of a training run: parallelism, the loop, optimizer and schedule, precision,
checkpoints, logging, promotion and fine-tuning."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from megalith.config.base import StrictModel

# The GEMMs of a transformer block whose tensor-parallel communication Transformer Engine's
# userbuffers can overlap (``te.initialize_ub``'s names).
UserbufferGemm = Literal[
    "qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
    "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad",
]  # fmt: skip


class UserbufferSettings(StrictModel):
    """How one GEMM overlaps its communication (an entry of TE's ``initialize_ub``
    ``ub_cfgs``, as Megatron-LM's ``--tp-comm-overlap-cfg`` file holds them); unset fields
    keep TE's defaults."""

    method: Literal["ring_exchange", "pipeline", "bulk", "external"] | None = Field(
        default=None,
        description="ring_exchange: point-to-point chunks, the GEMM reduces; pipeline: the "
        "GEMM in num_splits chunks, a reduction kernel on num_sm SMs beside it.",
    )
    num_sm: int | None = Field(default=None, ge=1, le=264, description="SMs for the copies.")
    cga_size: int | None = Field(default=None, ge=1, le=16)
    num_splits: int | None = Field(default=None, ge=1, le=64)
    set_sm_margin: bool | None = None
    atomic_gemm: bool | None = None
    aggregate: bool | None = None
    use_ce: bool | None = Field(default=None, description="Copy engines for the transfers.")
    fp8_buf: bool | None = None


class ParallelConfig(StrictModel):
    """How the model and data are split over GPUs; data parallel fills the rest of the world.

    world = tensor · context · pipeline · data, ranks ordered tensor-innermost (Megatron's
    order), so tensor-parallel peers share a node. Expert parallelism is carved out of
    data · context for the MoE layers.
    """

    tensor: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    pipeline: int = Field(default=1, ge=1, description="Pipeline stages.")
    virtual_pipeline: int | None = Field(
        default=None, ge=1, description="Model chunks per pipeline rank (interleaved schedule)."
    )
    context: int = Field(default=1, ge=1, description="Context-parallel size (sequence split).")
    expert: int = Field(default=1, ge=1, description="Expert-parallel size for MoE layers.")
    sequence_parallel: bool = Field(
        default=False, description="With tensor > 1: norms and dropout on sequence shards."
    )
    async_tensor_parallel: bool = Field(
        default=False,
        description="With sequence_parallel and training.compile on CUDA: Inductor splits each "
        "all-gather and reduce-scatter of the TP linears into pieces overlapped with the "
        "matmul (torch's async TP, symmetric memory).",
    )
    tp_comm_overlap: bool = Field(
        default=False,
        description="With model.backend=te, sequence_parallel and CUDA: Transformer Engine "
        "overlaps each all-gather and reduce-scatter of the TP linears with their GEMMs "
        "through userbuffers; every training micro-batch must then be "
        "training.micro_batch_size x data.seq_length tokens.",
    )
    tp_comm_overlap_config: dict[UserbufferGemm, UserbufferSettings] = Field(
        default_factory=dict,
        description="Per GEMM, how parallel.tp_comm_overlap overlaps it (TE's ub_cfgs, e.g. "
        "{proj_fprop: {method: ring_exchange}}); GEMMs not named keep TE's defaults.",
    )
    data_parallel_mode: Literal["ddp", "distributed_optimizer", "fsdp"] = Field(
        default="ddp",
        description="ddp: bucketed all-reduce overlapped with backward; distributed_optimizer: "
        "optimizer state sharded over data-parallel ranks (ZeRO-1/2); fsdp: FSDP2.",
    )
    ddp_bucket_mb: float = Field(default=25.0, gt=0, le=16384, description="Gradient bucket size.")
    pipeline_schedule: Literal["1f1b", "interleaved", "zero-bubble"] = Field(
        default="1f1b",
        description="1f1b; interleaved (needs virtual_pipeline >= 2); zero-bubble (ZB1P: weight "
        "gradients deferred into the bubble, any virtual_pipeline).",
    )
    pipeline_layers: Literal["even", "balanced"] | list[int] = Field(
        default="even",
        description="Layers per virtual pipeline stage: even; balanced (embedding and output "
        "head count as a layer each); or a list of counts (training.parallel.pipeline_layout).",
    )


class TrainingConfig(StrictModel):
    """The training loop: batch sizes, length, evaluation cadence, device."""

    micro_batch_size: int = Field(
        default=4, ge=1, le=1 << 20, description="Samples per forward pass."
    )
    global_batch_size: int = Field(
        default=8,
        ge=1,
        le=1 << 24,
        description="Samples per optimizer step (gradient accumulation fills it).",
    )
    train_iters: int = Field(default=100, ge=1, description="Optimizer steps.")
    eval_interval: int = Field(default=50, ge=0, description="Steps between validation; 0: never.")
    eval_iters: int = Field(default=4, ge=1, description="Validation micro-batches per evaluation.")
    log_interval: int = Field(default=1, ge=1)
    seed: int = 1234
    grad_clip: float = Field(default=1.0, ge=0.0, description="Max global grad norm; 0: off.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = Field(default=False, description="torch.compile the model.")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        default="inductor",
        description="torch.compile's backend: inductor generates fused kernels (the speed); "
        "aot_eager traces the same graphs (dynamo and AOT autograd) and runs them eagerly, "
        "without code generation: for telling a compile problem from a kernel one, and "
        "fast compiled runs on CPU.",
    )
    compile_mode: Literal["default", "reduce-overhead"] = Field(
        default="default",
        description="torch.compile's mode: reduce-overhead replays the compiled forward and "
        "backward as CUDA graphs (torch's CUDA graph trees), so the host no longer launches "
        "each kernel: for models small enough that launching bounds the step (T5-base, "
        "GPT-2 sizes); one GPU, torch kernels (bf16 or torchao's fp8), Inductor only "
        "(gradient accumulation works: the gradients are kept outside the graphs' memory).",
    )
    num_workers: int = Field(default=1, ge=0, le=256, description="DataLoader worker processes.")

    @model_validator(mode="after")
    def _check_batches(self) -> TrainingConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size {self.micro_batch_size}"
            )
        return self


class OptimizerConfig(StrictModel):
    """AdamW with decoupled weight decay (none on norms, biases and embeddings)."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(default=3e-4, gt=0)
    min_lr: float = Field(default=3e-5, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    fused: bool | None = Field(default=None, description="None: fused when on CUDA.")
    multi_tensor: bool | None = Field(
        default=None,
        description="The fused step as one Triton launch a parameter group "
        "(training.optim.multi_tensor_adamw) instead of torch's fused kernel; None: where "
        "the step would be fused and every parameter is a plain fp32 CUDA tensor (8.9 ms "
        "against torch's 11.7 at the 1B shape on an H200, benchmarks/RESULTS.md).",
    )


class SchedulerConfig(StrictModel):
    """Learning-rate schedule: linear warmup, then cosine, warmup-stable-decay or constant."""

    name: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_iters: int = Field(default=10, ge=0)
    decay_iters: int | None = Field(default=None, ge=1, description="None: training.train_iters.")
    wsd_decay_fraction: float = Field(
        default=0.2, gt=0, le=1, description="WSD: share of steps spent decaying at the end."
    )


class MixedPrecisionConfig(StrictModel):
    """Compute precision. ``auto``: bf16 on CUDA, fp32 on CPU (bf16 everywhere with fp8).

    ``fp8``: the transformer blocks' matrix products run in float8 on top of bf16
    autocast (:mod:`training.precision.fp8`): with ``model.backend`` torch through torchao's
    float8 training (``megalith[gpu]``), with the Transformer Engine backend under TE's
    fp8 autocast. Weights, gradients, optimizer state, checkpoints and model packages
    keep their bf16/fp32 whole-tensor format; only the matmul inputs are cast.
    ``fp8_recipe`` picks the scaling: ``tensorwise`` (one dynamic scale per tensor;
    torchao's tensorwise recipe, TE's Float8CurrentScaling), ``rowwise`` (a scale per
    row; torchao only) or ``delayed`` (scales from an amax history; TE's DelayedScaling,
    TE only).
    """

    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    initial_loss_scale: float = Field(default=2.0**16, gt=0, description="fp16 only.")
    loss_scale_growth_interval: int = Field(default=1000, ge=1, description="fp16 only.")
    fp8: bool = Field(
        default=False,
        description="float8 matmuls in the transformer blocks (needs bf16 compute; "
        "torchao with model.backend torch, Transformer Engine with te).",
    )
    fp8_recipe: Literal["tensorwise", "rowwise", "delayed"] = Field(
        default="tensorwise",
        description="float8 scaling: tensorwise (torchao, TE current scaling), rowwise "
        "(torchao only), delayed (TE only).",
    )
    fp8_weight_cache: bool = Field(
        default=True,
        description="torchao tensorwise: cast each weight to float8 once a step, not in "
        "every forward and backward (the same bits, 1 byte a weight more memory; "
        "training.precision.float8_weights). Not under FSDP or in tensor-parallel linears.",
    )

    @model_validator(mode="after")
    def _check_fp8(self) -> MixedPrecisionConfig:
        if self.fp8 and self.dtype in ("fp16", "fp32"):
            raise ValueError(
                f"fp8 needs bf16 compute, got dtype {self.dtype}: set mixed_precision.dtype "
                "to bf16 (or auto), or mixed_precision.fp8 to false"
            )
        return self


class CheckpointConfig(StrictModel):
    """Where and how often checkpoints are written (safetensors + JSON, never pickle)."""

    interval: int = Field(
        default=0, ge=0, description="Steps between checkpoints; 0: only at the end."
    )
    keep_last: int = Field(default=3, ge=1)
    directory: str | None = Field(default=None, description="None: OUTPUT/checkpoints.")
    resume: bool = Field(default=False, description="Continue from the latest checkpoint.")
    sign: bool | None = Field(
        default=None,
        description="Sign each checkpoint (HMAC with MEGALITH_SIGNING_KEY, or Ed25519 with a "
        "private key, MEGALITH_ED25519_PRIVATE_KEY); None: when a key is set.",
    )
    require_signature: bool = Field(
        default=False,
        description="Refuse to resume or fine-tune from an unsigned or wrongly signed "
        "checkpoint (MEGALITH_REQUIRE_SIGNATURE=1 asks the same of every loader).",
    )
    async_save: bool = Field(
        default=True,
        description="Write checkpoints in a background thread: training waits only while "
        "this rank's shards are copied to host memory; at most one save in flight.",
    )


class LoggingConfig(StrictModel):
    """Experiment tracking. MLFLOW_TRACKING_URI overrides tracking_uri."""

    mlflow: bool = True
    tracking_uri: str | None = Field(
        default=None,
        description="None: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory.",
    )
    experiment: str = "megalith"
    run_name: str | None = None
    registered_model: str = Field(
        default="megalith-demo", description="Registry name for the trained model."
    )


class MetricRule(StrictModel):
    """One eval metric the promotion gate compares (``registry.promotion``).

    ``margin``: the candidate must beat the champion by at least this fraction of the
    champion's value (0.01 = 1% better). ``max_regression``: the candidate may be worse by
    at most this fraction. A rule with neither only reports the metric."""

    metric: str = Field(description="Eval metric name, e.g. valid_perplexity, sample_facts_acc.")
    goal: Literal["min", "max"] = Field(description="min: lower is better; max: higher is.")
    margin: float | None = Field(default=None, ge=0)
    max_regression: float | None = Field(default=None, ge=0)


class PromotionConfig(StrictModel):
    """When a ``candidate`` may replace the ``champion`` (``megalith registry gate``)."""

    rules: list[MetricRule] = Field(
        default_factory=lambda: [
            MetricRule(metric="valid_perplexity", goal="min", margin=0.0),
            MetricRule(metric="sample_facts_acc_norm", goal="max", max_regression=0.05),
        ],
        description="Every rule must pass; a candidate without one of the metrics is refused.",
    )


class LoRAConfig(StrictModel):
    """Low-rank adapters (Hu et al. 2021): ``y = W x + (alpha/rank) · B A dropout(x)``.

    The base weights stay frozen and only ``A`` and ``B`` train (``B`` starts at zero, so
    the fine-tuned model starts as the base). Under tensor parallelism the adapters follow
    their base layer (Megatron/NeMo): on a column-parallel base ``A`` is replicated and
    ``B`` split on the output; on a row-parallel base ``A`` is split on the input, its
    partial product reduced like the base's, and ``B`` replicated (training.finetune.lora).
    """

    rank: int = Field(default=8, ge=1, le=65536, description="Rank r of the update B·A.")
    alpha: float = Field(default=16.0, gt=0, description="The update is scaled by alpha / rank.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input only."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["qkv", "proj", "fc1", "fc2"],
        min_length=1,
        description="Linear layers that get adapters, by module name: qkv, proj (attention), "
        "fc1, fc2 (MLP); every layer's module of that name.",
    )


class FinetuneConfig(StrictModel):
    """Fine-tuning: start from trained weights instead of a random init.

    ``base`` is where the weights come from: a Megalith checkpoint (a ``step-*``
    directory or a checkpoints root, v1 or v2: model weights only; the optimizer and
    the step start afresh), a model package directory, a registered model
    (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``) or a Hugging Face Llama/GPT-2
    directory. The model's architecture comes from the base; ``model`` keys set in the
    recipe must agree with it (runtime keys such as dropout or activation_checkpointing
    may differ). ``lora`` unset: full-parameter fine-tuning.
    """

    base: str | None = Field(
        default=None,
        description="The starting point: checkpoint dir, package dir, models:/NAME@ALIAS or "
        "an HF directory; None: pretraining from a random init.",
    )
    lora: LoRAConfig | None = Field(
        default=None, description="Low-rank adapters; None: every parameter trains."
    )

    @model_validator(mode="after")
    def _lora_needs_base(self) -> FinetuneConfig:
        if self.lora is not None and self.base is None:
            raise ValueError("finetune.lora needs finetune.base: adapters train on a base model")
        return self
