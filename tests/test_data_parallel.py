"""Data parallelism on CPU with gloo: 2 processes on loopback against one process.

Both modes (ddp, distributed_optimizer) must reproduce the single-process run with the
same global batch: the same averaged gradients on the first step, the same losses for
K steps, equal parameters on every rank, a consolidated optimizer state equal to the
single-process one, and an exact resume, in the same layout and in one process.

Tolerance: fp32 sums in a different order (2 micro-batches per rank averaged over 2
ranks, against 4 in one process) differ by ~1e-7 relative; Adam's update amplifies
that little over K=3 steps. Losses within 2e-5 absolute, tensors within rtol 1e-4
(atol 1e-6 for gradients, 1e-5 for parameters and moments).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from parallel_helpers import (
    BACKEND,
    RECIPE,
    assert_close_tensors,
    assert_metrics_match,
    config_of,
    run_torchrun_worker,
    tiny_settings,
)
from safetensors.torch import load_file

from training.checkpoint.format import latest_checkpoint
from training.checkpoint.sharded_reader import read_global_tensors
from training.trainer import ResumableSampler, Trainer

MODES = ["ddp", "distributed_optimizer", "fsdp"]
STEPS = 3
WORLD = 2
LOSS_ATOL = 2e-5
LAYOUT = f"DP={WORLD} ({BACKEND}, {WORLD} processes)"


def settings(shards: Path) -> dict[str, Any]:
    return tiny_settings(shards, {"training.train_iters": STEPS + 2})


def numbered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``Trainer.train_step`` records, with the step numbers of metrics.jsonl."""
    return [{"step": step, **record} for step, record in enumerate(records, start=1)]


@pytest.fixture(scope="module")
def distributed_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both modes in one torchrun job (one start-up cost)."""
    out = tmp_path_factory.mktemp("dp-runs")
    spec = {
        "recipe": str(RECIPE),
        "settings": settings(shards),
        "modes": MODES,
        "steps": STEPS,
        "out": str(out),
    }
    return run_torchrun_worker("dp_parity_worker.py", spec, out, WORLD, LAYOUT)


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, the same global batch of 8: losses, step-1 gradients, parameters."""
    trainer = Trainer(config_of(settings(shards)), tmp_path_factory.mktemp("dp-reference"))
    batches = trainer.train_batches()
    records, grads = [], {}
    for step in range(STEPS):
        records.append(trainer.train_step(batches))
        if step == 0:
            grads = {n: p.grad.detach().clone().cpu() for n, p in trainer.model.named_parameters()}
    params = {n: p.detach().clone().cpu() for n, p in trainer.model.named_parameters()}
    moments = {
        (trainer.param_names[i], key): value.cpu().clone()
        for i, state in trainer.optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }
    after = [trainer.train_step(batches) for _ in range(2)]
    return {
        "records": records,
        "grads": grads,
        "params": params,
        "moments": moments,
        "after": after,
    }


