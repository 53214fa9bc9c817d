"""Tensor parallelism through the real Trainer on CPU with gloo: 2 processes against one.

Each layout (TP=2, TP=2 with sequence parallelism) runs ``Trainer.fit`` for 4 steps
with a checkpoint at step 2 and must match the single-process run with the same
config, seed and data: losses, validation losses and grad norms step by step, the
whole (gathered) weights and AdamW moments in the final checkpoint, and the logits
of the model package loaded in one process. Resuming the TP=2 checkpoint of step 2
at TP=2 is exact; resuming it in one process matches within the tolerance. A slow
test runs TP=2 × DP=2 (4 processes) in every data-parallel mode (FSDP × TP: 2-D,
with gradient clipping at work, and with sequence parallelism in fp8) the same way.
On GPUs: MEGALITH_TEST_DEVICE=cuda (NCCL); the 2-process tests passed on 2x H200
(torch 2.11) with the same tolerances.

Tolerance: TP sums the row-parallel matmuls and the vocab-parallel softmax in a
different order (fp32, ~1e-7 relative per op); Adam amplifies that little over 4
steps. Losses within 1e-5 absolute, grad norms within 1e-4 relative, tensors and
logits within rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from parallel_helpers import (
    BACKEND,
    REPO,
    STEPS,
    TP_FP8_GRAD_RTOL,
    TP_FP8_LOSS_ATOL,
    assert_metrics_match,
    assert_one_process_resume,
    assert_package_logits_match,
    assert_resume_exact,
    assert_whole_checkpoint,
    config_of,
    fit_one_process,
    last_checkpoint_state,
    metrics,
    run_trainer_worker,
    trainer_settings,
)

from megalith.config import load_config
from megalith.errors import MegalithError
from training.parallel.groups import ParallelSizes
from training.parallel.parallelize import enable_async_tensor_parallel, enable_comm_overlap
from training.parallel.support import check_trainer_support
from training.parallel.te_tensor_parallel import (
    CommOverlap,
    comm_overlap,
    initialize_comm_overlap,
)
from training.precision.mixed import Precision
from training.runtime.launch import comm_overlap_env

WORLD = 2
TWO_D_SP = {
    "parallel.tensor": 2,
    "parallel.data_parallel_mode": "fsdp",
    "parallel.sequence_parallel": "true",
}
FP8 = {"mixed_precision.dtype": "bf16", "mixed_precision.fp8": "true"}
# Grad norms are 0.5-0.8: clipping at 0.1 scales every step (the clipped curve is 1e-2
# from the unclipped one by step 3).
CLIPPED = {"training.grad_clip": 0.1}
FP8_ON_CPU = importlib.util.find_spec("torchao") is not None  # the fp8 extra
CASES = {
    "tp2": {"parallel.tensor": 2},
    "tp2-sp": {"parallel.tensor": 2, "parallel.sequence_parallel": "true"},
}


def layout(case: str) -> str:
    return f"{case} ({BACKEND}, {WORLD} processes)"


def run_worker(out: Path, cases: dict[str, dict[str, Any]], world: int) -> Path:
    return run_trainer_worker(out, cases, world, f"TP ({world} processes)")


@pytest.fixture(scope="module")
def parallel_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cases = {name: trainer_settings(shards, extra) for name, extra in CASES.items()}
    return run_worker(tmp_path_factory.mktemp("tp-runs"), cases, WORLD)


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run of the same config."""
    return fit_one_process(trainer_settings(shards), tmp_path_factory.mktemp("tp-reference"))


@pytest.mark.parametrize("case", CASES)
def test_losses_match_one_process(case: str, parallel_runs: Path, reference: Path) -> None:
    got = metrics(parallel_runs / case)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_metrics_match(got, metrics(reference), layout(case))


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_holds_whole_single_process_tensors(
    case: str, parallel_runs: Path, reference: Path
) -> None:
    assert_whole_checkpoint(parallel_runs / case, reference, layout(case))
    assert last_checkpoint_state(parallel_runs / case)["layout"]["parallel.tensor"] == WORLD


@pytest.mark.parametrize("case", CASES)
def test_resume_in_the_same_layout_is_exact(case: str, parallel_runs: Path) -> None:
    assert_resume_exact(parallel_runs / case, parallel_runs / f"{case}-resumed", layout(case))


def test_one_process_resumes_a_tensor_parallel_checkpoint(
    parallel_runs: Path, shards: Path, tmp_path: Path
) -> None:
    assert_one_process_resume(
        parallel_runs / "tp2", trainer_settings(shards), tmp_path, layout("tp2")
    )


