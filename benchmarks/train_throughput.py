"""Training throughput on one GPU: Megalith's trainer against Hugging Face, in one run.

Each variant runs in its own process (so one cannot fragment another's memory) and
reports tokens/s over the timed steps after warm-up:

* ``matmul``      bf16 8192³ matrix products: the achievable peak on this GPU
* ``ours``        Megalith's training step as ``Trainer.fit`` runs it: real shards, real
                  DataLoader, fused AdamW, bf16 autocast, gradient clipping; each step's
                  loss read after the next step is launched
* ``ours-compile`` the same with ``training.compile=true``
* ``hf``          transformers' LlamaForCausalLM / GPT2LMHeadModel (SDPA), same shape,
                  bf16 autocast over fp32 weights, fused AdamW, clipping; batches
                  already on the GPU (no loader cost); no per-step host sync (losses
                  read after timing, as HF Trainer reads them only to log)
* ``hf-compile``  the same under ``torch.compile``
* ``hf-compile-cudagraphs`` the same with ``mode="reduce-overhead"`` (CUDA graphs), the
                  peer of ``ours-compile-cudagraphs`` (``training.compile_mode``)

An ``ours`` variant may carry config settings after ``@`` to measure one switch on its
own in the same run (several joined by ``+``), e.g.
``--variants matmul,ours-compile,ours-compile@model.loss_chunk_tokens=4096,hf-compile``
measures the fused output layer + cross-entropy beside the plain head. Short names
(:data:`ALIASES`) stand for common settings: ``ours-compile-fp8`` is
``ours-compile@mixed_precision.fp8=true`` (torchao float8, tensorwise),
``ours-compile-fp8-rowwise`` the rowwise recipe, ``ours-te``/``ours-te-fp8`` the Transformer
Engine backend (fp8 tensorwise: current scaling); more settings may follow ``@``.
``--shape tiny`` (configs/tiny-cpu.yaml) smoke-runs the ``ours`` and ``hf`` variants on CPU.
``--shape t5-base`` (configs/t5-base.yaml) measures the T5 encoder-decoder on span
corruption against transformers' ``T5ForConditionalGeneration``; a T5 sample counts as its
encoder plus decoder tokens and its FLOPs come from ``encoder_decoder_flops``
(``--shape t5-tiny`` smoke-runs it on CPU). A step is one micro-batch of the shape's
``micro_batch_size`` (``--micro-batch`` sets it), or ``--accumulation N`` of them, for ours
and HF's alike. For ours the table also gives the timed step's wall time and, in brackets,
the host's time to queue one step from an idle GPU (:func:`launch_ms`): the two close
together mean the host bounds the step.

    python benchmarks/train_throughput.py --shape 1b --steps 20 --out results/

MFU = tokens/s × (6·N + 12·L·H·S) / 989 TFLOP/s with N the matmul parameters of
the blocks and the output head (the input embedding is a lookup, not a matmul).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "1b": ROOT / "configs" / "llama-1b.yaml",
    "350m": ROOT / "configs" / "gpt2-350m.yaml",
    "tiny": ROOT / "configs" / "tiny-cpu.yaml",  # CPU smoke runs
    "t5-base": ROOT / "configs" / "t5-base.yaml",
    "t5-tiny": ROOT / "configs" / "t5-tiny-cpu.yaml",  # CPU smoke runs
}
# Smaller still than the recipe: torch's CPU float8 matmul is a slow reference kernel.
SHAPE_SETTINGS = {
    "tiny": [
        "model.hidden_size=64",
        "model.ffn_hidden_size=128",
        "model.num_layers=2",
        "data.seq_length=64",
        "model.max_position_embeddings=64",
        "model.vocab_size=null",
    ]
}
PEAK = 989e12
FP8 = "mixed_precision.fp8=true"
TE = "model.backend=te"
ALIASES = {
    "ours-fp8": f"ours@{FP8}",
    "ours-compile-fp8": f"ours-compile@{FP8}",
    "ours-compile-fp8-rowwise": f"ours-compile@{FP8}+mixed_precision.fp8_recipe=rowwise",
    "ours-te": f"ours@{TE}",
    "ours-te-fp8": f"ours@{TE}+{FP8}",
    "ours-compile-cudagraphs": "ours-compile@training.compile_mode=reduce-overhead",
    # CUDA graphs over torchao's fp8 (auto could pick TE's fp8, which the mode refuses)
    "ours-compile-fp8-cudagraphs": (
        f"ours-compile@{FP8}+model.backend=torch+training.compile_mode=reduce-overhead"
    ),
}


def load_shape(
    shape: str,
    shards: str,
    steps: int,
    compile_model: bool,
    micro_batch: int | None,
    settings: list[str] = (),
    accumulation: int = 1,
):
    from megalith.config import load_config

    config = load_config(
        SHAPES[shape],
        SHAPE_SETTINGS.get(shape, []) + list(settings),
        values={
            "data.inputs": [],
            "data.output": shards,
            "training.train_iters": steps,
            "training.eval_interval": 0,
            "training.compile": compile_model,
            "training.num_workers": 2,
            "logging.mlflow": False,
            "checkpoint.interval": 0,
        },
    )
    mbs = micro_batch or config.training.micro_batch_size
    config.training = config.training.model_copy(
        update={"micro_batch_size": mbs, "global_batch_size": mbs * accumulation}
    )
    return config


def flops_per_token(config) -> float:
    return tokens_and_flops(config)[1]


def tokens_and_flops(config) -> tuple[int, float]:
    """A sample's tokens (T5: encoder + decoder) and the FLOPs per such token, as the
    trainer counts them (the model family's spec)."""
    from training.families import model_family
    from training.trainer import resolve_model_config

    model = resolve_model_config(config)
    return model_family(model).tokens_and_flops(model, config.data)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


class FitSteps:
    """Training steps launched the way ``Trainer.fit`` launches them: step k's metrics are
    read once step k + 1 is queued, so the host prepares the next step while the GPU still
    runs this one. Call it once per step; :meth:`finish` reads the step still pending."""

    def __init__(self, trainer, batches):
        self.trainer, self.batches = trainer, batches
        self.records: list[dict] = []
        self._pending = []

    def __call__(self) -> None:
        self._pending.append(self.trainer.launch_step(self.batches))
        if len(self._pending) > 1:
            self.records.append(self._pending.pop(0).result())

    def finish(self) -> list[dict]:
        """Every step's metrics, oldest first."""
        while self._pending:
            self.records.append(self._pending.pop(0).result())
        return self.records


def time_steps(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    _synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize()
    return time.perf_counter() - started


LAUNCH_STEPS = 3  # steps run after the timed ones, each from an idle GPU
SYNC_STEPS = 1  # then one step watched for host syncs


def launch_ms(trainer, batches, steps: int = LAUNCH_STEPS) -> float:
    """The host's time to queue one step from an idle GPU, in ms (median of ``steps``).
    Near the timed step's wall time, the host bounds the step (CUDA graphs remove that);
    well below it, the GPU does, and the idle time a profile shows comes from elsewhere.
    (A launch blocks once the driver's launch queue is full, so on a step of many small
    kernels this can also read near the step time when the GPU is the bound.)"""
    times = []
    for _ in range(steps):
        _synchronize()
        started = time.perf_counter()
        pending = trainer.launch_step(batches)
        times.append(time.perf_counter() - started)
        pending.result()
    return 1e3 * statistics.median(times)


def host_syncs(trainer, batches) -> dict[str, int]:
    """Where one more step makes the host wait for the GPU (``.item()``, a blocking copy,
    a stream synchronize: what ``torch.cuda.set_sync_debug_mode`` flags), as ``python
    site -> count``. A sync inside the step drains the GPU's queue, and the GPU then idles
    while the host launches what follows: waiting no kernel profile explains. Reading the
    step's metrics afterwards (an event wait) is not counted."""
    import torch

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing CUDA operation" not in str(message):
            return
        frames = [f for f in traceback.extract_stack() if not f.filename.endswith("warnings.py")]
        stack = [f"{f.filename}({f.lineno}): {f.name}" for f in frames[-2::-1]]  # innermost first
        site = python_site(stack) or f"{filename}({lineno})"
        sites[site] = sites.get(site, 0) + 1

    _synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = trainer.launch_step(batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    pending.result()
    return sites


def profile_steps(step, out: Path, variant: str, steps: int = 3) -> None:
    """A few more steps under torch.profiler: the kernels by GPU time, to OUT/profile-VARIANT.txt.
    Recording Python stacks slows the host: compare the profile's GPU span per step with
    the timed steps before reading its idle time as the unprofiled run's."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    # Python stacks (kept on the events only in verbose mode) let idle_by_host_site name
    # the code the GPU waits for.
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        with_stack=True,
        experimental_config=_ExperimentalConfig(verbose=True),
    ) as prof:
        for _ in range(steps):
            step()
        _synchronize()
    import torch

    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=70, max_name_column_width=100)
    name = variant.replace("/", "_").replace("@", "_at_")
    summary = kernel_summary(prof.events(), steps) if torch.cuda.is_available() else ""
    print(f"profile {variant}\n{summary}", flush=True)
    (out / f"profile-{name}.txt").write_text(f"{steps} steps of {variant}\n{summary}\n{table}\n")


# Kernel name patterns, first match wins (cuDNN's attention kernels also carry "sm90").
KERNEL_CATEGORIES = (
    # NCCL's collectives, TE's userbuffers (comm+GEMM overlap) kernels and their copies
    ("communication (NCCL, userbuffers)", r"nccl|userbuffers|kuserbuffers|ub_|memcpy.*peer"),
    ("attention", r"sdpa|fmha|flash|attention|cudnn|bias_grad"),  # + T5's bias gradient
    (  # Inductor's (named after _scaled_mm), TE's (cast-transpose, amax, scale), and the
        # gated MLP's own (training.precision.gated_fp8: _gated[_grad]_{amax,to_float8}_kernel)
        "fp8 amax/scale/cast",
        r"triton.*(abs|clamp|float8|amax)|cast_transpose|amax_kernel|scale_from_amax|fp8_quantize"
        r"|to_float8_kernel",
    ),
    ("SwiGLU / GeGLU, one pass (ours)", r"_gated_(forward|backward)_kernel"),
    ("matmul", r"nvjet|gemm|cutlass|xmma|scaled_mm|f8f8|sm90_"),
    ("norms (LayerNorm, RMSNorm)", r"rmsnorm|layer_norm|layernorm"),
    ("grad norm", r"lpnorm|norm_kernel"),
    ("optimizer (fused AdamW)", r"adam|multi_tensor"),
    ("loss (log-softmax/CE)", r"log_softmax|softmax|nll|logsumexp|cross_entropy"),
    ("RMSNorm (Inductor)", r"rsqrt"),
    ("SwiGLU (Inductor)", r"sigmoid|silu"),
    ("GeGLU (Inductor)", r"gelu"),  # T5's; its kernels also carry "cat"
    ("RoPE (Inductor)", r"neg|\bcat\b|_cat_|cos|sin"),
    ("other Inductor kernels", r"triton"),
    # One eager op per kernel: residual and gradient-accumulation adds, muls, the cats of
    # RoPE's rotate-half (what compilation would fuse)
    ("eager adds, muls and cats", r"functor_add|binaryfunctor|mulfunctor|catarray"),
    ("aten copies/casts/fills", r"memcpy|memset|copy|fill|elementwise|vectorized|cast"),
    ("embedding/index", r"embedding|index|scatter|gather"),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def kernel_summary(events, steps: int) -> str:
    """GPU kernel time per step by category, the idle time between kernels, the top kernels."""
    kernels = [  # "Optimizer.step#AdamW.step", "nccl:all_reduce" and such annotate kernels
        e
        for e in events
        if str(e.device_type).endswith("CUDA")
        and "#" not in e.name
        and not e.name.startswith("nccl:")
    ]
    if not kernels:
        return "no CUDA kernels recorded"
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:  # union of intervals: overlapping kernels count once
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    wall = (spans[-1][1] - spans[0][0]) / 1000 / steps
    by_category: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for e in kernels:
        ms = (e.time_range.end - e.time_range.start) / 1000 / steps
        by_category[kernel_category(e.name)] = by_category.get(kernel_category(e.name), 0) + ms
        by_kernel[e.name] = by_kernel.get(e.name, 0) + ms
    total = sum(by_category.values())
    # The kernel count: a timed step's time beyond its kernels' sum, over it, is the mean
    # gap between kernels where the host is ahead and never syncs (launch_ms, host_syncs).
    lines = [
        f"GPU span {wall:.1f} ms/step, {len(kernels) / steps:.0f} kernels a step, "
        f"kernels busy {busy / 1000 / steps:.1f}, idle {wall - busy / 1000 / steps:.1f} ms/step",
        "| part | ms/step | share of kernel time |",
        "|---|---|---|",
    ]
    for category, ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {category} | {ms:.2f} | {100 * ms / total:.1f}% |")
    lines += ["", "| kernel | category | ms/step |", "|---|---|---|"]
    for kernel, ms in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:45]:
        lines.append(f"| {kernel[:110]} | {kernel_category(kernel)} | {ms:.2f} |")
    return "\n".join(lines + [""] + idle_gaps(events, kernels, steps))


def idle_gaps(events, kernels, steps: int, shown: int = 15) -> list[str]:
    """Where the GPU waits: the idle time between kernels by gap size, the longest gaps
    with the kernels around them and the innermost host operations running then, and
    all idle time summed by what the host was doing (:func:`idle_by_host_site`)."""
    gaps = kernel_gaps(kernels)
    buckets = {"< 0.1 ms": 0.0, "0.1-1 ms": 0.0, "1-10 ms": 0.0, ">= 10 ms": 0.0}
    for gap, *_ in gaps:
        key = (
            "< 0.1 ms"
            if gap < 100
            else "0.1-1 ms"
            if gap < 1000
            else "1-10 ms"
            if gap < 1e4
            else ">= 10 ms"
        )
        buckets[key] += gap / 1000 / steps
    host = [e for e in events if not str(e.device_type).endswith("CUDA")]
    lines = ["| idle gaps of | ms/step |", "|---|---|"]
    lines += [f"| {key} | {ms:.1f} |" for key, ms in buckets.items()]
    lines += ["", "| gap ms | after kernel | before kernel | host ops then (innermost first) |"]
    lines += ["|---|---|---|---|"]
    for gap, start, before, after in sorted(gaps, key=lambda g: -g[0])[:shown]:
        middle = start + gap / 2
        running = sorted(
            (e for e in host if e.time_range.start <= middle <= e.time_range.end),
            key=lambda e: e.time_range.end - e.time_range.start,
        )
        names = " < ".join(e.name[:40] for e in running[:4])
        lines.append(f"| {gap / 1000:.2f} | {before.name[:45]} | {after.name[:45]} | {names} |")
    return lines + [""] + idle_by_host_site(host, gaps, steps, shown)


def kernel_gaps(kernels) -> list[tuple[float, float, object, object]]:
    """``(gap µs, start µs, kernel before, kernel after)`` of every stretch in which no
    kernel runs (overlapping kernels count as one busy interval)."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    gaps, end, last = [], ordered[0].time_range.end, ordered[0]
    for e in ordered[1:]:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, end, last, e))
        if e.time_range.end > end:
            end, last = e.time_range.end, e
    return gaps


# Idle attribution: frames of our code, a Python function's own profiler event, the CUDA
# runtime calls that mark a thread as one that launches kernels.
OWN_CODE = ("training/", "megalith/", "benchmarks/", "preprocessing/")
PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")
LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaGraphLaunch|cudaMemcpyAsync)")


