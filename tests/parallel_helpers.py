"""Shared by the multi-process tests: one tiny shard set per session, tiny configs,
torchrun command lines, and the comparisons of a parallel run with one process.

The shard set is built once per pytest session (a directory under the session's base
temp dir, guarded by a lock), whichever test module asks first; tests/conftest.py
serves it as the ``shards`` fixture.

The trainer parity tests run ``STEPS`` steps with a checkpoint every ``RESUME_STEP``
steps, and compare with the single-process run: metrics step by step
(``assert_metrics_match``), the whole tensors of the last checkpoint
(``assert_whole_checkpoint``), resumes (``assert_resume_exact``,
``assert_one_process_resume``) and the model package's logits
(``assert_package_logits_match``). Every failure names the layout, and the step.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "tiny-cpu.yaml"
CORPUS = REPO / "preprocessing" / "sample_corpus" / "stories.jsonl"
VOCAB = 1024
SEQ = 32
# The parity tests run on GPUs (NCCL) too: MEGALITH_TEST_DEVICE=cuda.
DEVICE = os.environ.get("MEGALITH_TEST_DEVICE", "cpu")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"
# The trainer parity runs: STEPS steps, checkpoints every RESUME_STEP steps.
STEPS = 4
RESUME_STEP = 2
LOSS_ATOL = 1e-5
# Per-shard float8 scales round differently from one process's whole-tensor scales.
# Measured (tiny run, 2 gloo processes): max |Δloss| to one process in fp8 5.9e-4 (TP2)
# and 6.9e-4 (TP2+SP), grad norms within 0.65% / 0.76% (TP2 x FSDP DP2 + SP, 4
# processes: 6.9e-4, 0.76%); the same runs are 9.4e-4 / 1.1e-3 and 1.1% / 1.2% from
# bf16, so that the float8 check on the linears (tests/test_fp8.py, test_trainer_parallel),
# not the tolerance, is what proves fp8 ran.
TP_FP8_LOSS_ATOL = 1e-3
TP_FP8_GRAD_RTOL = 1.2e-2


def tiny_shard_set(
    tmp_path_factory: pytest.TempPathFactory,
    name: str = "megalith-tiny-shards",
    overrides: tuple[str, ...] = (),
) -> Path:
    """The sample corpus as shards with a 1024-piece tokenizer, built once per session
    (per ``name``; ``overrides`` are more ``--set`` values, e.g. tokenizer sentinels)."""
    from megalith.config import load_config
    from preprocessing.stage import run_tokenize_stage

    root = tmp_path_factory.getbasetemp() / name
    root.mkdir(exist_ok=True)
    output = root / "shards"
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (output / "manifest.json").exists():
            config = load_config(
                RECIPE,
                [
                    f"data.output={output}",
                    f"tokenizer.vocab_size={VOCAB}",
                    "data.workers=1",
                    *overrides,
                ],
                {"data.inputs": [str(CORPUS)]},
            )
            run_tokenize_stage(config, show_progress=False)
    return output


def tiny_settings(shards: Path, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """A 2-layer, hidden-32 model on 32-token sequences; tracking off."""
    return {
        "data.output": str(shards),
        "data.seq_length": SEQ,
        "model.num_layers": 2,
        "model.hidden_size": 32,
        "model.num_attention_heads": 4,
        "model.num_query_groups": 2,
        "model.ffn_hidden_size": 64,
        "model.vocab_size": "null",
        "model.max_position_embeddings": SEQ,
        "training.micro_batch_size": 2,
        "training.global_batch_size": 8,
        "training.train_iters": 4,
        "training.eval_interval": 2,
        "training.eval_iters": 2,
        "training.device": DEVICE,
        "mixed_precision.dtype": "fp32",
        "scheduler.warmup_iters": 1,
        "checkpoint.interval": 0,
        "logging.mlflow": "false",
        **(values or {}),
    }


def trainer_settings(shards: Path, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """``tiny_settings`` for STEPS steps with a checkpoint every RESUME_STEP steps."""
    return tiny_settings(
        shards,
        {
            "training.train_iters": STEPS,
            "checkpoint.interval": RESUME_STEP,
            "checkpoint.keep_last": 3,
            **(values or {}),
        },
    )


def config_of(settings: dict[str, Any]):
    from megalith.config import load_config

    return load_config(RECIPE, [f"{k}={v}" for k, v in settings.items()])


def fit_one_process(settings: dict[str, Any], out: Path) -> Path:
    """``Trainer.fit`` in this process; returns OUT."""
    from training.trainer import Trainer

    Trainer(config_of(settings), out).fit(show_progress=False)
    return out


def set_args(settings: dict[str, Any]) -> list[str]:
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


def child_env(**extra: str) -> dict[str, str]:
    """One thread per process (2 cores, several processes) and a short collective
    timeout, so a broken test fails instead of hanging."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGALITH_DIST_TIMEOUT_S": "120"}
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return {**env, **extra}


