"""The GPU benchmarks run end to end on CPU at their smoke shapes, so a device call never
spends its minutes finding a broken path."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import parallel_scaling as scaling
from benchmarks.train_throughput import SHAPE_SETTINGS

ROOT = Path(__file__).resolve().parents[1]


def test_t5_throughput_runs_ours_and_the_hugging_face_baseline(tmp_path: Path) -> None:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--shape", "t5-tiny",
        "--variants", "ours,hf", "--steps", "1", "--warmup", "1", "--micro-batch", "2",
        "--accumulation", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]

    results = json.loads((tmp_path / "throughput-t5-tiny.json").read_text())["results"]
    for variant in ("ours", "hf"):
        result = results[variant]
        assert "error" not in result, f"{variant}: {result.get('error')}"
        assert result["tokens_per_s"] > 0 and math.isfinite(result["last_loss"]), result
        assert result["global_batch"] == 4, result  # two micro-batches of 2 a step
    assert results["ours"]["kernel_backend"] == "torch"  # what auto resolved to, on CPU
    # The host's time to queue a step, after the timed steps (on CPU the step runs as it
    # is queued, so the two are the same work).
    assert results["ours"]["launch_ms"] > 0 and results["ours"]["step_ms"] > 0
    assert isinstance(results["ours"]["alloc_retries"], int)  # counted on CUDA only
    assert "| hf |" in completed.stdout and "| ours (torch) |" in completed.stdout


def test_optimizer_benchmark_steps_every_variant_to_the_same_parameters() -> None:
    """The optimizer steps (the trainer's fused AdamW, the same over flat buffers, the
    compiled foreach step, the multi-tensor one) on the tiny recipe's parameters: each moves them, all to
    the same values (AdamW is elementwise), and the count is the model's."""
    from benchmarks import optimizer_step
    from megalith.config import load_config
    from training.models import meta_model

    settings = ["model.vocab_size=512"]
    args = SimpleNamespace(shape="tiny", set=settings, device="cpu", steps=2,
                           variants=list(optimizer_step.VARIANTS))  # fmt: skip
    report = optimizer_step.run(args)
    config = load_config(ROOT / "configs" / "tiny-cpu.yaml", [*SHAPE_SETTINGS["tiny"], *settings])
    assert report["parameters"] == sum(p.numel() for p in meta_model(config.model).parameters())
    assert set(report["results"]) == set(optimizer_step.VARIANTS)
    for variant, result in report["results"].items():
        assert result["max_abs_update"] > 1e-5, (variant, result)
        assert result["max_abs_diff_vs_first"] < 1e-6, (variant, result)
        assert result["ms"] > 0
    assert "| compiled-foreach |" in optimizer_step.table(report)


def test_data_loader_benchmark_draws_t5_batches(tmp_path: Path) -> None:
    """The loader benchmark at a T5 shape: span-corrupted micro-batches counted as encoder
    plus decoder tokens, in the training process and with a worker."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "data_loader.py"), "--shape", "t5-tiny",
        "--micro-batch", "4", "--workers", "0", "1", "--batches", "3", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = json.loads((tmp_path / "data-loader.json").read_text())
    assert [row["workers"] for row in rows] == [0, 1]
    for row in rows:
        assert row["micro_batch"] == 4 and row["tokens_per_s"] > 0
        assert row["tokens_per_sample"] > 0 and row["headroom"] is None  # no GPU figure for it


def test_parallel_scaling_times_each_layout_and_checks_it_against_one_process(
    tmp_path: Path,
) -> None:
    """The scaling benchmark on gloo (its CPU smoke mode): each layout runs under torchrun
    with the steps launched as ``Trainer.fit`` launches them, and a model-parallel layout's
    losses are one process's (to rounding): the timed steps are the same steps, here with
    TP=2 at twice the micro-batch in half as many micro-batches (``mb4``)."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "parallel_scaling.py"), "--shape", "tiny",
        "--device", "cpu", "--layouts", "1gpu,tp2-mb4", "--steps", "3", "--warmup", "2",
        "--accumulation", "2", "--timeout", "240", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]

    results = json.loads((tmp_path / "scaling-tiny.json").read_text())["results"]
    one, tp2 = results["1gpu"], results["tp2-mb4"]
    assert "error" not in tp2, tp2.get("error")
    assert one["tokens_per_s"] > 0 and tp2["tokens_per_s"] > 0
    assert (one["micro_batches"], tp2["micro_batches"]) == (2, 1)  # 2 x 2 samples, 1 x 4
    assert len(one["losses"]) == len(tp2["losses"]) == 3
    for ours, reference in zip(tp2["losses"], one["losses"], strict=True):
        assert math.isclose(ours, reference, rel_tol=1e-5)
    assert "| tp2-mb4 | 2 |" in completed.stdout
    with pytest.raises(SystemExit, match="micro-batch 3 on 1 replicas does not divide"):
        scaling.build_config("tiny", "tp2-mb3", str(tmp_path), 1, 2, False)