def idle_by_host_site(host, gaps, steps: int, shown: int = 15) -> list[str]:
    """All GPU idle time summed by what the threads that launch kernels were doing at
    each gap's middle: their innermost host operation (none: plain Python between ops)
    and, where the profile recorded Python stacks, the code running it. Other threads
    (the data loader's) are left out: a wait there does not starve the GPU."""
    launches: dict[int, int] = {}
    for event in host:
        if LAUNCH.search(event.name):
            launches[event.thread] = launches.get(event.thread, 0) + 1
    label = {thread: f"t{i}" for i, thread in enumerate(sorted(launches, key=launches.get)[::-1])}
    sites: dict[tuple[str, str], float] = {}
    by_start = sorted((e for e in host if e.thread in label), key=lambda e: e.time_range.start)
    running: list[tuple[float, int, object]] = []  # heap of (end, tiebreak, event)
    position = 0
    for gap, start, _, _ in sorted(gaps, key=lambda g: g[1]):
        middle = start + gap / 2
        while position < len(by_start) and by_start[position].time_range.start <= middle:
            event = by_start[position]
            heapq.heappush(running, (event.time_range.end, position, event))
            position += 1
        while running and running[0][0] < middle:
            heapq.heappop(running)
        site = _innermost_site([event for *_, event in running], label)
        sites[site] = sites.get(site, 0.0) + gap / 1000 / steps
    lines = [
        "| idle ms/step | innermost host op (launching thread) | Python then (innermost; ours) |",
        "|---|---|---|",
    ]
    for (op, frame), ms in sorted(sites.items(), key=lambda kv: -kv[1])[:shown]:
        lines.append(f"| {ms:.1f} | {op} | {frame} |")
    return lines


