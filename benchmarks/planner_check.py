"""Check ``megalith plan``'s model against published large-scale runs.

For every published run: the planner predicts the published layout (TP, CP, PP, DP
pinned; micro-batch, virtual stages, recomputation and data-parallel mode searched, bf16)
and, separately, searches freely on the same GPUs, batch and sequence (bf16): is its top
choice the published layout? Prints a Markdown table (predicted vs published MFU, memory
per GPU) to paste into benchmarks/RESULTS.md.

Published figures:

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", Table 1 (weak scaling on Selene: DGX A100 80GB, 8 × 200 Gb/s HDR
  InfiniBand per node; GPT, vocabulary 51,200, sequence 2048, activation recomputation):
  achieved teraFLOP/s per GPU counted with their hardware formula
  96·B·s·l·h²·(1 + s/6h + V/16lh) (recomputation included). Converted here to tokens/s
  and then to MFU with our formula, 6·N + 12·L·H·S per token over 312 TFLOP/s. The
  paper recomputes activations and has no distributed optimizer (2021): both are pinned
  (full recomputation, ddp) in the prediction and in the free search.
- NVIDIA and Microsoft, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B"
  (NVIDIA technical blog, 2021-10-11): 530B (the 529.6B shape) with TP8 × PP35 on 420
  DGX A100 servers (3360 GPUs, DP12), batch 1920, 113 teraFLOP/s per GPU.
- Llama Team 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B (126 layers,
  hidden 16384, FFN 53248, 128 heads, 8 KV heads, vocabulary 128,256) on H100 80GB,
  16M tokens per batch, BF16 MFU as published (their own FLOP count).

    python benchmarks/planner_check.py
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from megalith.config import MegalithConfig, load_config
from training.memory.activations import GIB
from training.planning.hardware import gpu_kind
from training.planning.layout import Cluster, Layout, SearchSpace, Shapes, predict, search

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    gpu: str
    gpus: int
    ib_gbits: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    global_batch: int  # sequences
    tp: int
    cp: int
    pp: int
    style: str  # gpt2 (LayerNorm, GELU, learned positions) or llama
    tflops_per_gpu: float | None = None  # Megatron's hardware TFLOP/s (with recompute)
    mfu: float | None = None  # as published
    # What the publication fixes beyond the layout (searched otherwise).
    recompute: tuple[str, ...] = ("none", "selective", "full")
    dp_modes: tuple[str, ...] = ("ddp", "distributed_optimizer", "fsdp")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)


def megatron(
    name, gpus, layers, hidden, heads, tp, pp, batch, tflops, source="Megatron-LM Table 1"
) -> Published:
    return Published(
        name, source, "a100", gpus, 200.0, layers, hidden, heads, heads,
        4 * hidden, 51200, 2048, batch, tp, 1, pp, "gpt2", tflops_per_gpu=tflops,
        recompute=("full",), dp_modes=("ddp",),
    )  # fmt: skip


def llama405(gpus, tp, cp, pp, seq, mfu) -> Published:
    batch = 16 * 1024 * 1024 // seq
    return Published(
        f"Llama 3 405B, seq {seq}", "Llama 3 Table 4", "h100", gpus, 400.0, 126, 16384, 128, 8,
        53248, 128256, seq, batch, tp, cp, pp, "llama", mfu=mfu,
    )  # fmt: skip


RUNS = [
    megatron("GPT 18.4B", 256, 40, 6144, 48, 8, 1, 1024, 135),
    megatron("GPT 76.1B", 1024, 60, 10240, 80, 8, 4, 1792, 140),
    megatron("GPT 145.6B", 1536, 80, 12288, 96, 8, 8, 2304, 148),
    megatron("GPT 310.1B", 1920, 96, 16384, 128, 8, 16, 2160, 155),
    megatron("GPT 529.6B", 2520, 105, 20480, 128, 8, 35, 2520, 163),
    megatron("GPT 1008B", 3072, 128, 25600, 160, 8, 64, 3072, 163),
    megatron("MT-NLG 530B", 3360, 105, 20480, 128, 8, 35, 1920, 113, "MT-NLG blog"),
    llama405(8192, 8, 1, 16, 8192, 0.43),
    llama405(16384, 8, 1, 16, 8192, 0.41),
    llama405(16384, 8, 16, 16, 131072, 0.38),
]


def recipe(run: Published) -> MegalithConfig:
    """The run's model shape on the 1B recipe's other settings."""
    sets = [
        f"model.style={run.style}",
        f"model.num_layers={run.layers}",
        f"model.hidden_size={run.hidden}",
        f"model.num_attention_heads={run.heads}",
        f"model.num_query_groups={run.kv_heads}",
        f"model.ffn_hidden_size={run.ffn}",
        f"model.vocab_size={run.vocab}",
        f"model.max_position_embeddings={run.seq}",
        f"data.seq_length={run.seq}",
        "model.tie_embeddings=true" if run.style == "gpt2" else "model.tie_embeddings=false",
    ]
    return load_config(REPO / "configs" / "llama-1b.yaml", sets)


def published_mfu(run: Published, config: MegalithConfig) -> float:
    if run.mfu is not None:
        return run.mfu
    h, s, lay, v = run.hidden, run.seq, run.layers, run.vocab
    hardware_per_token = 96 * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))
    tokens_per_s = run.tflops_per_gpu * 1e12 * run.gpus / hardware_per_token
    ours = Shapes.of(config, s).flops_per_token()
    return tokens_per_s * ours / (run.gpus * gpu_kind(run.gpu).bf16_tflops * 1e12)


def check(run: Published) -> dict:
    config = recipe(run)
    cluster = Cluster(gpu_kind(run.gpu), run.gpus, 8, run.ib_gbits)
    bf16 = SearchSpace(
        precisions=("bf16",), recompute=run.recompute, data_parallel_modes=run.dp_modes
    )
    pinned = replace(bf16, tp=(run.tp,), cp=(run.cp,), pp=(run.pp,))
    at_published = search(
        config, cluster, global_batch=run.global_batch, seq=run.seq, top=1, space=pinned
    )
    free = search(config, cluster, global_batch=run.global_batch, seq=run.seq, top=1, space=bf16)
    best = free.best[0] if free.best else None
    at = at_published.best[0] if at_published.best else None
    return {
        "run": run,
        "published_mfu": published_mfu(run, config),
        "predicted": at,
        "refusal": None if at else at_published.refused[0].reason,
        "top": best,
        "usable": at_published.usable_bytes,
    }


def row(result: dict) -> str:
    run, at, top = result["run"], result["predicted"], result["top"]
    published = f"TP{run.tp} CP{run.cp} PP{run.pp} DP{run.dp}"
    if at is None:
        predicted = f"does not fit: {result['refusal']}"
        choice = ""
    else:
        lo = at.layout
        predicted = (
            f"{at.mfu:.1%} | {at.memory.total / GIB:.1f} | {lo.recompute}, mb {lo.micro_batch_size}"
            f", v{lo.vpp}, {lo.data_parallel_mode}"
        )
        choice = ""
    if top is not None:
        same = (top.layout.tp, top.layout.cp, top.layout.pp) == (run.tp, run.cp, run.pp)
        choice = (
            f"{'yes' if same else 'no'}: {top.layout.describe()} {top.layout.recompute} "
            f"mb {top.layout.micro_batch_size}, {top.mfu:.1%}"
        )
    return (
        f"| {run.name} | {run.source} | {run.gpus} × {run.gpu.upper()} | {published} | "
        f"{result['published_mfu']:.1%} | {predicted} | {choice} |"
    )


# Our own measurements (benchmarks/RESULTS.md, 2026-11-22, -27 and -28): (label, GPU, shape, layout,
# sequences per step per replica, measured: MFU, or per-GPU efficiency against one GPU
# in the same run when the row says "eff"). Compiled rows are what the planner models;
# the eager ones show how far eager runs sit below it.
SEVEN_B_LAYERS = [
    "model.num_layers=8", "model.hidden_size=4096", "model.num_attention_heads=32",
    "model.num_query_groups=32", "model.ffn_hidden_size=11008",
]  # fmt: skip
OURS = [
    ("1B, 1 GPU, compiled", "h100", [], Layout(1, 1, 1, 1, micro_batch_size=8), 8, "51.2%"),
    ("1B, 1 GPU, compiled (fit until 11-28)", "h200", [], Layout(1, 1, 1, 1, micro_batch_size=8), 8, "53.1%"),
    ("1B, 1 GPU, compiled, selective", "h200", [],
     Layout(1, 1, 1, 1, recompute="selective", micro_batch_size=8), 8, "51.5%"),
    ("1B, 1 GPU, compiled, fp8", "h200", [],
     Layout(1, 1, 1, 1, precision="fp8", micro_batch_size=8), 8, "63.8%"),
    ("7B layers, 1 GPU, compiled (fit until 11-28)", "h200", SEVEN_B_LAYERS,
     Layout(1, 1, 1, 1, micro_batch_size=4), 16, "57.0%"),
    # 2026-11-27, 4x H200 (1B) and 4x H100 (7B layers), issue 20, 4 micro-batches a replica.
    ("1B, 1 GPU, compiled, 4x8 per step", "h200", [],
     Layout(1, 1, 1, 1, micro_batch_size=8), 32, "56.6%"),
    ("1B, DP2 ddp, compiled", "h200", [], Layout(1, 1, 1, 2, micro_batch_size=8), 32, "eff 96.2%"),
    ("1B, DP4 ddp, compiled", "h200", [], Layout(1, 1, 1, 4, micro_batch_size=8), 32, "eff 94.8%"),
    ("7B layers, 1 GPU, compiled", "h100", SEVEN_B_LAYERS,
     Layout(1, 1, 1, 1, micro_batch_size=4), 16, "56.0%"),
    # 2026-11-27 04:17 UTC, 4x H100 (another lease than the 1-GPU row above), compiled TP
    # checked against one GPU first (parallel_parity.py --compile); efficiency against that
    # row's 48,972 tokens/s.
    ("7B layers, TP4, compiled", "h100", SEVEN_B_LAYERS,
     Layout(4, 1, 1, 1, micro_batch_size=4), 16, "eff 57.3%"),
    ("7B layers, TP2 x DP2 fsdp, compiled", "h100", SEVEN_B_LAYERS,
     Layout(2, 1, 1, 2, micro_batch_size=4, data_parallel_mode="fsdp"), 16, "eff 67.5%"),
    ("7B layers, DP4 fsdp, compiled", "h100", SEVEN_B_LAYERS,
     Layout(1, 1, 1, 4, micro_batch_size=4, data_parallel_mode="fsdp"), 16, "eff 86.9%"),
    ("7B layers, DP4 ddp, compiled", "h100", SEVEN_B_LAYERS,
     Layout(1, 1, 1, 4, micro_batch_size=4), 16, "eff 96.0%"),
    # 2026-11-28, 4x H200, issue 20 (night: 1B DP, 4 micro-batches a replica; late: 7B
    # layers, 8 micro-batches a replica, interleaved pipelines compiled).
    ("1B, 1 GPU, compiled, 4x8 per step (11-28, fit)", "h200", [],
     Layout(1, 1, 1, 1, micro_batch_size=8), 32, "57.9%"),
    ("1B, DP2 ddp, compiled (11-28)", "h200", [], Layout(1, 1, 1, 2, micro_batch_size=8), 32, "eff 98.2%"),
    ("1B, DP4 ddp, compiled (11-28)", "h200", [], Layout(1, 1, 1, 4, micro_batch_size=8), 32, "eff 97.4%"),
    ("7B layers, 1 GPU, compiled, 8x4 per step (fit)", "h200", SEVEN_B_LAYERS,
     Layout(1, 1, 1, 1, micro_batch_size=4), 32, "59.7%"),
    ("7B layers, PP2 v2, compiled", "h200", SEVEN_B_LAYERS,
     Layout(1, 1, 2, 1, vpp=2, micro_batch_size=4), 32, "eff 83.5%"),
    ("7B layers, PP4 v2, compiled", "h200", SEVEN_B_LAYERS,
     Layout(1, 1, 4, 1, vpp=2, micro_batch_size=4), 32, "eff 60.4%"),
    ("1B, DP2 ddp, eager", "h200", [], Layout(1, 1, 1, 2, micro_batch_size=8), 32, "eff 98.6%"),
    ("1B, PP2 1F1B, eager", "h200", [], Layout(1, 1, 2, 1, micro_batch_size=8), 64, "eff 83.6%"),
    ("1B, PP2 v2, eager", "h200", [],
     Layout(1, 1, 2, 1, vpp=2, micro_batch_size=8), 64, "eff 85.4%"),
    ("1B, PP4 1F1B, eager", "h200", [], Layout(1, 1, 4, 1, micro_batch_size=8), 64, "eff 65.7%"),
    ("1B, CP2, eager (fit)", "h200", [], Layout(1, 2, 1, 1, micro_batch_size=8), 64, "eff 80.6%"),
]  # fmt: skip


def calibration_rows() -> list[str]:
    rows = []
    for label, gpu, sets, layout, per_replica, measured in OURS:
        config = load_config(REPO / "configs" / "llama-1b.yaml", sets)
        shapes = Shapes.of(config, 2048)
        kind = gpu_kind(gpu)
        many = predict(
            config, shapes, layout, Cluster(kind, layout.world, 8, 400.0), per_replica * layout.dp
        )
        one = predict(
            config, shapes, replace(layout, tp=1, cp=1, pp=1, dp=1, vpp=1),
            Cluster(kind, 1, 8, 400.0), per_replica,
        )  # fmt: skip
        predicted = (
            f"eff {many.tokens_per_s / layout.world / one.tokens_per_s:.1%}"
            if measured.startswith("eff")
            else f"{many.mfu:.1%}"
        )
        rows.append(f"| {label} | {gpu.upper()} | {measured} | {predicted} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print("| our run | GPU | measured | predicted |")
    print("|---|---|---|---|")
    print("\n".join(calibration_rows()), end="\n\n")
    print(
        "| run | source | GPUs | published layout | published MFU | predicted MFU | "
        "predicted GiB/GPU | searched at that layout | planner's top choice = published? |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in RUNS:
        print(row(check(run)), flush=True)


if __name__ == "__main__":
    main()