def megalith(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipelines.cli", *args]


def run_torchrun_worker(
    worker: str, spec: dict[str, Any], out: Path, world: int, label: str
) -> Path:
    """Write ``spec`` to OUT/spec.json and run tests/WORKER under torchrun with WORLD ranks."""
    from servers import run_group

    (out / "spec.json").write_text(json.dumps(spec))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "--max-restarts", "0",
        str(REPO / "tests" / worker), str(out / "spec.json"),
    ]  # fmt: skip
    done = run_group(command, child_env(), timeout_s=300)
    assert done.returncode == 0, (
        f"{label} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return out


def run_trainer_worker(out: Path, cases: dict[str, dict[str, Any]], world: int, label: str) -> Path:
    """Every case through tests/tp_trainer_worker.py (fit, then resume from RESUME_STEP)
    in one torchrun job of ``world`` processes (one start-up cost)."""
    spec = {
        "recipe": str(RECIPE),
        "device": DEVICE,
        "cases": cases,
        "resume_step": RESUME_STEP,
        "out": str(out),
    }
    return run_torchrun_worker("tp_trainer_worker.py", spec, out, world, label)


def init_gloo(rank: int, world: int, out_dir: str) -> None:
    """In a process of ``torch.multiprocessing.spawn``: one thread, and a gloo group on
    loopback through a file rendezvous in OUT_DIR."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


# --- comparisons -------------------------------------------------------------------------


def mismatch(what: str, got: torch.Tensor, expected: torch.Tensor, tol: dict) -> list[str]:
    """``assert_close`` as a list of failure lines (empty when close), for worker processes."""
    try:
        torch.testing.assert_close(got, expected, **tol)
    except AssertionError as error:
        detail = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        return [f"{what}: {detail}"]
    return []


def metrics(run: Path) -> list[dict[str, Any]]:
    """The records of RUN/metrics.jsonl."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_close_tensors(
    got: dict, want: dict, what: str, rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def assert_metrics_match(
    got: list[dict],
    want: list[dict],
    layout: str,
    loss_atol: float = LOSS_ATOL,
    grad_rtol: float = 1e-4,
    losses: tuple[str, ...] = ("loss", "val_loss"),
    against: str = "one process",
) -> None:
    """Step by step: each of ``losses`` (0 in a record without it) within ``loss_atol``,
    the grad norm within ``grad_rtol`` relative."""
    assert [r["step"] for r in got] == [r["step"] for r in want], f"{layout}: steps differ"
    for g, w in zip(got, want, strict=True):
        step = g["step"]
        for key in losses:
            assert g.get(key, 0.0) == pytest.approx(w.get(key, 0.0), abs=loss_atol), (
                f"{layout}: {key} diverged at step {step}: {g.get(key)} vs {against} {w.get(key)}"
            )
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=grad_rtol), (
            f"{layout}: grad_norm diverged at step {step}: {g['grad_norm']} vs {against} "
            f"{w['grad_norm']}"
        )