def _duration(event) -> float:
    return event.time_range.end - event.time_range.start


def _innermost_site(running: list, label: dict[int, str]) -> tuple[str, str]:
    """``(op (thread), Python site)`` of the shortest event running; its own stack or,
    for a CUDA runtime call, that of the innermost event around it with one."""
    if not running:
        return "(Python between ops)", ""
    innermost = min(running, key=_duration)
    op = f"{innermost.name[:50]} ({label[innermost.thread]})"
    with_stack = [e for e in running if e.thread == innermost.thread and getattr(e, "stack", None)]
    if not with_stack:
        return op, ""
    event = min(with_stack, key=_duration)
    # A Python function's own event carries its callers' frames only.
    own = [event.name] if PYTHON_FRAME.search(event.name) else []
    return op, python_site(own + list(event.stack))


def python_site(stack: list[str]) -> str:
    """The innermost Python frame of a profiled op's stack (innermost first; built-in
    methods skipped) and, where that is library code, the innermost frame of ours."""
    frames = [frame for frame in stack if not frame.startswith("<")]
    if not frames:
        return ""
    ours = next((frame for frame in frames if any(part in frame for part in OWN_CODE)), "")
    site = frames[0][-70:]
    return site if not ours or ours == frames[0] else f"{site}; {ours[-70:]}"