def test_curate_benchmark_scores_planted_near_duplicates(tmp_path: Path) -> None:
    """benchmarks/curate.py at a smoke size, without datatrove (not a project dependency)."""
    out = tmp_path / "curate.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "curate.py"), "--documents", "150",
        "--planted", "30", "--index-documents", "300", "--no-datatrove", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(out.read_text())
    near = results["ours_near"]
    assert near["precision"] == 1.0  # random documents are never near each other
    assert near["recall_by_edits"]["1"] == 1.0  # one word changed: found every time
    assert results["ours_full"]["kept"] < results["documents"]
    assert results["memory"][0]["lsh_bytes"] > 0


def test_profile_sums_gpu_idle_time_by_the_host_code_running_then() -> None:
    """``--profile``'s idle table: the GPU's gaps between kernels (overlapping kernels are
    one busy stretch), each charged to what the kernel-launching thread was doing at its
    middle: its innermost op and the Python code running then (the innermost frame, and
    ours where that is library code), or plain Python between ops; a thread that
    launches nothing (the data loader's) is not charged. Longest charge first."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_throughput

    def event(name, start, end, device="CPU", stack=None, thread=1):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                               device_type=f"DeviceType.{device}", stack=stack or [],
                               thread=thread)  # fmt: skip

    kernels = [event("gemm", 0, 100, "CUDA"), event("cast", 80, 120, "CUDA"),
               event("softmax", 300, 400, "CUDA"), event("add", 450, 500, "CUDA"),
               event("mul", 700, 750, "CUDA")]  # fmt: skip
    host = [
        event("cudaLaunchKernel", 10, 20),
        event("aten::cat", 50, 330, stack=["training/models/layers.py(313): apply_rope"]),
        event("cudaEventSynchronize", 90, 320),
        event(
            "torch/cuda/streams.py(230): synchronize",
            85,
            325,
            stack=[
                "training/metrics/pending.py(39): result",
                "benchmarks/train_throughput.py(9): f",
            ],
        ),  # fmt: skip  (a Python function's own event: its callers' frames)
        event("cudaLaunchKernel", 410, 440),
        event("cudaEventSynchronize", 0, 900, thread=2),  # the pin-memory thread
    ]
    gaps = train_throughput.kernel_gaps(kernels)
    assert [(gap, start, before.name, after.name) for gap, start, before, after in gaps] == [
        (180, 120, "cast", "softmax"),
        (50, 400, "softmax", "add"),
        (200, 500, "add", "mul"),
    ]
    table = train_throughput.idle_by_host_site(host, gaps, steps=2)
    assert table[2:] == [
        "| 0.1 | (Python between ops) |  |",
        "| 0.1 | cudaEventSynchronize (t0) | torch/cuda/streams.py(230): synchronize; "
        "training/metrics/pending.py(39): result |",
        "| 0.0 | cudaLaunchKernel (t0) |  |",
    ]
    lines = train_throughput.idle_gaps(host + kernels, kernels, steps=2)
    assert "| 0.1-1 ms | 0.2 |" in lines and "| < 0.1 ms | 0.0 |" in lines
    assert lines[-3:] == table[2:]


def test_profile_summary_counts_kernels_and_their_busy_time_per_step() -> None:
    """The profile's first line: kernels a step (annotations and NCCL ranges are not
    kernels), their busy time with overlaps counted once, and the idle rest of the span."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_throughput

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                               device_type="DeviceType.CUDA", stack=[], thread=1)  # fmt: skip

    events = [kernel("gemm", 0, 1000), kernel("cast", 500, 1500), kernel("softmax", 3000, 4000),
              kernel("Optimizer.step#AdamW.step", 0, 4000), kernel("nccl:all_reduce", 0, 4000),
              kernel("gemm", 4000, 5000), kernel("add", 7000, 8000), kernel("mul", 9000, 10000)]  # fmt: skip
    first = train_throughput.kernel_summary(events, steps=2).splitlines()[0]
    # span 10 ms over 2 steps; busy 1.5 + 1 + 1 + 1 + 1 = 5.5 ms over 2 steps
    assert first == "GPU span 5.0 ms/step, 3 kernels a step, kernels busy 2.8, idle 2.2 ms/step"


