"""The layout planner: memory per GPU and step time of a parallel layout, and a search.

Plain arithmetic on the recipe's shapes (no torch, no model built), so that a 405B
model on 16k GPUs is planned in seconds. Memory follows :mod:`training.memory.estimate`'s
accounting (fp32 parameters, gradients and AdamW moments, 16-bit weight copies, DDP
buckets or FSDP gathers; activations from :func:`saved_bytes_per_token`; the loss
buffer; Megatron's in-flight micro-batches), with parameter counts from the shapes
instead of the meta model. Time per optimizer step on the critical pipeline stage:

- compute: FLOPs / (bf16 peak × :func:`compute_efficiency`) × the measured
  recomputation cost, / the measured fp8 speed-up;
- tensor parallelism: per layer and micro-batch 4 all-reduces (or all-gather +
  reduce-scatter pairs with SP, the same volume) of ``b·s/cp·h`` bf16 values, 2(t-1)/t
  of it over NVLink inside a node (InfiniBand if t spans nodes); full recomputation
  repeats the forward pair; not overlapped;
- context parallelism (Megalith's, as Megatron's ``all_gather`` CP that Llama 3 used):
  K and V all-gathered forward (again under full recomputation) and their gradients
  reduce-scattered backward, not overlapped, plus the measured compute overhead of
  splitting attention into two chunks per rank (:data:`~training.planning.hardware.CP_COMPUTE_OVERHEAD`);
- expert parallelism: 4 all-to-alls per MoE layer (dispatch and combine, forward and
  backward) of the routed tokens, (ep-1)/ep of them leave the GPU;
- pipeline: bubble ``(p-1)/(v·m)`` of the compute (Narayanan et al. 2021), and the
  point-to-point sends of activations and their gradients (2·v·m per step), not overlapped;
- data parallelism: gradients reduced over data × context ranks (all-reduce, or
  reduce-scatter + all-gather for the distributed optimizer: 2(d-1)/d of the fp32
  gradients; FSDP 3(d-1)/d), over InfiniBand once the group leaves the node, with a
  hidden fraction (:data:`~training.planning.hardware.DP_OVERLAP`);
- the AdamW step, bound by HBM bandwidth.

MFU = tokens/s × (6·N + 12·L·H·S) / (GPUs × bf16 peak), N with the output head: the
formula of benchmarks/RESULTS.md and /work/shared/REFERENCE.md.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from megalith.config import FAMILY_RULES, MegalithConfig
from megalith.errors import MegalithError
from training.memory.activations import (
    GIB,
    MODES,
    OVERHEAD_BYTES,
    SAFETY_FRACTION,
    pipeline_in_flight,
    saved_bytes_per_token,
)
from training.parallel.groups import ParallelSizes
from training.parallel.support import check_trainer_support
from training.planning import hardware
from training.planning.hardware import GPUKind

DP_MODES = ("ddp", "distributed_optimizer", "fsdp")
PRECISIONS = ("bf16", "fp8")


class PlanError(MegalithError):
    """A planning question that cannot be answered; the message names the flag or key."""


@dataclass(frozen=True)
class Cluster:
    gpu: GPUKind
    gpus: int
    gpus_per_node: int
    ib_gbits: float  # InfiniBand per GPU, Gb/s
    dp_overlap: float = hardware.DP_OVERLAP

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def bandwidth(self, span: int) -> float:
        """Bytes/s one way per GPU of a group of ``span`` consecutive ranks: NVLink while
        the group stays inside a node, InfiniBand once it leaves it."""
        if span <= self.gpus_per_node:
            return self.gpu.nvlink_gbps * 1e9 * hardware.NVLINK_EFFICIENCY
        return self.ib_gbits / 8 * 1e9 * hardware.IB_EFFICIENCY


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    precision: str = "bf16"
    recompute: str = "none"
    micro_batch_size: int = 1
    data_parallel_mode: str = "ddp"
    pipeline_layers: str = "even"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"CP{self.cp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
        return " ".join(parts)

    def settings(self) -> dict[str, Any]:
        """The config keys (dotted) and values that train this layout."""
        values: dict[str, Any] = {
            "parallel.tensor": self.tp,
            "parallel.context": self.cp,
            "parallel.pipeline": self.pp,
            "parallel.data_parallel_mode": self.data_parallel_mode,
            "model.activation_checkpointing": self.recompute,
            "training.micro_batch_size": self.micro_batch_size,
        }
        if self.ep > 1:
            values["parallel.expert"] = self.ep
        if self.sequence_parallel:
            values["parallel.sequence_parallel"] = True
        if self.vpp > 1:
            values["parallel.virtual_pipeline"] = self.vpp
            values["parallel.pipeline_schedule"] = "interleaved"
        if self.pp > 1 and self.pipeline_layers != "even":
            values["parallel.pipeline_layers"] = self.pipeline_layers
        if self.precision == "fp8":
            values["mixed_precision.fp8"] = True
        return values

    def overrides(self) -> list[str]:
        """``--set`` overrides that train this layout with ``megalith train``."""
        return [
            f"{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in self.settings().items()
        ]


@dataclass
class Memory:
    """Bytes per GPU on the fuller pipeline stage."""

    parameters: float
    gradients: float
    optimizer: float
    weight_copies: float
    buffers: float
    activations: float
    loss_buffer: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass
class StepTime:
    """Seconds per optimizer step, by cause (the critical pipeline stage)."""

    compute: float
    tensor_parallel: float
    context_parallel: float
    expert_parallel: float
    pipeline_bubble: float
    pipeline_p2p: float
    data_parallel: float
    optimizer: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass
class Prediction:
    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_s: float
    mfu: float
    micro_batches: int

    def as_dict(self) -> dict:
        return {
            "layout": asdict(self.layout),
            "describe": self.layout.describe(),
            "memory_gib": {k: v / GIB for k, v in asdict(self.memory).items()}
            | {"total": self.memory.total / GIB},
            "step_time_s": asdict(self.time) | {"total": self.time.total},
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "micro_batches": self.micro_batches,
            "overrides": self.layout.overrides(),
        }


@dataclass
class Refusal:
    layout: Layout
    reason: str
    needed_bytes: float


@dataclass
class SearchResult:
    best: list[Prediction]  # fastest first, one per (tp, cp, pp, dp, ep, vpp)
    refused: list[Refusal]
    considered: int
    fitting: int
    usable_bytes: float
    refused_by_reason: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shapes:
    """Parameter and FLOP counts from a recipe (the arithmetic of training/models/flops.py,
    which lives in a torch package; tests/test_planner.py checks that they agree)."""

    hidden: int
    layers: int
    heads: int
    groups: int
    vocab: int
    seq: int
    attention: int  # matmul weights of one self-attention
    mlp: int  # one dense MLP
    expert: int  # one expert's MLP (0 without MoE)
    experts: int
    top_k: int
    moe_layers: int
    tied: bool
    kv_width: int

    @classmethod
    def of(cls, config: MegalithConfig, seq: int) -> Shapes:
        m = config.model
        h, d = m.hidden_size, m.head_dim
        gated = 3 if m.activation in ("swiglu", "geglu") else 2
        return cls(
            hidden=h,
            layers=m.num_layers,
            heads=m.num_attention_heads,
            groups=m.num_query_groups,
            vocab=m.vocab_size,
            seq=seq,
            attention=h * (m.num_attention_heads + 2 * m.num_query_groups) * d
            + m.num_attention_heads * d * h,
            mlp=gated * h * m.ffn_hidden_size,
            expert=gated * h * (m.moe_ffn_hidden_size or 0),
            experts=m.num_experts or 0,
            top_k=m.moe_top_k if m.num_experts else 0,
            moe_layers=sum(m.is_moe_layer(i) for i in range(m.num_layers)),
            tied=m.tie_embeddings,
            kv_width=m.num_query_groups * d,
        )

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def active_matmul(self) -> int:
        """N of 6·N: the weights a token meets, output head included."""
        router = self.hidden * self.experts
        moe = self.attention + router + self.top_k * self.expert
        return (
            self.dense_layers * (self.attention + self.mlp)
            + self.moe_layers * moe
            + self.vocab * self.hidden
        )

    def flops_per_token(self) -> float:
        return 6 * self.active_matmul() + 12 * self.layers * self.hidden * self.seq

    def layer_flops_per_token(self) -> float:
        """Mean FLOPs per token of one block (dense and MoE averaged)."""
        head = 6 * self.vocab * self.hidden
        return (self.flops_per_token() - head) / self.layers

    def layer_params(self, layout: Layout) -> float:
        """Mean parameters of one block on one rank (TP and EP shards; norms whole)."""
        dense = (self.attention + self.mlp) / layout.tp
        moe = self.attention / layout.tp + self.hidden * self.experts  # experts apart
        norms = 2 * self.hidden
        shared = (self.dense_layers * dense + self.moe_layers * moe) / self.layers
        return shared + self.layer_expert_params(layout) + norms

    def layer_expert_params(self, layout: Layout) -> float:
        """The expert weights within :meth:`layer_params` (this rank's EP shard, whole on
        every TP rank): the part ZeRO-1 and FSDP split over expert-data ranks, not over
        data × context."""
        return self.moe_layers * self.experts * self.expert / layout.ep / self.layers

    def layer_matmul_params(self, layout: Layout) -> float:
        return self.layer_params(layout) - 2 * self.hidden


# --------------------------------------------------------------------------- pipeline split


def stage_layers(shapes: Shapes, layout: Layout) -> tuple[float, float]:
    """Blocks on the first and on the last pipeline rank (all virtual chunks)."""
    if layout.pp == 1:
        return shapes.layers, shapes.layers
    slots = layout.pp * layout.vpp
    if layout.pipeline_layers == "balanced":  # embedding and head take one slot each
        per = (shapes.layers + 2) // slots
        return per * layout.vpp - 1, per * layout.vpp - 1
    per = shapes.layers // slots
    return per * layout.vpp, per * layout.vpp


def split_problem(shapes: Shapes, pp: int, vpp: int, split: str) -> str | None:
    slots = pp * vpp
    total = shapes.layers + (2 if split == "balanced" else 0)
    if total % slots or total // slots < 1:
        return f"{split} split: {total} layer slots not divisible by PP{pp}·v{vpp}"
    return None


def critical_layers(shapes: Shapes, layout: Layout) -> float:
    """Blocks on the busiest pipeline rank: a middle rank holds the two slots that the
    balanced split gives the first and last ranks' embedding and head."""
    if layout.pp > 2 and layout.pipeline_layers == "balanced":
        return (shapes.layers + 2) // (layout.pp * layout.vpp) * layout.vpp
    return max(stage_layers(shapes, layout))


