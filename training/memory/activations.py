"""Activation bytes of one transformer block, per token: the term GPT and T5 layers share
(:mod:`training.memory.estimate` sums it over a rank's layers, :mod:`training.memory.t5`
adds the cross-attention)."""

from __future__ import annotations

from megalith.config import MegalithConfig
from training.parallel.groups import ParallelSizes

GIB = 1024**3
MODES = ("none", "selective", "full")  # model.activation_checkpointing
# Safety margin of the memory planners: 10% of the device plus a constant for the CUDA
# context, cuBLAS/cuDNN workspaces, NCCL buffers and allocator fragmentation.
SAFETY_FRACTION = 0.10
OVERHEAD_BYTES = int(1.5 * GIB)


def compute_dtype(config: MegalithConfig) -> str:
    """The precision planned for: ``auto`` is bf16, what it means on a GPU."""
    dtype = config.mixed_precision.dtype
    return "bf16" if dtype == "auto" else dtype


def residual_bytes(config: MegalithConfig) -> int:
    """Bytes of one residual-stream element: the compute dtype's, or fp32 with
    ``model.fp32_residual`` (:func:`training.models.layers.residual_stream`)."""
    fp32 = config.model.fp32_residual or compute_dtype(config) == "fp32"
    return 4 if fp32 else 2


def saved_bytes_per_token(config: MegalithConfig, sizes: ParallelSizes, recompute: str) -> float:
    """Bytes one transformer layer keeps for backward per token of a micro-batch on this rank
    (16-bit compute; :mod:`training.memory.estimate`'s docstring explains each term)."""
    model = config.model
    h, f, a = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    if model.num_experts:
        f = model.moe_top_k * model.moe_ffn_hidden_size  # a token meets top_k experts
    kv = h * model.num_query_groups / a  # K (or V) width under GQA
    e = 4 if compute_dtype(config) == "fp32" else 2
    r = residual_bytes(config)
    mask = h if model.dropout > 0 else 0
    tp = sizes.tp
    sp = tp if config.parallel.sequence_parallel else 1
    gated = model.activation in ("swiglu", "geglu")
    lse = 4 * a  # SDPA's fp32 log-sum-exp per head (divided by TP with the heads below)
    if recompute == "full":
        return r * h / sp
    if recompute == "selective":  # outputs of matmuls and SDPA, and the block input
        inside = e * (h + 2 * kv) + e * h + lse + e * (2 if gated else 1) * f
        outside = r * h + e * h + e * h  # block input, proj and fc2 outputs
        return inside / tp + outside / sp
    rope = e * (h + kv) if model.position_embedding == "rope" else 0
    attention_in = e * (h + kv) + e * kv + rope + e * h + lse  # Q,K; V; RoPE inputs; SDPA out
    mlp_in = e * (3 * f if gated else f) + e * f  # activation saves; fc2 input
    outside = 2 * r * h + 2 * e * h + 2 * mask  # norm inputs, qkv and fc1 inputs, masks
    return (attention_in + mlp_in) / tp + outside / sp


def pipeline_in_flight(pp: int, vpp: int, micro_batches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak, in
    units of its own layers (Megatron: ``min(p, m)`` under 1F1B, ``p·(1 + (p-1)/(p·v))``
    interleaved)."""
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp, micro_batches))
    return pp * (1 + (pp - 1) / (pp * vpp))
