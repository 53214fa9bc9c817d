"""Tensor parallelism through the real Trainer on CPU with gloo: 2 processes against one.

Each layout (TP=2, TP=2 with sequence parallelism) runs ``Trainer.fit`` for 4 steps
with a checkpoint at step 2 and must match the single-process run with the same
config, seed and data: losses, validation losses and grad norms step by step, the
whole (gathered) weights and AdamW moments in the final checkpoint, and the logits
of the model package loaded in one process. Resuming the TP=2 checkpoint of step 2
at TP=2 is exact; resuming it in one process matches within the tolerance. A slow
test runs TP=2 × DP=2 (4 processes) in both data-parallel modes the same way.
On GPUs: MEGALITH_TEST_DEVICE=cuda (NCCL); the 2-process tests passed on 2x H200
(torch 2.11) with the same tolerances.

Tolerance: TP sums the row-parallel matmuls and the vocab-parallel softmax in a
different order (fp32, ~1e-7 relative per op); Adam amplifies that little over 4
steps. Losses within 1e-5 absolute, grad norms within 1e-4 relative, tensors and
logits within rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_helpers import DEVICE, RECIPE, run_torchrun_worker, tiny_settings, tiny_shard_set
from safetensors.torch import load_file

from training.config import load_config
from training.errors import MegalithError
from training.models.package import load_model_package
from training.parallel.groups import ParallelSizes
from training.parallel.support import check_trainer_support
from training.trainer import Trainer

WORLD = 2
STEPS = 4
RESUME_STEP = 2
LOSS_ATOL = 1e-5
CASES = {
    "tp2": {"parallel.tensor": 2},
    "tp2-sp": {"parallel.tensor": 2, "parallel.sequence_parallel": "true"},
}
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"


def layout(case: str) -> str:
    return f"{case} ({BACKEND}, {WORLD} processes)"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_shard_set(tmp_path_factory)


def settings(shards: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return tiny_settings(
        shards,
        {
            "training.train_iters": STEPS,
            "checkpoint.interval": RESUME_STEP,
            "checkpoint.keep_last": 3,
            **(extra or {}),
        },
    )


def config_of(values: dict[str, Any]):
    return load_config(RECIPE, [f"{k}={v}" for k, v in values.items()])


def run_worker(out: Path, cases: dict[str, dict[str, Any]], world: int) -> Path:
    """Every case in one torchrun job of ``world`` processes (one start-up cost)."""
    spec = {
        "recipe": str(RECIPE),
        "device": DEVICE,
        "cases": cases,
        "resume_step": RESUME_STEP,
        "out": str(out),
    }
    return run_torchrun_worker("tp_trainer_worker.py", spec, out, world, f"TP ({world} processes)")


@pytest.fixture(scope="module")
def parallel_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cases = {name: settings(shards, extra) for name, extra in CASES.items()}
    return run_worker(tmp_path_factory.mktemp("tp-runs"), cases, WORLD)


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run of the same config."""
    out = tmp_path_factory.mktemp("tp-reference")
    Trainer(config_of(settings(shards)), out).fit(show_progress=False)
    return out


def metrics(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_close_tensors(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


@pytest.mark.parametrize("case", CASES)
def test_losses_match_one_process(case: str, parallel_runs: Path, reference: Path) -> None:
    got, want = metrics(parallel_runs / case), metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        step = g["step"]
        assert g["loss"] == pytest.approx(w["loss"], abs=LOSS_ATOL), (
            f"{layout(case)}: loss diverged at step {step}: {g['loss']} vs one process {w['loss']}"
        )
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (
            f"{layout(case)}: grad_norm diverged at step {step}: {g['grad_norm']} vs "
            f"{w['grad_norm']}"
        )
        assert g.get("val_loss", 0.0) == pytest.approx(w.get("val_loss", 0.0), abs=LOSS_ATOL), (
            f"{layout(case)}: val_loss diverged at step {step}"
        )


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_holds_whole_single_process_tensors(
    case: str, parallel_runs: Path, reference: Path
) -> None:
    step = f"step-{STEPS:08d}"
    for file in ("model.safetensors", "optimizer.safetensors"):
        got = load_file(str(parallel_runs / case / "checkpoints" / step / file))
        want = load_file(str(reference / "checkpoints" / step / file))
        assert_close_tensors(got, want, f"{layout(case)} step {STEPS} {file}")
    state = json.loads((parallel_runs / case / "checkpoints" / step / "state.json").read_text())
    assert state["layout"]["parallel.tensor"] == WORLD


@pytest.mark.parametrize("case", CASES)
def test_resume_in_the_same_layout_is_exact(case: str, parallel_runs: Path) -> None:
    straight = {r["step"]: r["loss"] for r in metrics(parallel_runs / case)}
    resumed = metrics(parallel_runs / f"{case}-resumed")
    assert [r["step"] for r in resumed] == list(range(RESUME_STEP + 1, STEPS + 1))
    for record in resumed:
        assert record["loss"] == straight[record["step"]], (
            f"{layout(case)}: resumed loss differs at step {record['step']}"
        )


def test_one_process_resumes_a_tensor_parallel_checkpoint(
    parallel_runs: Path, shards: Path, tmp_path: Path
) -> None:
    first = f"step-{RESUME_STEP:08d}"
    shutil.copytree(parallel_runs / "tp2" / "checkpoints" / first, tmp_path / "ckpt" / first)
    config = config_of({**settings(shards), "checkpoint.directory": str(tmp_path / "ckpt")})
    trainer = Trainer(config, tmp_path / "run")
    assert trainer.resume() and trainer.step == RESUME_STEP
    trainer.fit(show_progress=False)
    straight = {r["step"]: r["loss"] for r in metrics(parallel_runs / "tp2")}
    for record in metrics(tmp_path / "run"):
        assert record["loss"] == pytest.approx(straight[record["step"]], abs=LOSS_ATOL), (
            f"{layout('tp2')} checkpoint resumed in one process: loss differs at step "
            f"{record['step']}"
        )


@pytest.mark.parametrize("case", CASES)
def test_model_package_loads_in_one_process(
    case: str, parallel_runs: Path, reference: Path
) -> None:
    model, config, _ = load_model_package(parallel_runs / case / "model")
    want_model, _, _ = load_model_package(reference / "model")
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), want_model(tokens), rtol=1e-4, atol=1e-5,
            msg=lambda m: f"{layout(case)} package logits: {m}",
        )  # fmt: skip