def chunk_spread(shapes: Shapes, layout: Layout) -> float:
    """The last pipeline rank's largest virtual stage over its mean one, where that rank is
    the critical one (1 otherwise): the interleaved schedule's warm-up and cool-down run at
    the pace of the slowest virtual stage, and with an even split the last one also holds
    the output layer. Measured (benchmarks/RESULTS.md, 2026-11-28): PP=4 v=2 at 8 layers,
    whose last virtual stage does about twice the others' work, idled 29.9% against the
    schedule's 18.75%; the plain (p - 1)/(v·m) over-predicted every interleaved run."""
    if layout.pp == 1 or layout.vpp == 1 or layout.pipeline_layers != "even":
        return 1.0
    layer, head = shapes.layer_flops_per_token(), 6 * shapes.vocab * shapes.hidden
    _, last_layers = stage_layers(shapes, layout)
    per_chunk = last_layers / layout.vpp * layer
    last_rank = last_layers * layer + head
    if last_rank < critical_layers(shapes, layout) * layer:
        return 1.0
    return layout.vpp * (per_chunk + head) / last_rank


def stage_imbalance(shapes: Shapes, layout: Layout) -> float:
    """Critical stage's FLOPs over the mean stage's (the head sits on the last stage)."""
    if layout.pp == 1:
        return 1.0
    layer, head = shapes.layer_flops_per_token(), 6 * shapes.vocab * shapes.hidden
    first, last = stage_layers(shapes, layout)
    critical = max(layer * critical_layers(shapes, layout), layer * first, layer * last + head)
    mean = (layer * shapes.layers + head) / layout.pp
    return critical / mean


