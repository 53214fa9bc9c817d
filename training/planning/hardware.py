"""GPU kinds and interconnects the layout planner knows, and the efficiency constants it
calibrates on Megalith's own measurements (benchmarks/RESULTS.md).

Peaks and links are vendor datasheet figures (dense, no sparsity):

- A100 SXM 80GB: 312 TFLOP/s bf16, no fp8; NVLink 3, 600 GB/s per GPU both ways together
  (NVIDIA A100 datasheet); DGX A100: one 200 Gb/s HDR InfiniBand port per GPU.
- H100 SXM 80GB: 989 TFLOP/s bf16, 1979 fp8; NVLink 4, 900 GB/s both ways (H100 datasheet);
  DGX H100: one 400 Gb/s NDR port per GPU.
- H200 SXM 141GB: the H100's compute and NVLink, 4.8 TB/s HBM3e (H200 datasheet).
- B200 (HGX B200, 180 GB): 2250 TFLOP/s bf16, 4500 fp8; NVLink 5, 1.8 TB/s both ways
  (HGX B200 datasheet); 400 Gb/s ConnectX-7 per GPU.

A ring collective moves data one way at a time, so its bandwidth is half the "both ways"
figure, times what NCCL achieves of it (:data:`NVLINK_EFFICIENCY`, :data:`IB_EFFICIENCY`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GPUKind:
    name: str
    bf16_tflops: float  # dense peak
    fp8_tflops: float | None  # None: no fp8 tensor cores
    memory_gib: float  # what torch reports as total memory
    hbm_tbps: float
    nvlink_gbps: float  # GB/s one way per GPU (half the datasheet's bidirectional figure)
    ib_gbits: float  # default InfiniBand per GPU, Gb/s
    # Compute efficiency relative to the H200 calibration (see :func:`compute_efficiency`).
    efficiency_scale: float


GPUS: dict[str, GPUKind] = {
    "a100": GPUKind("a100", 312.0, None, 79.3, 2.04, 300.0, 200.0, 0.964),
    "h100": GPUKind("h100", 989.0, 1979.0, 79.2, 3.35, 450.0, 400.0, 0.964),
    "h200": GPUKind("h200", 989.0, 1979.0, 139.8, 4.8, 450.0, 400.0, 1.0),
    "b200": GPUKind("b200", 2250.0, 4500.0, 178.4, 8.0, 900.0, 400.0, 0.964),
}

# Achievable share of the dense bf16 peak for a model of hidden size h, on one H200,
# compiled, no recomputation: E_MAX · h / (h + H_HALF), fitted so that the whole model
# (with its optimizer step) reproduces two measurements of today's trainer
# (benchmarks/RESULTS.md, 2026-11-28, one H200 of a 4-GPU lease, torch.compile): the 1B
# shape (h 2048, 4 micro-batches of 8) at 57.9% MFU and the 7B layer shape (h 4096, 8
# micro-batches of 4) at 59.7%. Wider layers approach E_MAX. (Fitted on 2026-11-22 runs
# before, 53.1% and 57.0%: E_MAX 0.6368, H_HALF 330.5; the trainer got faster since.)
E_MAX = 0.6425
H_HALF = 205.1
# H100 over H200 at the 1B shape, compiled: 51.2% / 53.1% (same code, lower HBM
# bandwidth). A100 and B200 were never measured here: they take the H100's ratio.
# Recomputation costs (same page, H200): selective 72,386 vs 74,652 tokens/s compiled
# (×1.031 time); full 49,003 vs 61,049 eager (×1.246 time).
RECOMPUTE_TIME = {"none": 1.0, "selective": 1.031, "full": 1.246}
# fp8 (torchao tensorwise, compiled, with the gated MLP's own float8 casts) on the 1B
# shape: 100,289 vs 80,312 tokens/s, one H200, same call (RESULTS.md, 2026-11-28 night;
# ×1.20 before those casts); at hidden 1024 (GPT-2 350M) 0.96× (2026-11-22): below
# FP8_MIN_HIDDEN fp8 is not offered.
FP8_SPEEDUP = 1.25
FP8_MIN_HIDDEN = 2048
# NCCL's share of the one-way NVLink bandwidth for collectives that overlap compute
# (data-parallel gradient buckets): nccl-tests all-reduce bus bandwidth over NVLink 4 is
# about 0.88 of 450 GB/s. (It was first fitted on a compiled TP=2 run whose numerics were
# wrong; that run is withdrawn, RESULTS.md issue 20.)
NVLINK_EFFICIENCY = 0.88
# Tensor parallelism's all-reduces block the layer that needs them, one per matmul pair,
# and are not overlapped yet: fitted on compiled TP=4 at the 7B layer shape on 4 H100s
# (2026-11-27, 57.3% of one GPU per GPU, losses checked against one GPU), all of the loss
# read as exposed all-reduce time: they reach about a quarter of the bandwidth above.
TP_COLLECTIVE_EFFICIENCY = 0.26
# Context parallelism's own compute cost (two attention calls per rank on chunk pairs,
# K/V reordering): CP=2 on the 1B shape ran at 80.6% of one GPU per GPU (eager, 2 H200s)
# where its all-gathers account for under 2%: ≈ 0.2 of the compute. Eager: compiled CP
# was not measured, so this is likely pessimistic.
CP_COMPUTE_OVERHEAD = 0.20
# NCCL's share of InfiniBand line rate: not measured here (no multi-node machine);
# nccl-tests all-reduce bus bandwidth over NDR is typically 80-90% of 50 GB/s.
IB_EFFICIENCY = 0.80
# Data-parallel gradient reduction hidden behind the backward pass. Not separable in
# our 2-GPU runs (DP=2 ddp lost 1.4% against ≈1.1% predicted fully exposed);
# Megatron and FSDP overlap bucketed reductions with the backward: default one half.
DP_OVERLAP = 0.5
# AdamW reads and writes fp32 params, grads and two moments: ≈ 32 bytes per parameter
# of HBM traffic per step.
OPTIMIZER_BYTES_PER_PARAM = 32


class UnknownGPUError(ValueError):
    pass


def gpu_kind(name: str) -> GPUKind:
    """The :class:`GPUKind` called ``name`` (a100, h100, h200, b200)."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise UnknownGPUError(f"unknown GPU kind {name!r} (known: {', '.join(GPUS)})") from None


# Rows of the per-GPU matrix products (micro-batch × sequence / CP): both calibration runs
# had 8k-16k; fewer rows underfill the GPU. ROWS_HALF is an assumption, not a measurement.
ROWS_HALF = 256
CALIBRATION_ROWS = 16384


def compute_efficiency(gpu: GPUKind, hidden: int, rows: float = CALIBRATION_ROWS) -> float:
    """Share of the bf16 peak a model of width ``hidden`` reaches on one GPU of ``gpu``
    with ``rows`` tokens per micro-batch on the GPU."""
    width = E_MAX * hidden / (hidden + H_HALF)
    fill = (rows / (rows + ROWS_HALF)) / (CALIBRATION_ROWS / (CALIBRATION_ROWS + ROWS_HALF))
    return gpu.efficiency_scale * width * min(1.0, fill)