def test_fsdp_with_tensor_parallelism_is_refused(shards: Path) -> None:
    config = config_of(
        {**settings(shards), "parallel.tensor": 2, "parallel.data_parallel_mode": "fsdp"}
    )
    sizes = ParallelSizes(tp=2, dp=2)
    with pytest.raises(MegalithError, match="fsdp with parallel.tensor=2"):
        check_trainer_support(config, sizes)


@pytest.mark.slow
def test_tensor_times_data_parallel_matches_one_process(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """TP=2 × DP=2 (4 processes) in both data-parallel modes: losses, grad norms, whole
    checkpoint tensors, and an exact resume."""
    modes = ("ddp", "distributed_optimizer")
    cases = {
        mode: settings(shards, {"parallel.tensor": 2, "parallel.data_parallel_mode": mode})
        for mode in modes
    }
    runs = run_worker(tmp_path, cases, 4)
    want = metrics(reference)
    for mode in modes:
        name = f"TP=2 x DP=2 {mode} ({BACKEND}, 4 processes)"
        got = metrics(runs / mode)
        for g, w in zip(got, want, strict=True):
            assert g["loss"] == pytest.approx(w["loss"], abs=LOSS_ATOL), (
                f"{name}: loss diverged at step {g['step']}: {g['loss']} vs {w['loss']}"
            )
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (
                f"{name}: grad_norm diverged at step {g['step']}"
            )
        straight = {r["step"]: r["loss"] for r in got}
        for record in metrics(runs / f"{mode}-resumed"):
            assert record["loss"] == straight[record["step"]], (
                f"{name}: resumed loss differs at step {record['step']}"
            )
        step = f"step-{STEPS:08d}"
        for file in ("model.safetensors", "optimizer.safetensors"):
            got_tensors = load_file(str(runs / mode / "checkpoints" / step / file))
            want_tensors = load_file(str(reference / "checkpoints" / step / file))
            assert_close_tensors(got_tensors, want_tensors, f"{name} step {STEPS} {file}")


def test_sequence_parallel_dropout_with_activation_checkpointing(
    shards: Path, tmp_path: Path
) -> None:
    """TP=2 + SP with dropout: per-rank masks are replayed exactly when full or selective
    checkpointing recomputes a block, so all three runs give the same losses and grad
    norms, and each resumes exactly."""
    dropout = {"parallel.tensor": 2, "parallel.sequence_parallel": "true", "model.dropout": 0.1}
    modes = ("none", "full", "selective")
    cases = {
        mode: settings(shards, {**dropout, "model.activation_checkpointing": mode})
        for mode in modes
    }
    runs = run_worker(tmp_path, cases, WORLD)
    plain = metrics(runs / "none")
    for mode in modes:
        name = f"TP=2+SP dropout 0.1, activation_checkpointing={mode} ({BACKEND})"
        got = metrics(runs / mode)
        for g, w in zip(got, plain, strict=True):
            assert g["loss"] == pytest.approx(w["loss"], abs=1e-6), (
                f"{name}: loss differs from no checkpointing at step {g['step']}"
            )
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-6), (
                f"{name}: grad_norm differs from no checkpointing at step {g['step']}"
            )
        straight = {r["step"]: r["loss"] for r in got}
        for record in metrics(runs / f"{mode}-resumed"):
            assert record["loss"] == straight[record["step"]], (
                f"{name}: resumed loss differs at step {record['step']}"
            )