@pytest.mark.parametrize("case", CASES)
def test_model_package_loads_in_one_process(
    case: str, parallel_runs: Path, reference: Path
) -> None:
    assert_package_logits_match(parallel_runs / case, reference, layout(case))


def test_fsdp_with_tensor_or_pipeline_parallelism_runs_over_either_kernel_backend(
    shards: Path,
) -> None:
    """FSDP × TP (2-D) and FSDP over pipeline stages are accepted with the torch kernels
    and with Transformer Engine's (checked on 4 H200s: benchmarks/RESULTS.md)."""
    fsdp = {**trainer_settings(shards), "parallel.data_parallel_mode": "fsdp"}
    for backend in ("torch", "te", "auto"):
        two_d = config_of({**fsdp, **TWO_D_SP, "model.backend": backend})
        check_trainer_support(two_d, ParallelSizes(tp=2, dp=2))  # raises if refused
        staged = config_of({**fsdp, "parallel.pipeline": 2, "model.backend": backend})
        check_trainer_support(staged, ParallelSizes(pp=2, dp=2))


def test_async_tensor_parallelism_names_what_it_needs(shards: Path) -> None:
    """Async TP fuses the sequence-parallel collectives into compiled CUDA matmuls: each
    missing setting is named, before any process starts; on CPU the rank refuses it."""
    settings = {**trainer_settings(shards), "parallel.async_tensor_parallel": True}
    with pytest.raises(MegalithError) as refused:
        check_trainer_support(config_of(settings), ParallelSizes(tp=2))
    for key in ("parallel.sequence_parallel=true", "training.compile=true"):
        assert key in str(refused.value)
    complete = {**settings, "parallel.sequence_parallel": True, "training.compile": True}
    check_trainer_support(config_of({**complete, "training.device": "auto"}), ParallelSizes(tp=2))
    for key, value, named in (
        ("training.compile_backend", "aot_eager", "training.compile_backend inductor"),
        ("training.device", "cpu", "training.device cuda or auto"),
        ("model.backend", "te", "model.backend torch"),
    ):
        with pytest.raises(MegalithError, match=named):
            check_trainer_support(config_of({**complete, key: value}), ParallelSizes(tp=2))
    with pytest.raises(MegalithError, match="parallel.tensor > 1"):
        check_trainer_support(config_of(complete), ParallelSizes(dp=2))
    config = config_of(complete)
    with pytest.raises(MegalithError, match="needs CUDA; this rank runs on cpu"):
        enable_async_tensor_parallel(None, torch.device("cpu"), config.model)  # type: ignore[arg-type]


def test_cuda_graphs_name_what_they_need(shards: Path) -> None:
    """``training.compile_mode=reduce-overhead`` (CUDA graph trees) runs compiled on one
    GPU with the torch kernels, in bf16 or torchao's fp8: each missing setting and each
    parallel size above 1 is named before any process starts. The graphs themselves:
    tests/test_gpu.py."""
    settings = {**trainer_settings(shards), "training.compile_mode": "reduce-overhead"}
    with pytest.raises(MegalithError, match="training.compile=true"):
        check_trainer_support(config_of(settings), ParallelSizes())
    complete = {**settings, "training.compile": True}
    check_trainer_support(config_of(complete), ParallelSizes())  # with accumulation
    fp8 = {"mixed_precision.dtype": "bf16", "mixed_precision.fp8": True, "model.backend": "torch"}
    for recipe in ("tensorwise", "rowwise"):  # torchao's scales live inside the graphs
        recipe_fp8 = {**fp8, "mixed_precision.fp8_recipe": recipe}
        check_trainer_support(config_of({**complete, **recipe_fp8}), ParallelSizes())
    for key, value, named in (
        ("training.compile_backend", "aot_eager", "training.compile_backend inductor"),
        ("model.backend", "te", "model.backend torch or auto"),
        ("model.backend", "auto", "model.backend torch with mixed_precision.fp8"),
    ):
        with pytest.raises(MegalithError, match=named):
            extra = fp8 if named.endswith("fp8") else {}
            check_trainer_support(config_of({**complete, **extra, key: value}), ParallelSizes())
    for sizes, named in (
        (ParallelSizes(dp=2), "parallel.data = 1 \\(it is 2\\)"),
        (ParallelSizes(tp=2, pp=2), "parallel.tensor = 1 .*parallel.pipeline = 1"),
    ):
        with pytest.raises(MegalithError, match=named):
            check_trainer_support(config_of(complete), sizes)