@pytest.mark.gpu
def test_host_syncs_names_the_line_of_a_step_that_waits_for_the_gpu() -> None:
    """A step that reads a value with ``.item()`` mid-step is reported with the line that
    does it (a sync drains the GPU's queue); the step's own metrics, read afterwards
    through an event, are not counted, and a step without such a read reports none."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_throughput

    class Step:
        def __init__(self, sync: bool):
            self.sync = sync

        def launch_step(self, batches):
            x = next(batches)
            y = (x @ x).sum()
            if self.sync:
                y = y * (1 if y.item() > 0 else 2)  # the line that syncs
            return SimpleNamespace(result=lambda: float(y))

    batches = iter(lambda: torch.randn(256, 256, device="cuda"), None)
    syncing = train_throughput.host_syncs(Step(sync=True), batches)
    assert list(syncing.values()) == [1]
    (site,) = syncing
    innermost = site.split("; ")[0]  # then the innermost frame of ours: host_syncs here
    assert "test_benchmarks.py(" in innermost and innermost.endswith(": launch_step")
    assert train_throughput.host_syncs(Step(sync=False), batches) == {}


def test_profile_kernel_categories_name_what_the_time_is_spent_on() -> None:
    """Kernel names from a TE fp8 eager step and a compiled step (H100 profiles in
    benchmarks/RESULTS.md) land in the category that explains them: TE's fp8 casts with
    the fp8 work, the eager glue (adds, muls, RoPE's cats) apart from plain copies, a
    LayerNorm kernel as a norm and not as the gradient norm."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_throughput

    expected = {
        "cast_transpose_optimized_kernel(__nv_bfloat16 const*, float const*, __nv_fp8_e5m2*)": (
            "fp8 amax/scale/cast"
        ),
        "void transformer_engine::(anonymous namespace)::amax_kernel<16, true>": (
            "fp8 amax/scale/cast"
        ),
        "triton_red_fused__to_copy_abs_amax_clamp_0": "fp8 amax/scale/cast",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": (
            "eager adds, muls and cats"
        ),
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2u>>": (
            "eager adds, muls and cats"
        ),
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": (
            "aten copies/casts/fills"
        ),
        "void transformer_engine::normalization::rmsnorm_bwd_tuned_kernel<Kernel_traits>": (
            "norms (LayerNorm, RMSNorm)"
        ),
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>": (
            "norms (LayerNorm, RMSNorm)"
        ),
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor>": (
            "grad norm"
        ),
        "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float>": (
            "loss (log-softmax/CE)"
        ),
        "triton_per_fused_rsqrt_mean_0": "RMSNorm (Inductor)",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "_bias_grad_kernel": "attention",
        "triton_poi_fused__unsafe_view_cat_gelu_gelu_backward_mul_split_view_24": "GeGLU (Inductor)",
        "triton_poi_fused_cat_cos_neg_sin_0": "RoPE (Inductor)",
        "_gated_to_float8_kernel": "fp8 amax/scale/cast",
        "_gated_grad_to_float8_kernel": "fp8 amax/scale/cast",
        "_gated_grad_amax_kernel": "fp8 amax/scale/cast",
        "_gated_backward_kernel": "SwiGLU / GeGLU, one pass (ours)",
    }
    assert {name: train_throughput.kernel_category(name) for name in expected} == expected


def test_parallel_scaling_takes_its_one_gpu_baseline_from_another_run(tmp_path: Path) -> None:
    """Layouts run apart from their one-GPU baseline (beside it, on other GPUs) get their
    efficiency and loss difference from that run's file; a file of another shape, mode or
    step size, or without a one-GPU result, is refused naming the file and what differs."""
    report = {"shape": "7b-layers", "mode": "compiled", "accumulation": 8}
    one_gpu = {"tokens_per_s": 50_000.0, "gpus": 1, "losses": [11.0, 10.5]}
    baseline_file = tmp_path / "scaling-7b-layers.json"
    baseline_file.write_text(json.dumps({**report, "results": {"1gpu": one_gpu}}))
    baseline = scaling.read_baseline(baseline_file, report)

    pp2 = {"tokens_per_s": 80_000.0, "gpus": 2, "flops_per_token": 1e10, "losses": [11.0, 10.6],
           "peak_memory_gb": 30.0, "micro_batches": 8}  # fmt: skip
    printed = scaling.table({**report, "device": "2x GPU", "matmul_tflops": 700.0,
                             "results": {"pp2": pp2}, "baseline": baseline})  # fmt: skip
    assert "| pp2 | 2 | 80,000 | 40,000 | 80.0% |" in printed
    assert f"one GPU: {baseline_file}" in printed
    assert printed.rstrip().endswith(f"| {abs(10.6 - 10.5) / 10.5:.1e} |")

    with pytest.raises(
        SystemExit, match=r"scaling-7b-layers.json: accumulation is 8, this run's is 4"
    ):
        scaling.read_baseline(baseline_file, {**report, "accumulation": 4})
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**report, "results": {}}))
    with pytest.raises(SystemExit, match="empty.json: no one-GPU result"):
        scaling.read_baseline(empty, report)