def run_matmul() -> dict:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = time_steps(lambda: a @ b, 5, 50)
    return {"tflops": 2 * n**3 * 50 / seconds / 1e12}


def run_ours(args, compile_model: bool) -> dict:
    from torch._dynamo.utils import counters

    from training.metrics.memory import cuda_alloc_retries
    from training.models import backend_name
    from training.trainer import Trainer

    config = load_shape(
        args.shape,
        args.shards,
        args.warmup + args.steps + 3 * args.profile + LAUNCH_STEPS + SYNC_STEPS,
        compile_model,
        args.micro_batch,
        variant_settings(args.variant),
        args.accumulation,
    )
    trainer = Trainer(config, Path(args.out) / f"run-{args.variant}")
    batches = iter(trainer._loader(trainer.train_data, 0, len(trainer.train_data)))
    step = FitSteps(trainer, batches)
    seconds = time_steps(step, args.warmup, args.steps)
    if args.profile:
        profile_steps(step, Path(args.out), args.variant)
    losses = [record["loss"] for record in step.finish()]
    tokens = args.steps * config.training.global_batch_size * trainer.tokens_per_sample
    result = _result(config, tokens, seconds, losses, _peak_memory())
    result["step_ms"] = 1e3 * seconds / args.steps
    result["launch_ms"] = launch_ms(trainer, batches)
    if trainer.device.type == "cuda":
        result["host_syncs"] = host_syncs(trainer, batches)
    # Each retry waits for the GPU: a stall no kernel profile shows.
    result["alloc_retries"] = cuda_alloc_retries() if trainer.device.type == "cuda" else 0
    result["kernel_backend"] = backend_name(trainer.model)  # what auto resolved to
    # Compiled regions Inductor ran without the CUDA graphs compile_mode asked for.
    result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    return result


