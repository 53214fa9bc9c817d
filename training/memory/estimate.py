"""Per-GPU memory of a training layout, and a planner for micro-batch size and recomputation.

Static state comes from the real model: :class:`~training.models.gpt.GPTModel` is built on
the meta device (no memory, no init) and every parameter is divided the way the layout
really divides it:

- tensor parallelism: :func:`~training.parallel.tensor_parallel.sharding.partition_spec`
  (the rule the TP backend and checkpoints use); expert weights split over ``parallel.expert``;
- pipeline: :func:`~training.parallel.pipeline_layout.owner_of_parameter` (a tied output head
  is a second copy on the last stage);
- ``fsdp``: FSDP2 ``Shard(0)`` rows, ``ceil(rows / dp)`` per rank, for parameters, gradients
  and AdamW state; ``distributed_optimizer``: AdamW state on each parameter's owner, using the
  optimizer's own :func:`~training.parallel.data_parallel.partition` (the most loaded rank).

Parameters are fp32 in every precision (bf16/fp16 is autocast), so are gradients and the
two AdamW moments; each parameter tensor also has a 4-byte ``step``. Under autocast the
16-bit copies of the matmul weights are saved for backward: a "weight copies" row.
With data parallelism over ddp or distributed_optimizer, DDP's gradient buckets count as
one more fp32 copy of the gradients: despite ``gradient_as_bucket_view=True`` the 1B
recipe peaked at 54.4 GiB with DP=2 ddp against 50.3 GiB on one GPU (benchmarks/
RESULTS.md, the +4.1 GiB of its gradients). FSDP holds two gathered units (the current
and the prefetched) and one unit's unsharded gradients; over pipeline stages, the whole
stage's gathered parameters and gradients (they stay gathered until the step's gradient
reduction). The distributed optimizer's broadcast buffer lives after backward, when the
activations are gone, so it is left out.

Activations, per layer per micro-batch: Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", give ``s·b·h·(34 + 5·a·s/h)`` bytes for a
GPT layer in 16-bit: LayerNorm inputs 4, QKV input 2, Q and K 4, V 2, projection input 2,
MLP input 2, GELU input 8 and output 8, dropout masks 2 (all ·sbh), and ``5·a·s²·b`` for
the softmax scores, their dropout mask and output. :func:`saved_bytes_per_token` counts the
same tensors for *our* block, with these adjustments:

- attention is SDPA; on a GPU in bf16 it runs flash/cuDNN/memory-efficient kernels that
  never store the score matrix (only a fp32 log-sum-exp per head and token), so the
  ``5·a·s/h`` term is dropped in every mode. Megatron's "selective" (recompute the
  attention core) would thus save nothing; ours keeps the outputs of the matmuls and of
  SDPA and recomputes norms, RoPE and the activation (see :mod:`training.models.gpt`);
- GQA: K and V are ``g/n`` of Q; RoPE saves its inputs (the QKV output) as well;
- FFN width F and SwiGLU: the activation saves ``[gate; up]`` (2F) and ``silu(gate)`` (F),
  fc2 saves its input (F); GELU saves its input (F) and fc2 its input (F);
- the residual stream is in the compute dtype, or fp32 with ``model.fp32_residual`` (then
  norm inputs take 4 bytes); dropout masks (1 byte) only with ``model.dropout > 0``;
- tensor parallelism divides the tensors inside the TP regions; sequence parallelism the
  rest too (Megatron's ``10 + 24/t`` becomes ``34/t``); context parallelism divides ``s``;
- ``full`` keeps the block input only; with any recomputation one layer's full set is live
  again during its backward (the "recompute working set");
- pipeline (Megatron's accounting): under 1F1B the first stage holds ``min(p, m)``
  micro-batches in flight, with the interleaved schedule ``p·(1 + (p-1)/(p·v))`` of its
  layers' worth.

The loss buffer: the 16-bit vocab-parallel logits ``[b, s, V/t]`` plus their fp32 copy
plus the fp32 log-softmax cross-entropy saves; with ``model.loss_chunk_tokens`` one
chunk's logits and the fp32 output-weight gradient the fused loss accumulates.

These are estimates of an eager step (``torch.compile`` fuses elementwise ops and saves
less: the 1B recipe peaked at 37.3 GiB compiled against 46.2 eager). Against the eager
peaks measured in benchmarks/RESULTS.md (torch.cuda.max_memory_allocated, 1B recipe,
micro-batch 8): one GPU 49.1 GiB estimated / 50.3 measured, DP=2 ddp 53.2 / 54.4,
ZeRO-1 49.1 / 50.3, TP=2+SP 24.5 / 26.2, TP=4 16.8 / 17.9, PP=2 34.9 / 37.6, PP=4
30.8 / 34.2, TP=2×PP=2 20.4 / 22.5; GPT-2 350M (micro-batch 16) 27.1 / 27.5. The
interleaved schedule is underestimated (PP=2 v=2 41.4 / 46.8, PP=4 v=2 40.5 / 47.0):
torch's schedule holds more warm-up micro-batches than Megatron's formula. The
activation rows are to be checked on a GPU against
``torch.cuda.max_memory_allocated`` of a real step (the CPU allocator cannot be measured
reliably); the static rows are exact for the tensors they count (tests/test_memory.py).

T5 (``model.family: t5``): the meta model is the encoder-decoder, pipeline ranks hold
their share of the encoder's then the decoder's layers (every stage also holds both small
relative-bias tables), the activations count ``S`` encoder and ``T`` decoder tokens with
the cross-attention and the attention masks (:mod:`training.memory.t5`) and the loss
buffer the ``T`` decoder tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from megalith.config import MegalithConfig, ModelConfig
from megalith.errors import MegalithError
from training import models
from training.families import model_family
from training.memory.activations import (
    GIB,
    MODES,
    OVERHEAD_BYTES,
    SAFETY_FRACTION,
    compute_dtype,
    pipeline_in_flight,
)
from training.models.moe import is_expert_param
from training.parallel.data_parallel import partition
from training.parallel.groups import ParallelLayoutError, ParallelSizes, validate_layout
from training.parallel.pipeline_layout import (
    layer_counts,
    pipelined_layers,
)
from training.parallel.tensor_parallel.sharding import check_tensor_parallel, partition_spec

_ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
_STEP_BYTES = 4  # AdamW's per-parameter ``step`` tensor


class MemoryPlanError(MegalithError):
    """A memory question that cannot be answered; the message names the flag or key."""


@dataclass
class StaticMemory:
    """Bytes one rank holds for the whole run (independent of the micro-batch)."""

    params: int = 0  # parameter elements on this rank (after every sharding)
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    weight_copies: int = 0  # 16-bit autocast copies of matmul weights, saved for backward
    buffers: int = 0  # DDP gradient buckets or FSDP all-gather buffers


@dataclass
class MemoryReport:
    """One rank's memory in bytes; ``stage`` is the pipeline rank reported (the fuller one)."""

    stage: int
    micro_batch_size: int
    recompute: str
    static: StaticMemory
    activations: int
    activations_per_layer: int
    loss_buffer: int
    in_flight: float
    total: int = field(init=False)

    def __post_init__(self) -> None:
        s = self.static
        self.total = (
            s.parameters
            + s.gradients
            + s.optimizer
            + s.weight_copies
            + s.buffers
            + self.activations
            + self.loss_buffer
        )

    def rows(self) -> list[tuple[str, int]]:
        s = self.static
        return [
            ("parameters", s.parameters),
            ("gradients", s.gradients),
            ("optimizer state", s.optimizer),
            ("weight copies (autocast)", s.weight_copies),
            ("DDP buckets / FSDP gathers", s.buffers),
            ("activations", self.activations),
            ("logits / loss", self.loss_buffer),
            ("total", self.total),
        ]

    def as_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- layout