@pytest.mark.parametrize("mode", MODES)
def test_first_step_gradients_match_one_process(
    mode: str, distributed_runs: Path, reference: dict[str, Any]
) -> None:
    for rank in range(WORLD):
        grads = load_file(str(distributed_runs / mode / f"grads-rank{rank}.safetensors"))
        what = f"{LAYOUT} mode={mode} rank={rank} step=1 gradient"
        assert_close_tensors(grads, reference["grads"], what, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_losses_match_one_process_for_k_steps(
    mode: str, distributed_runs: Path, reference: dict[str, Any]
) -> None:
    result = json.loads((distributed_runs / mode / "result.json").read_text())
    assert result["layout"]["parallel.data"] == WORLD
    got = numbered(result["records"] + result["after"])
    want = numbered(reference["records"] + reference["after"])
    assert_metrics_match(got, want, f"{LAYOUT} mode={mode}", LOSS_ATOL, losses=("loss",))


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_holds_the_same_parameters(
    mode: str, distributed_runs: Path, reference: dict[str, Any]
) -> None:
    ranks = [
        load_file(str(distributed_runs / mode / f"params-rank{r}.safetensors"))
        for r in range(WORLD)
    ]
    for rank, params in enumerate(ranks[1:], start=1):
        assert_close_tensors(params, ranks[0], f"{LAYOUT} mode={mode} rank={rank} vs 0", 0, 0)
    what = f"{LAYOUT} mode={mode} parameters after step {STEPS}"
    assert_close_tensors(ranks[0], reference["params"], what, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_holds_the_single_process_optimizer_state(
    mode: str, distributed_runs: Path, reference: dict[str, Any]
) -> None:
    path = latest_checkpoint(distributed_runs / mode / "checkpoints")
    assert path is not None and path.name.endswith(f"{STEPS:08d}")
    tensors = read_global_tensors(path)
    got = {
        tuple(key.removeprefix("optimizer/").rsplit("/", 1)): value
        for key, value in tensors.items()
        if key.startswith("optimizer/")
    }
    want = {key: value.reshape(got[key].shape) for key, value in reference["moments"].items()}
    assert_close_tensors(got, want, f"{LAYOUT} mode={mode} optimizer state", 1e-4, 1e-5)
    state = json.loads((path / "state.json").read_text())
    assert state["layout"]["parallel.data"] == WORLD


@pytest.mark.parametrize("mode", MODES)
def test_resume_in_the_same_layout_is_exact(mode: str, distributed_runs: Path) -> None:
    result = json.loads((distributed_runs / mode / "result.json").read_text())
    for step, (a, b) in enumerate(zip(result["after"], result["resumed"], strict=True)):
        assert a["loss"] == b["loss"], (
            f"{LAYOUT} mode={mode}: resumed loss differs at step {STEPS + 1 + step}"
        )


@pytest.mark.parametrize("mode", MODES)
def test_one_process_resumes_a_data_parallel_checkpoint(
    mode: str, distributed_runs: Path, shards: Path, tmp_path: Path
) -> None:
    config = config_of(settings(shards))
    config.checkpoint.directory = str(distributed_runs / mode / "checkpoints")
    trainer = Trainer(config, tmp_path)
    assert trainer.resume() and trainer.step == STEPS
    batches = trainer.train_batches()
    got = [trainer.train_step(batches)["loss"] for _ in range(2)]
    want = [
        r["loss"]
        for r in json.loads((distributed_runs / mode / "result.json").read_text())["after"]
    ]
    assert got == pytest.approx(want, abs=LOSS_ATOL), f"{LAYOUT} mode={mode} resumed in one process"


def test_selective_checkpointing_in_every_data_parallel_mode(
    shards: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    """Selective activation checkpointing recomputes blocks inside DDP's and FSDP's
    hooks: the losses and grad norms stay the single-process ones (no checkpointing)."""
    spec = {
        "recipe": str(RECIPE),
        "settings": {**settings(shards), "model.activation_checkpointing": "selective"},
        "modes": MODES,
        "steps": STEPS,
        "out": str(tmp_path),
    }
    run_torchrun_worker("dp_parity_worker.py", spec, tmp_path, WORLD, f"{LAYOUT} selective")
    for mode in MODES:
        result = json.loads((tmp_path / mode / "result.json").read_text())
        name = f"{LAYOUT} mode={mode} activation_checkpointing=selective"
        got, want = numbered(result["records"]), numbered(reference["records"])
        assert_metrics_match(got, want, name, LOSS_ATOL, losses=("loss",))


# --- the data slices, without processes ----------------------------------------------


@pytest.mark.parametrize(("micro", "ranks"), [(1, 1), (2, 2), (1, 4), (3, 2)])
def test_rank_slices_cover_each_global_batch_in_order(micro: int, ranks: int) -> None:
    global_batch = micro * ranks * 2
    start, stop = global_batch, global_batch * 4
    slices = [list(ResumableSampler(start, stop, micro, r, ranks)) for r in range(ranks)]
    assert all(
        len(s) == len(ResumableSampler(start, stop, micro, r, ranks)) for r, s in enumerate(slices)
    )
    for first in range(start, stop, global_batch):
        union = sorted(i for s in slices for i in s if first <= i < first + global_batch)
        assert union == list(range(first, first + global_batch))
    # Megatron's order: micro-batch k of rank r is samples (k·ranks + r)·micro ...
    assert slices[ranks - 1][:micro] == list(
        range(start + (ranks - 1) * micro, start + ranks * micro)
    )


def test_sampler_refuses_a_range_that_does_not_split() -> None:
    with pytest.raises(ValueError, match="do not split"):
        ResumableSampler(0, 10, 4, 0, 2)