def hf_model(config):
    from training.trainer import resolve_model_config

    m = resolve_model_config(config)
    return HF_REFERENCE[m.family].build(m)


def _hf_t5(m):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from training.interop.hf_t5 import hf_t5_config

    ids = {"pad": 0, "eos": 1, "decoder_start": 0}
    model = T5ForConditionalGeneration(T5Config(**hf_t5_config(m, "float32", ids)))
    # transformers 5 ties the head to the embedding at init; T5 v1.1 (and ours) does not.
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _hf_decoder(m):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if m.style == "llama":
        hf = LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_query_groups, max_position_embeddings=m.max_position_embeddings,
            rope_theta=m.rope_base, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
            attn_implementation="sdpa",
        )  # fmt: skip
        return LlamaForCausalLM(hf)
    hf = GPT2Config(
        vocab_size=m.vocab_size, n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_attention_heads,
        n_inner=m.ffn_hidden_size, n_positions=m.max_position_embeddings, attn_implementation="sdpa",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(hf)


def _t5_lengths(data):
    from training.objectives.t5 import sample_lengths

    return sample_lengths(data)  # encoder S tokens in, decoder T tokens scored


class HFReference(NamedTuple):
    """The Hugging Face model a family is timed against: its builder, the (input, label)
    lengths of a sample and whether the labels are the inputs (HF shifts them)."""

    build: Callable
    lengths: Callable
    labels_are_inputs: bool


# By model.family (the names training.families registers).
HF_REFERENCE = {
    "gpt": HFReference(_hf_decoder, lambda data: (data.seq_length, data.seq_length), True),
    "t5": HFReference(_hf_t5, _t5_lengths, False),
}


def run_hf(args, compile_model: bool, mode: str = "default") -> dict:
    import torch

    from training.optim.adamw import zero_grads

    accumulation = args.accumulation
    config = load_shape(args.shape, args.shards, 1, False, args.micro_batch, (), accumulation)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the smoke shapes only
    model = hf_model(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    forward = torch.compile(model, mode=mode) if compile_model else model
    mbs = config.training.micro_batch_size
    reference = HF_REFERENCE[config.model.family]
    seq, decoder = reference.lengths(config.data)
    batches = [
        (
            torch.randint(0, 2048, (mbs, seq), device=device),
            torch.randint(0, 2048, (mbs, decoder), device=device),
        )
        for _ in range(4)
    ]
    losses, counter = [], [0]

    # Accumulating under CUDA graphs keeps the gradients outside the graphs' memory, as
    # Megalith's trainer does.
    resident = accumulation > 1 and mode == "reduce-overhead"

    def step():
        zero_grads(optimizer, model.parameters(), resident=resident)
        total = 0.0
        for _ in range(accumulation):
            tokens, labels = batches[counter[0] % len(batches)]
            counter[0] += 1
            if reference.labels_are_inputs:
                labels = tokens
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = forward(input_ids=tokens, labels=labels).loss / accumulation
            loss.backward()
            # A CUDA graph's output is overwritten by its next replay: added up here.
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)  # read after timing, as HF Trainer reads only at logging

    seconds = time_steps(step, args.warmup, args.steps)
    if args.profile:
        profile_steps(step, Path(args.out), args.variant)
    losses = [loss.item() for loss in losses]
    tokens = args.steps * mbs * accumulation * tokens_and_flops(config)[0]
    return _result(config, tokens, seconds, losses, _peak_memory())


def _result(config, tokens: int, seconds: float, losses: list[float], memory: int) -> dict:
    tokens_per_s = tokens / seconds
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(config) / PEAK,
        "flops_per_token": flops_per_token(config),
        "peak_memory_gb": memory / 2**30,
        "micro_batch": config.training.micro_batch_size,
        "global_batch": config.training.global_batch_size,
        "seq_length": config.data.seq_length,
        "last_loss": losses[-1] if losses else None,
    }