def resolve_layout(config: MegalithConfig, world_size: int | None) -> ParallelSizes:
    """The parallel sizes; ``world_size`` None means the smallest data parallel the layout
    allows (1, or what ``parallel.expert`` needs)."""
    parallel = config.parallel
    if world_size is None:
        dp = parallel.expert // math.gcd(parallel.expert, parallel.context)
        world_size = parallel.tensor * parallel.context * parallel.pipeline * dp
    if world_size < 1:
        raise MemoryPlanError(f"--nproc-per-node x --nnodes must be >= 1, got {world_size}")
    if config.model.vocab_size is None:
        raise MemoryPlanError("model.vocab_size must be set to build the model and count it")
    try:
        sizes = validate_layout(config, world_size)
    except ParallelLayoutError as error:
        raise MemoryPlanError(
            f"world {world_size} (--nproc-per-node x --nnodes) with parallel.tensor "
            f"{parallel.tensor}, parallel.context {parallel.context}, parallel.pipeline "
            f"{parallel.pipeline}: {error}"
        ) from None
    if sizes.tp > 1:
        check_tensor_parallel(config.model, sizes.tp)
    return sizes


def meta_model(config: ModelConfig) -> torch.nn.Module:
    """The single-process model of ``config.family`` on the meta device (shapes only;
    torch layers)."""
    return models.meta_model(config.model_copy(update={"backend": "torch"}))