def test_te_communication_overlap_names_what_it_needs(shards: Path, monkeypatch) -> None:
    """``parallel.tp_comm_overlap`` (TE's userbuffers): each missing setting is named
    before any process starts, T5 is refused (two sequence lengths, one buffer shape), a
    CPU rank refuses it, and ``megalith train`` gives the workers the environment TE
    needs. The overlap itself runs on GPUs only: benchmarks/RESULTS.md."""
    settings = {**trainer_settings(shards), "parallel.tp_comm_overlap": True}
    with pytest.raises(MegalithError) as refused:
        check_trainer_support(config_of(settings), ParallelSizes(tp=2))
    for key in ("parallel.sequence_parallel=true", "model.backend=te"):
        assert key in str(refused.value)
    complete = {**settings, "parallel.sequence_parallel": True, "model.backend": "te"}
    complete["training.device"] = "auto"
    check_trainer_support(config_of(complete), ParallelSizes(tp=2, dp=2))
    for key, value, named in (
        ("training.device", "cpu", "training.device cuda or auto"),
        ("model.backend", "auto", "model.backend=te"),
    ):
        with pytest.raises(MegalithError, match=named):
            check_trainer_support(config_of({**complete, key: value}), ParallelSizes(tp=2))
    with pytest.raises(MegalithError, match="parallel.tensor > 1"):
        check_trainer_support(config_of(complete), ParallelSizes(dp=2))
    t5 = load_config(
        REPO / "configs" / "t5-tiny-cpu.yaml",
        [f"{k}={v}" for k, v in complete.items() if k.startswith(("parallel.", "model.backend"))],
    )
    with pytest.raises(MegalithError, match="parallel.tp_comm_overlap with model.family=t5"):
        check_trainer_support(t5, ParallelSizes(tp=2))

    config = config_of(complete)
    assert comm_overlap_env(config) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UB_SKIPMC": "1"}
    assert comm_overlap_env(config_of(trainer_settings(shards))) == {}
    state = SimpleNamespace(sizes=ParallelSizes(tp=2))
    with pytest.raises(
        MegalithError, match="needs CUDA and Transformer Engine; this rank runs on cpu"
    ):
        enable_comm_overlap(
            config, config.model, state, torch.device("cpu"), Precision("bf16", "cpu", None)
        )  # type: ignore[arg-type]

    # The userbuffers: one micro-batch's tokens (whole sequence) x hidden, fp8 buffers
    # under fp8, bootstrapped over NCCL, never NVLink multicast.
    calls: dict = {}
    modes = SimpleNamespace(FP8="fp8", NONE="none")
    te = SimpleNamespace(
        UserBufferQuantizationMode=modes, initialize_ub=lambda **kw: calls.update(kw)
    )
    monkeypatch.setattr(os, "environ", {})
    initialize_comm_overlap(te, CommOverlap(tokens=4096, hidden=64), 2, True, torch.bfloat16)
    assert calls == {
        "shape": [4096, 64],
        "tp_size": 2,
        "quantization_modes": ["fp8"],
        "dtype": torch.bfloat16,
        "ub_cfgs": None,  # TE's defaults
        "bootstrap_backend": "nccl",
    }
    assert os.environ == {"UB_SKIPMC": "1"}


def test_te_communication_overlap_settings_per_gemm(shards: Path) -> None:
    """``parallel.tp_comm_overlap_config``: the set fields of each named GEMM reach TE's
    ``initialize_ub`` as its ``ub_cfgs`` (the rest keep TE's defaults); without the overlap,
    or with a pair TE refuses, it is refused before any process starts, naming the keys."""
    complete = {
        **trainer_settings(shards),
        "parallel.tp_comm_overlap": True,
        "parallel.sequence_parallel": True,
        "model.backend": "te",
        "training.device": "auto",
        "parallel.tp_comm_overlap_config": "{proj_fprop: {method: ring_exchange, num_sm: 2}}",
    }
    config = config_of(complete)
    check_trainer_support(config, ParallelSizes(tp=2))
    overlap = comm_overlap(config, config.model, ParallelSizes(tp=2))
    assert overlap.gemms == {"proj_fprop": {"method": "ring_exchange", "num_sm": 2}}
    calls: dict = {}
    te = SimpleNamespace(
        UserBufferQuantizationMode=SimpleNamespace(FP8="fp8", NONE="none"),
        initialize_ub=lambda **kw: calls.update(kw),
    )
    initialize_comm_overlap(te, overlap, 2, False, torch.bfloat16)
    assert calls["ub_cfgs"] == {"proj_fprop": {"method": "ring_exchange", "num_sm": 2}}

    off = config_of({**complete, "parallel.tp_comm_overlap": False})
    with pytest.raises(
        MegalithError,
        match=r"tp_comm_overlap_config \(proj_fprop\) needs parallel.tp_comm_overlap=true",
    ):
        check_trainer_support(off, ParallelSizes(tp=2))
    both = "{fc1_dgrad: {method: ring_exchange}, fc1_wgrad: {num_sm: 4}}"
    with pytest.raises(
        MegalithError, match="fc1_dgrad with method ring_exchange .* leave fc1_wgrad out"
    ):
        check_trainer_support(
            config_of({**complete, "parallel.tp_comm_overlap_config": both}), ParallelSizes(tp=2)
        )