def expand_variant(variant: str) -> str:
    """An alias (``ours-compile-fp8``, with or without ``@settings``) in full."""
    name, _, settings = variant.partition("@")
    if name not in ALIASES:
        return variant
    return ALIASES[name] + (f"+{settings}" if settings else "")


def variant_settings(variant: str) -> list[str]:
    """``ours-compile@model.loss_chunk_tokens=4096+training.x=y`` -> the ``KEY=VALUE`` list."""
    _, _, settings = expand_variant(variant).partition("@")
    return [item for item in settings.split("+") if item]


def worker(args) -> None:
    runners = {
        "matmul": run_matmul,
        "ours": lambda: run_ours(args, False),
        "ours-compile": lambda: run_ours(args, True),
        "hf": lambda: run_hf(args, False),
        "hf-compile": lambda: run_hf(args, True),
        "hf-compile-cudagraphs": lambda: run_hf(args, True, "reduce-overhead"),
    }
    print(
        "RESULT " + json.dumps(runners[expand_variant(args.variant).partition("@")[0]]()),
        flush=True,
    )


def prepare_shards(out: Path, sentinels: int = 0) -> str:
    """The sample corpus with a 2048-piece tokenizer (``sentinels`` T5 sentinels among them)."""
    from megalith.config import DataConfig, TokenizerConfig
    from preprocessing.prepare import prepare_dataset
    from preprocessing.tokenizer import train_tokenizer

    name = f"-sentinels{sentinels}" if sentinels else ""
    shards = out / f"shards{name}"
    if (shards / "manifest.json").exists():
        return str(shards)
    corpus = ROOT / "preprocessing" / "sample_corpus" / "stories.jsonl"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip()]
    tokenizer = train_tokenizer(
        texts,
        TokenizerConfig(vocab_size=2048, sentinel_tokens=sentinels),
        str(out / f"tokenizer{name}"),
    )
    prepare_dataset(
        DataConfig(inputs=[str(corpus)], output=str(shards), workers=4),
        tokenizer,
        show_progress=False,
    )
    return str(shards)