def assert_whole_checkpoint(run: Path, reference: Path, layout: str) -> None:
    """The weights and AdamW moments of the last checkpoint, whole, against REFERENCE's."""
    from training.checkpoint.sharded_reader import read_global_tensors

    step = f"step-{STEPS:08d}"
    got = read_global_tensors(run / "checkpoints" / step)
    want = read_global_tensors(reference / "checkpoints" / step)
    assert_close_tensors(got, want, f"{layout} step {STEPS} checkpoint")


def last_checkpoint_state(run: Path) -> dict[str, Any]:
    return json.loads((run / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())


def assert_saved_in_row_halves(run: Path, layout: str, whole: str | None = None) -> None:
    """FSDP over 2 data-parallel ranks sharded, not replicated: the last checkpoint holds
    every tensor (but those whose names hold ``whole``) as two row halves, one written by
    each rank."""
    index = json.loads((run / "checkpoints" / f"step-{STEPS:08d}" / "index.json").read_text())
    for tensor, entry in index["tensors"].items():
        if not entry["shape"] or (whole and whole in tensor):  # AdamW's step counts
            continue
        rows = sorted(tuple(shard["box"][0]) for shard in entry["shards"])
        half = entry["shape"][0] // 2
        assert rows == [(0, half), (half, 2 * half)], f"{layout}: {tensor} saved as {rows}"


def assert_resume_exact(run: Path, resumed_run: Path, layout: str) -> None:
    """RESUMED_RUN (resumed from RUN's checkpoint of RESUME_STEP) repeats RUN's losses."""
    straight = {r["step"]: r["loss"] for r in metrics(run)}
    resumed = metrics(resumed_run)
    assert [r["step"] for r in resumed] == list(range(RESUME_STEP + 1, STEPS + 1))
    for record in resumed:
        assert record["loss"] == straight[record["step"]], (
            f"{layout}: resumed loss differs at step {record['step']}"
        )


def assert_one_process_resume(
    run: Path, settings: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    """One process resumes RUN's checkpoint of RESUME_STEP and matches RUN's losses."""
    from training.trainer import Trainer

    first = f"step-{RESUME_STEP:08d}"
    shutil.copytree(run / "checkpoints" / first, tmp_path / "ckpt" / first)
    config = config_of({**settings, "checkpoint.directory": str(tmp_path / "ckpt")})
    trainer = Trainer(config, tmp_path / "run")
    assert trainer.resume() and trainer.step == RESUME_STEP
    trainer.fit(show_progress=False)
    straight = {r["step"]: r["loss"] for r in metrics(run)}
    for record in metrics(tmp_path / "run"):
        assert record["loss"] == pytest.approx(straight[record["step"]], abs=LOSS_ATOL), (
            f"{layout} checkpoint resumed in one process: loss differs at step {record['step']}"
        )


def assert_package_logits_match(run: Path, reference: Path, layout: str) -> None:
    """RUN's model package, loaded in one process, gives REFERENCE's logits."""
    from training.models.package import load_model_package

    model, config, _ = load_model_package(run / "model")
    want_model, _, _ = load_model_package(reference / "model")
    tokens = torch.randint(
        0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), want_model(tokens), rtol=1e-4, atol=1e-5,
            msg=lambda m: f"{layout} package logits: {m}",
        )  # fmt: skip


def one_step_gradients(trainer) -> dict[str, torch.Tensor]:
    """One optimizer step's gradients in one process: each accumulation micro-batch's
    loss divided by their number, as the trainer does (what parallel layouts must equal)."""
    training, batches = trainer.config.training, trainer.train_batches()
    accumulation = training.global_batch_size // training.micro_batch_size
    for _ in range(accumulation):
        (trainer._micro_batch_loss(next(batches)) / accumulation).backward()
    return {n: p.grad.cpu() for n, p in trainer.model.named_parameters()}