def local_numel(name: str, shape: torch.Size, config: ModelConfig, sizes: ParallelSizes) -> int:
    """Elements of parameter ``name`` this rank holds under TP and EP (before FSDP)."""
    numel = math.prod(shape)
    if sizes.tp > 1 and partition_spec(name, config) is not None:
        numel //= sizes.tp
    if sizes.ep > 1 and is_expert_param(name):
        numel //= sizes.ep
    return numel


def _stage_params(config: MegalithConfig, sizes: ParallelSizes, stage: int):
    """``(name, shape)`` of the parameters pipeline rank ``stage`` holds."""
    model = meta_model(config.model)
    counts = layer_counts(
        pipelined_layers(config.model), sizes.pp, sizes.vpp, config.parallel.pipeline_layers
    )
    tied = config.model.tie_embeddings and sizes.pp > 1
    split = model_family(config).pipeline
    for name, param in model.named_parameters():
        owner = 0 if sizes.pp == 1 else split.owner(name, counts, sizes.pp, config.model)
        copy = (tied and name == "embedding.word.weight" and stage == sizes.pp - 1) or (
            split.on_every_stage(name)  # e.g. every T5 stage holds both relative-bias tables
        )
        if owner == stage or copy:
            yield name, param.shape


def static_memory(config: MegalithConfig, sizes: ParallelSizes, stage: int = 0) -> StaticMemory:
    """Parameters, gradients, AdamW state and buffers of one rank of pipeline stage ``stage``."""
    mode = config.parallel.data_parallel_mode
    dp = sizes.dp * sizes.cp  # gradients are averaged over data x context
    half = compute_dtype(config) != "fp32"
    out = StaticMemory()
    sizes_local, experts, tensors = [], [], 0
    block_numel: dict[str, int] = {}  # whole elements per FSDP unit (layers.i, or the root)
    for name, shape in _stage_params(config, sizes, stage):
        numel = local_numel(name, shape, config.model, sizes)
        if mode == "fsdp" and dp > 1:
            unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else ""
            block_numel[unit] = block_numel.get(unit, 0) + numel
            rows = shape[0] if len(shape) else 1
            if sizes.ep > 1 and is_expert_param(name):
                rows //= sizes.ep  # this EP rank's experts, split over expert-data ranks
                shard = dp // sizes.ep
            else:
                shard = dp
            numel = math.ceil(rows / shard) * (numel // max(rows, 1))
        sizes_local.append(numel)
        experts.append(sizes.ep > 1 and is_expert_param(name))
        tensors += 1
        if half and len(shape) >= 2 and not name.startswith("embedding."):
            out.weight_copies += 2 * local_numel(name, shape, config.model, sizes)
    out.params = sum(sizes_local)
    out.parameters = out.gradients = 4 * out.params
    out.optimizer = _ADAM_BYTES * out.params + _STEP_BYTES * tensors
    if mode == "distributed_optimizer" and dp > 1:
        loads, counts = _owned_per_rank(sizes_local, experts, dp, sizes.ep)
        busiest = max(range(dp), key=lambda r: loads[r])
        out.optimizer = _ADAM_BYTES * loads[busiest] + _STEP_BYTES * counts[busiest]
    if mode in ("ddp", "distributed_optimizer") and dp > 1:
        out.buffers = 4 * out.params  # DDP's gradient buckets (measured: see the docstring)
    if mode == "fsdp" and dp > 1 and sizes.pp > 1:
        # Pipeline stages hold FSDP's gathers from the first backward to the step's one
        # gradient reduction (torch's PipelineStage leaves every micro-batch's backward
        # unsharded and unreduced): the stage's whole parameters and gradients. 1B recipe,
        # PP=2 x DP=2, micro-batch 8, 1F1B: 34.9 GiB estimated, 34.7 measured on H100 and
        # H200 (DDP: 37.0 estimated, 37.1 measured on H100); the previous rule gave 31.5.
        out.buffers = 4 * 2 * sum(block_numel.values())
    elif mode == "fsdp" and dp > 1:
        # Two gathered units in flight (current + prefetched) and one unit's full gradients.
        out.buffers = 4 * 3 * max(block_numel.values())
    return out


def _owned_per_rank(
    numels: list[int], experts: list[bool], dp: int, ep: int
) -> tuple[list[int], list[int]]:
    """Elements and tensors whose AdamW state each data × context rank owns under the
    distributed optimizer: dense tensors partitioned over all ``dp`` ranks, expert tensors
    over their ``dp / ep`` expert-data-parallel ranks (data-parallel rank ``r`` is in
    expert-data-parallel rank ``r // ep``), as ``data_parallel.DistributedOptimizer``."""
    loads, counts = [0] * dp, [0] * dp
    for is_expert, ranks in ((False, dp), (True, dp // ep)):
        mine = [n for n, e in zip(numels, experts, strict=True) if e == is_expert]
        for numel, owner in zip(mine, partition(mine, ranks), strict=True):
            holders = range(owner * ep, (owner + 1) * ep) if is_expert else (owner,)
            for rank in holders:
                loads[rank] += numel
                counts[rank] += 1
    return loads, counts


# --------------------------------------------------------------------------- activations


def in_flight_micro_batches(config: MegalithConfig, sizes: ParallelSizes, mbs: int) -> float:
    """:func:`~training.memory.activations.pipeline_in_flight` of this layout's
    micro-batches per step."""
    m = max(1, config.training.global_batch_size // (mbs * sizes.dp))
    return pipeline_in_flight(sizes.pp, sizes.vpp, m)


def loss_buffer_bytes(config: MegalithConfig, sizes: ParallelSizes, mbs: int) -> int:
    """Vocab-parallel logits, their fp32 copy and the fp32 log-softmax, one micro-batch;
    with ``model.loss_chunk_tokens`` (plain head) one chunk's logits (16-bit and fp32)
    plus the fp32 gradient of the output weight it accumulates."""
    tokens = model_family(config).memory.loss_tokens(config, sizes, mbs)
    chunk = config.model.loss_chunk_tokens
    if chunk and sizes.tp == 1:
        per_logit = 4 if compute_dtype(config) == "fp32" else 2 + 4
        weight_grad = config.model.vocab_size * config.model.hidden_size * 4
        return min(chunk, tokens) * config.model.vocab_size * per_logit + weight_grad
    per_logit = 4 + 4 if compute_dtype(config) == "fp32" else 2 + 4 + 4
    return tokens * config.model.vocab_size // sizes.tp * per_logit


def memory_report(
    config: MegalithConfig,
    sizes: ParallelSizes,
    *,
    micro_batch_size: int | None = None,
    recompute: str | None = None,
    statics: dict[int, StaticMemory] | None = None,
) -> MemoryReport:
    """The fuller of the first and the last pipeline stage (one rank of it).

    ``statics`` (from :func:`stage_statics`) saves rebuilding the meta model per call."""
    mbs = config.training.micro_batch_size if micro_batch_size is None else micro_batch_size
    recompute = recompute or config.model.activation_checkpointing
    statics = statics or stage_statics(config, sizes)
    reports = [
        _stage_report(config, sizes, stage, mbs, recompute, static)
        for stage, static in statics.items()
    ]
    return max(reports, key=lambda report: report.total)


def stage_statics(config: MegalithConfig, sizes: ParallelSizes) -> dict[int, StaticMemory]:
    """Static memory of the first and the last pipeline stage (the same one without PP)."""
    return {stage: static_memory(config, sizes, stage) for stage in sorted({0, sizes.pp - 1})}


def _stage_report(
    config: MegalithConfig,
    sizes: ParallelSizes,
    stage: int,
    mbs: int,
    recompute: str,
    static: StaticMemory,
) -> MemoryReport:
    in_flight = in_flight_micro_batches(config, sizes, mbs) if stage == 0 else 1.0
    activations, per_layer = model_family(config).memory.stage_activations(
        config, sizes, stage, mbs, recompute, in_flight
    )
    loss = loss_buffer_bytes(config, sizes, mbs) if stage == sizes.pp - 1 else 0
    return MemoryReport(
        stage=stage,
        micro_batch_size=mbs,
        recompute=recompute,
        static=static,
        activations=int(activations),
        activations_per_layer=int(per_layer),
        loss_buffer=loss,
        in_flight=in_flight,
    )


# --------------------------------------------------------------------------- planner


def usable_bytes(gpu_bytes: int) -> int:
    """What the planner lets a layout use: 90% of the device less 1.5 GiB."""
    if gpu_bytes <= 0:
        raise MemoryPlanError(f"--gpu-memory-gib must be > 0, got {gpu_bytes / GIB:g}")
    return int(gpu_bytes * (1 - SAFETY_FRACTION)) - OVERHEAD_BYTES


def largest_micro_batch(
    config: MegalithConfig, sizes: ParallelSizes, recompute: str, budget: int, limit: int = 4096
) -> int:
    """The largest micro-batch (<= ``limit``) whose total fits ``budget``; 0 if none does.
    Memory grows with the micro-batch, so a binary search is exact."""

    statics = stage_statics(config, sizes)

    def fits(mbs: int) -> bool:
        report = memory_report(
            config, sizes, micro_batch_size=mbs, recompute=recompute, statics=statics
        )
        return report.total <= budget

    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


@dataclass
class Plan:
    gpu_bytes: int
    usable_bytes: int
    largest: dict[str, int]  # recompute mode -> largest micro-batch that fits (0: none)
    recompute: str | None
    micro_batch_size: int
    reason: str


def plan(config: MegalithConfig, sizes: ParallelSizes, gpu_bytes: int) -> Plan:
    """The largest micro-batch per recomputation mode, and a recommendation.

    Rule: the least recomputation (none, then selective, then full) that fits the
    configured micro-batch, at the configured micro-batch (no extra FLOPs, same global
    batch arithmetic). If no mode fits it, the mode that fits the largest micro-batch
    (ties to less recomputation), at that micro-batch; gradient accumulation keeps the
    global batch. If not even a micro-batch of 1 fits, no recommendation. The largest
    micro-batches ignore ``training.global_batch_size`` divisibility: pick a divisor.
    """
    budget = usable_bytes(gpu_bytes)
    largest = {mode: largest_micro_batch(config, sizes, mode, budget) for mode in MODES}
    wanted = config.training.micro_batch_size
    for mode in MODES:
        if largest[mode] >= wanted:
            reason = f"least recomputation that fits the configured micro-batch {wanted}"
            return Plan(gpu_bytes, budget, largest, mode, wanted, reason)
    best = max(MODES, key=lambda mode: (largest[mode], -MODES.index(mode)))
    if largest[best] == 0:
        reason = (
            "nothing fits a micro-batch of 1: raise parallel.tensor or parallel.pipeline, "
            "or use parallel.data_parallel_mode=fsdp/distributed_optimizer"
        )
        return Plan(gpu_bytes, budget, largest, None, 0, reason)
    reason = f"the configured micro-batch {wanted} does not fit; the largest that does"
    return Plan(gpu_bytes, budget, largest, best, largest[best], reason)


def detected_gpu_bytes() -> int | None:
    """Total memory of CUDA device 0, or None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def format_report(report: MemoryReport, sizes: ParallelSizes, config: MegalithConfig) -> str:
    """An aligned table in GiB."""
    head = (
        f"{sizes.describe()}; {config.parallel.data_parallel_mode}, "
        f"{compute_dtype(config)}, recompute {report.recompute}, "
        f"micro-batch {report.micro_batch_size} x seq "
        f"{model_family(config).memory.sample_shape(config.data)}; "
        f"pipeline stage {report.stage}"
    )
    lines = [head, f"  {'per GPU':<28}{'GiB':>10}"]
    for label, value in report.rows():
        lines.append(f"  {label:<28}{value / GIB:>10.2f}")
    lines.append(
        f"  ({report.static.params:,} parameter elements on this rank; activations "
        f"{report.activations_per_layer / GIB:.3f} GiB per layer per micro-batch, "
        f"x{report.in_flight:g} in flight)"
    )
    return "\n".join(lines)


def format_plan(result: Plan) -> str:
    lines = [
        f"planner: {result.gpu_bytes / GIB:.1f} GiB GPU, {result.usable_bytes / GIB:.1f} GiB "
        f"usable ({SAFETY_FRACTION:.0%} margin + {OVERHEAD_BYTES / GIB:g} GiB overhead)",
        f"  {'recompute':<12}{'largest micro-batch':>20}",
    ]
    for mode, mbs in result.largest.items():
        lines.append(f"  {mode:<12}{mbs if mbs else 'does not fit':>20}")
    if result.recompute is None:
        lines.append(f"  recommended: none ({result.reason})")
    else:
        lines.append(
            f"  recommended: model.activation_checkpointing={result.recompute} "
            f"training.micro_batch_size={result.micro_batch_size} ({result.reason})"
        )
    return "\n".join(lines)


def check_gpu_flag(gib: float | None) -> int:
    """Bytes from ``--gpu-memory-gib`` or the detected device; a clear error otherwise."""
    if gib is None:
        detected = detected_gpu_bytes()
        if detected is None:
            raise MemoryPlanError("no CUDA device detected: pass --gpu-memory-gib")
        return detected
    if gib <= 0:
        raise MemoryPlanError(f"--gpu-memory-gib must be > 0, got {gib:g}")
    return int(gib * GIB)


__all__ = [
    "MemoryPlanError",
    "MemoryReport",
    "Plan",
    "memory_report",
    "plan",
    "resolve_layout",
    "static_memory",
]