# --------------------------------------------------------------------------- memory


def memory(config: MegalithConfig, shapes: Shapes, layout: Layout, micro_batches: int) -> Memory:
    """Bytes per GPU of the fuller of the first and last pipeline stages."""
    d = layout.dp * layout.cp
    first, last = stage_layers(shapes, layout)
    embed = shapes.vocab * shapes.hidden / layout.tp
    head = 0 if (shapes.tied and layout.pp == 1) else embed
    params_first = first * shapes.layer_params(layout) + embed + (head if layout.pp == 1 else 0)
    params_last = (
        last * shapes.layer_params(layout) + (head if layout.pp > 1 else 0) + shapes.hidden
    )
    copied_head = 0 if shapes.tied else embed  # a tied head is the (uncopied) embedding
    matmul = max(first, last) * shapes.layer_matmul_params(layout) + copied_head
    fsdp = layout.data_parallel_mode == "fsdp" and d > 1

    tokens = layout.micro_batch_size * shapes.seq / layout.cp
    sized = _with_parallel(config, layout)
    sizes = ParallelSizes(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp, ep=layout.ep)
    per_layer = saved_bytes_per_token(sized, sizes, layout.recompute) * tokens
    rebuilt = (
        saved_bytes_per_token(sized, sizes, "none") * tokens if layout.recompute != "none" else 0
    )
    loss = tokens * shapes.vocab / layout.tp * (2 + 4 + 4)

    stages = []
    for params, layers, is_first, is_last in (
        (params_first, first, True, layout.pp == 1),
        (params_last, last, layout.pp == 1, True),
    ):
        # What ZeRO-1 and FSDP split: dense weights over data × context, experts over
        # their expert-data ranks.
        experts = layers * shapes.layer_expert_params(layout)
        split = (params - experts) / d + experts / max(d // layout.ep, 1)
        held = split if fsdp else params
        optimizer = 8 * (params if layout.data_parallel_mode == "ddp" else split)
        if fsdp and layout.pp > 1:  # the stage's gathers and gradients until the reduction
            buffers = 4 * 2 * params
        elif fsdp:
            buffers = 4 * 3 * shapes.layer_params(layout)
        elif d > 1:
            buffers = 4 * params
        else:
            buffers = 0.0
        flight = pipeline_in_flight(layout.pp, layout.vpp, micro_batches) if is_first else 1.0
        stages.append(
            Memory(
                parameters=4 * held,
                gradients=4 * held,
                optimizer=optimizer,
                weight_copies=2 * matmul,
                buffers=buffers,
                activations=per_layer * layers * flight + rebuilt,
                loss_buffer=loss if is_last else 0.0,
            )
        )
    return max(stages, key=lambda m: m.total)


def _with_parallel(config: MegalithConfig, layout: Layout) -> MegalithConfig:
    """The recipe with the layout's sequence parallelism and bf16, for the activation
    count (which reads ``parallel.sequence_parallel`` and ``mixed_precision.dtype``)."""
    parallel = config.parallel.model_copy(update={"sequence_parallel": layout.sequence_parallel})
    precision = config.mixed_precision.model_copy(update={"dtype": "bf16"})
    return config.model_copy(update={"parallel": parallel, "mixed_precision": precision})


def trainer_refusal(config: MegalithConfig, layout: Layout) -> str | None:
    """Why the trainer would refuse ``layout`` for this recipe
    (:func:`~training.parallel.support.check_trainer_support`), or None: the plan never
    proposes what ``megalith train`` then refuses. The recipe takes the layout's
    :meth:`Layout.settings` unvalidated (a search checks thousands of layouts)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in layout.settings().items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    trained = config.model_copy(
        update={
            section: getattr(config, section).model_copy(update=values)
            for section, values in sections.items()
        }
    )
    sizes = ParallelSizes(
        tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp, ep=layout.ep, vpp=layout.vpp
    )
    try:
        check_trainer_support(trained, sizes)
    except MegalithError as error:
        return f"the trainer refuses it: {error}"
    return None


def usable_bytes(gpu: GPUKind) -> float:
    """90% of the GPU less 1.5 GiB, the memory planner's margin."""
    return gpu.memory_gib * GIB * (1 - SAFETY_FRACTION) - OVERHEAD_BYTES


# --------------------------------------------------------------------------- time


def ring(size: int) -> float:
    """Bytes each rank sends per byte of an all-reduce over ``size`` ranks (ring)."""
    return 2 * (size - 1) / size


def step_time(
    shapes: Shapes, layout: Layout, cluster: Cluster, global_batch: int
) -> tuple[StepTime, int]:
    """(seconds per optimizer step by cause, micro-batches per step per replica)."""
    gpu = cluster.gpu
    m = global_batch // (layout.micro_batch_size * layout.dp)
    tokens = global_batch * shapes.seq
    flops = shapes.flops_per_token() * tokens / layout.world * stage_imbalance(shapes, layout)
    rows = layout.micro_batch_size * shapes.seq / layout.cp
    rate = gpu.bf16_tflops * 1e12 * hardware.compute_efficiency(gpu, shapes.hidden, rows)
    compute = flops / rate * hardware.RECOMPUTE_TIME[layout.recompute]
    if layout.precision == "fp8":
        compute /= hardware.FP8_SPEEDUP

    layers = critical_layers(shapes, layout)
    act = layout.micro_batch_size * shapes.seq / layout.cp * shapes.hidden * 2  # bf16 bytes
    tp = 0.0
    if layout.tp > 1:
        passes = 6 if layout.recompute == "full" else 4
        link = cluster.bandwidth(layout.tp) * hardware.TP_COLLECTIVE_EFFICIENCY
        per_layer = passes * act * ring(layout.tp) / link
        tp = per_layer * layers * m
        # MoE under TP: the whole router and (EP-local) experts on each rank, their fp32
        # gradients all-reduced over TP once a step (training.models.moe).
        replicated = shapes.moe_layers * shapes.experts * (shapes.expert + shapes.hidden)
        tp += 4 * replicated / layout.ep / shapes.layers * layers * ring(layout.tp) / link

    cp = 0.0
    if layout.cp > 1:  # all-gather K, V forward (again under full recompute), reduce-scatter back
        kv = layout.micro_batch_size * shapes.seq * shapes.kv_width * 2 * 2
        passes = 3 if layout.recompute == "full" else 2
        comm = passes * (layout.cp - 1) / layout.cp * kv / cluster.bandwidth(layout.tp * layout.cp)
        cp = comm * layers * m + hardware.CP_COMPUTE_OVERHEAD * compute

    ep = 0.0
    if layout.ep > 1 and shapes.moe_layers:
        routed = act * shapes.top_k / (layout.tp if layout.sequence_parallel else 1)
        comm = 4 * routed * (layout.ep - 1) / layout.ep / cluster.bandwidth(layout.tp * layout.ep)
        ep = comm * shapes.moe_layers / shapes.layers * layers * m

    bubble = p2p = 0.0
    if layout.pp > 1:
        bubble = (layout.pp - 1) / (layout.vpp * m) * compute * chunk_spread(shapes, layout)
        send = act / (layout.tp if layout.sequence_parallel else 1)
        span = layout.tp * layout.cp * layout.dp * 2  # neighbouring stages
        p2p = 2 * layout.vpp * m * send / cluster.bandwidth(span)

    d = layout.dp * layout.cp
    params = critical_layers(shapes, layout) * shapes.layer_params(layout) + (
        shapes.vocab * shapes.hidden / layout.tp
    )
    dp = 0.0
    if d > 1:
        # In all-reduce volumes of fp32 parameters. FSDP (fp32, resharded after forward)
        # all-gathers the parameters in every micro-batch's forward and backward, and
        # reduce-scatters the gradients once (no sync on accumulation micro-batches).
        factor = (2 * m + 1) / 2 if layout.data_parallel_mode == "fsdp" else 1.0
        comm = factor * ring(d) * 4 * params / cluster.bandwidth(layout.tp * d)
        dp = comm * (1 - cluster.dp_overlap)
    updated = params / (d if layout.data_parallel_mode != "ddp" else 1)
    optimizer = hardware.OPTIMIZER_BYTES_PER_PARAM * updated / (gpu.hbm_tbps * 1e12)
    return StepTime(compute, tp, cp, ep, bubble, p2p, dp, optimizer), m


def predict(
    config: MegalithConfig,
    shapes: Shapes,
    layout: Layout,
    cluster: Cluster,
    global_batch: int,
) -> Prediction:
    time, m = step_time(shapes, layout, cluster, global_batch)
    tokens_per_s = global_batch * shapes.seq / time.total
    mfu = tokens_per_s * shapes.flops_per_token() / (layout.world * cluster.gpu.bf16_tflops * 1e12)
    return Prediction(layout, memory(config, shapes, layout, m), time, tokens_per_s, mfu, m)


# --------------------------------------------------------------------------- search


@dataclass(frozen=True)
class SearchSpace:
    """What the search may vary; a fixed value pins a dimension (for checks against a
    published layout)."""

    tp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    vpp: tuple[int, ...] = (1, 2, 4)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    recompute: tuple[str, ...] = MODES
    precisions: tuple[str, ...] = PRECISIONS
    data_parallel_modes: tuple[str, ...] = DP_MODES


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def check_request(config: MegalithConfig, cluster: Cluster, global_batch: int, seq: int) -> None:
    """Raise :class:`PlanError` with one line for a question the planner cannot answer."""
    if cluster.gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {cluster.gpus}")
    if cluster.gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node must be >= 1, got {cluster.gpus_per_node}")
    if cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        raise PlanError(
            f"--gpus {cluster.gpus} is not a whole number of nodes of "
            f"{cluster.gpus_per_node} GPUs (--gpus-per-node)"
        )
    if global_batch < 1 or seq < 1:
        raise PlanError(f"--global-batch {global_batch} and --seq {seq} must be >= 1")
    if FAMILY_RULES[config.model.family].decoder_stack:
        raise PlanError(
            f"model.family {config.model.family!r}: the planner models one decoder stack; "
            "encoder-decoder families are not planned yet"
        )
    if config.model.vocab_size is None:
        raise PlanError("model.vocab_size must be set to count the embedding")
    if cluster.ib_gbits <= 0:
        raise PlanError(f"--ib-gbits must be > 0, got {cluster.ib_gbits:g}")
    if not 0 <= cluster.dp_overlap <= 1:
        raise PlanError(f"--dp-overlap must be within [0, 1], got {cluster.dp_overlap:g}")


def candidates(shapes: Shapes, cluster: Cluster, global_batch: int, space: SearchSpace):
    """Every layout that divides the GPUs, the model and the batch."""
    n, gpn = cluster.gpus, cluster.gpus_per_node
    tps = space.tp or [
        t for t in _powers_of_two(min(gpn, n)) if shapes.heads % t == 0 and shapes.groups % t == 0
    ]
    cps = space.cp or [c for c in _powers_of_two(min(n, 64)) if shapes.seq % (2 * c) == 0 or c == 1]
    pps = space.pp or [p for p in range(1, min(n, shapes.layers) + 1) if n % p == 0]
    for tp, cp, pp in itertools.product(tps, cps, pps):
        if n % (tp * cp * pp):
            continue
        dp = n // (tp * cp * pp)
        eps = space.ep or (
            [
                e
                for e in range(1, shapes.experts + 1)
                if shapes.experts % e == 0 and (dp * cp) % e == 0
            ]
            if shapes.experts
            else [1]
        )
        vpps = [v for v in space.vpp if pp > 1 or v == 1]
        splits = ["even", "balanced"] if pp > 1 else ["even"]
        for ep, vpp, split in itertools.product(eps, vpps, splits):
            if split_problem(shapes, pp, vpp, split):
                continue
            for mbs in space.micro_batch_sizes:
                if global_batch % (mbs * dp):
                    continue
                m = global_batch // (mbs * dp)
                if vpp > 1 and m % pp:
                    continue  # the interleaved schedule runs micro-batches in groups of pp
                for rc, prec, mode in itertools.product(
                    space.recompute, space.precisions, space.data_parallel_modes
                ):
                    if prec == "fp8" and (
                        cluster.gpu.fp8_tflops is None or shapes.hidden < hardware.FP8_MIN_HIDDEN
                    ):
                        continue
                    if mode != "ddp" and dp * cp == 1:
                        continue
                    yield Layout(tp, cp, pp, dp, ep, vpp, tp > 1, prec, rc, mbs, mode, split)


def search(
    config: MegalithConfig,
    cluster: Cluster,
    *,
    global_batch: int,
    seq: int,
    top: int = 5,
    space: SearchSpace | None = None,
) -> SearchResult:
    """The ``top`` fastest layouts that fit (one row per set of parallel sizes, with its
    fastest micro-batch, recomputation, precision and data-parallel mode), and every
    refusal with its reason."""
    check_request(config, cluster, global_batch, seq)
    shapes = Shapes.of(config, seq)
    budget = usable_bytes(cluster.gpu)
    fitting: list[Prediction] = []
    refused: list[Refusal] = []
    considered = 0
    for layout in candidates(shapes, cluster, global_batch, space or SearchSpace()):
        considered += 1
        prediction = predict(config, shapes, layout, cluster, global_batch)
        need = prediction.memory.total
        unsupported = trainer_refusal(config, layout)
        if unsupported is not None:
            refused.append(Refusal(layout, unsupported, need))
        elif need > budget:
            refused.append(Refusal(layout, _memory_reason(prediction, budget, cluster.gpu), need))
        else:
            fitting.append(prediction)
    if not considered:
        raise PlanError(
            f"no layout of {cluster.gpus} GPUs divides the model and the batch: global batch "
            f"{global_batch}, {shapes.layers} layers, {shapes.heads} heads / {shapes.groups} "
            f"KV groups (try another --gpus or --global-batch)"
        )
    fitting.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    best: dict[tuple[int, ...], Prediction] = {}
    for prediction in fitting:  # the best settings of each distinct set of sizes
        lo = prediction.layout
        best.setdefault((lo.tp, lo.cp, lo.pp, lo.dp, lo.ep, lo.vpp), prediction)
    refused.sort(key=lambda r: r.reason)
    by_reason: dict[str, int] = {}
    for refusal in refused:
        key = refusal.reason.split(":")[0]
        by_reason[key] = by_reason.get(key, 0) + 1
    return SearchResult(
        list(best.values())[:top], refused, considered, len(fitting), budget, by_reason
    )


def _memory_reason(prediction: Prediction, budget: float, gpu: GPUKind) -> str:
    mem = prediction.memory
    parts = {
        "parameters+gradients+optimizer": mem.parameters + mem.gradients + mem.optimizer,
        "activations": mem.activations,
        "loss buffer": mem.loss_buffer,
        "buffers+weight copies": mem.buffers + mem.weight_copies,
    }
    largest = max(parts, key=parts.get)
    return (
        f"out of memory: needs {mem.total / GIB:.1f} GiB per GPU, {budget / GIB:.1f} usable on "
        f"{gpu.name} ({gpu.memory_gib:g} GiB less 10% and 1.5 GiB); largest: {largest} "
        f"{parts[largest] / GIB:.1f} GiB"
    )