def run_worker(command: list[str], error_chars: int = 1500) -> dict:
    """One variant's worker process: its ``RESULT`` JSON, or the end of what it printed
    as ``error``; with ``wall_s`` either way."""
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode or not lines:
        result = {"error": (completed.stderr or completed.stdout)[-error_chars:]}
    else:
        result = json.loads(lines[-1].removeprefix("RESULT "))
    result["wall_s"] = time.perf_counter() - started
    return result


def drive(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = prepare_shards(out, sentinels=100 if args.shape.startswith("t5") else 0)
    results = {}
    for variant in args.variants.split(","):
        command = [
            sys.executable, __file__, "--worker", "--variant", variant, "--shape", args.shape,
            "--shards", shards, "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
            "--accumulation", str(args.accumulation),
        ] + (["--micro-batch", str(args.micro_batch)] if args.micro_batch else [])  # fmt: skip
        command += ["--profile"] * args.profile
        results[variant] = run_worker(command)
        print(variant, json.dumps(results[variant])[:300], flush=True)
    report = {
        "date": str(date.today()),
        "shape": args.shape,
        "device": _device(),
        "results": results,
    }
    (out / f"throughput-{args.shape}.json").write_text(json.dumps(report, indent=2))
    print(table(report))


def table(report: dict) -> str:
    results = report["results"]
    peak = results.get("matmul", {}).get("tflops")
    base = results.get("hf-compile", {}).get("tokens_per_s")
    lines = [
        f"{report['device']}, shape {report['shape']}, matmul peak {peak or float('nan'):.0f} TFLOP/s",
        "| variant | tokens/s | MFU (989) | of matmul peak | peak mem GiB | × hf-compile | step ms (host launch) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name == "matmul" or "tokens_per_s" not in r:
            continue
        achieved = r["tokens_per_s"] * r["flops_per_token"]
        label = f"{name} ({r['kernel_backend']})" if "kernel_backend" in r else name
        lines.append(
            f"| {label} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
            f"{100 * achieved / (peak * 1e12) if peak else float('nan'):.1f}% | {r['peak_memory_gb']:.1f} | "
            f"{r['tokens_per_s'] / base if base else float('nan'):.2f} | {_step_times(r)} |"
        )
    for name, r in results.items():
        if "host_syncs" in r:
            syncs = ", ".join(f"{site} ×{count}" for site, count in r["host_syncs"].items())
            lines.append(f"{name}: host syncs in one step: {syncs or 'none'}")
    return "\n".join(lines)


def _step_times(result: dict) -> str:
    if "launch_ms" not in result:  # HF's loop has no separate launch
        return ""
    return f"{result['step_ms']:.1f} ({result['launch_ms']:.1f})"


def _device() -> str:
    try:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        return f"{name} (torch {torch.__version__})"
    except Exception:  # noqa: BLE001 - only for the report header
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--variants", default="matmul,ours,ours-compile,hf,hf-compile")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches a step (ours and HF's)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmark-out"))
    parser.add_argument(
        "--profile", action="store_true", help="then profile 3 steps: OUT/profile-VARIANT.txt"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