@pytest.mark.slow
def test_tensor_times_data_parallel_matches_one_process(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """TP=2 × DP=2 (4 processes) in every data-parallel mode, FSDP (2-D: FSDP rows of
    each TP shard, with gradient clipping at work) included: losses, grad norms, whole
    checkpoint tensors, an exact resume, and the model package gathered to one process."""
    modes = {"ddp": {}, "distributed_optimizer": {}, "fsdp": CLIPPED}
    cases = {
        mode: trainer_settings(
            shards, {"parallel.tensor": 2, "parallel.data_parallel_mode": mode, **extra}
        )
        for mode, extra in modes.items()
    }
    if FP8_ON_CPU:  # torchao's float8 TP linears over 2-D, sequence parallel
        cases["fsdp-sp-fp8"] = trainer_settings(shards, {**FP8, **TWO_D_SP})
    runs = run_worker(tmp_path, cases, 4)
    clipped = fit_one_process(trainer_settings(shards, CLIPPED), tmp_path / "clipped-one")
    for mode, extra in modes.items():
        name = f"TP=2 x DP=2 {mode} ({BACKEND}, 4 processes)"
        want = clipped if extra else reference
        assert_metrics_match(metrics(runs / mode), metrics(want), name, losses=("loss",))
        assert_resume_exact(runs / mode, runs / f"{mode}-resumed", name)
        assert_whole_checkpoint(runs / mode, want, name)
    assert_package_logits_match(runs / "fsdp", clipped, "TP=2 x FSDP DP=2")
    if FP8_ON_CPU:
        run, name = runs / "fsdp-sp-fp8", f"fp8 TP=2 x FSDP DP=2, SP ({BACKEND}, 4 processes)"
        linears = json.loads((run / "tensor_parallel_float8.json").read_text())
        assert linears and all(linears.values()), f"{name}: not every TP linear in float8"
        want = metrics(fit_one_process(trainer_settings(shards, FP8), tmp_path / "fp8-one"))
        assert_metrics_match(
            metrics(run), want, name, loss_atol=TP_FP8_LOSS_ATOL, grad_rtol=TP_FP8_GRAD_RTOL
        )
        assert_resume_exact(run, runs / "fsdp-sp-fp8-resumed", name)


def test_sequence_parallel_dropout_with_activation_checkpointing(
    shards: Path, tmp_path: Path
) -> None:
    """TP=2 + SP with dropout: per-rank masks are replayed exactly when full or selective
    checkpointing recomputes a block, so all three runs give the same losses and grad
    norms, and each resumes exactly. The modes' independent reference (the ranks' masks
    replayed in one process) is test_tensor_parallel's
    test_sequence_parallel_dropout_matches_one_process_replaying_its_masks."""
    dropout = {"parallel.tensor": 2, "parallel.sequence_parallel": "true", "model.dropout": 0.1}
    modes = ("none", "full", "selective")
    cases = {
        mode: trainer_settings(shards, {**dropout, "model.activation_checkpointing": mode})
        for mode in modes
    }
    runs = run_worker(tmp_path, cases, WORLD)
    plain = metrics(runs / "none")
    for mode in modes:
        name = f"TP=2+SP dropout 0.1, activation_checkpointing={mode} ({BACKEND})"
        assert_metrics_match(
            metrics(runs / mode), plain, name, loss_atol=1e-6, grad_rtol=1e-6,
            losses=("loss",), against="no checkpointing",
        )  # fmt: skip
        assert_resume_exact(runs / mode, runs / f"{mode}-resumed", name)
