"""The trainer on the shipped sample corpus: learning, metrics, exact resume (in process
and after SIGKILL of ``megalith train``), gradient accumulation, schedules, precision,
weight-decay groups, MLflow tracking and the command line.

The shard set is prepared once per session; the models are tiny (2 layers, hidden 64,
sequence 64) and run on one thread, which is fastest for tensors this small.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dtype_probe import module_output_dtypes
from parallel_helpers import tiny_shard_set
from safetensors.torch import load_file

from megalith.config import MegalithConfig, ModelConfig, OptimizerConfig, load_config
from megalith.config import SchedulerConfig as Schedule
from megalith.errors import MegalithError
from pipelines.cli import main
from training.checkpoint.sharded_reader import read_global_tensors
from training.metrics.run_logger import read_metrics
from training.models import GPTModel
from training.optim.adamw import build_optimizer
from training.optim.schedule import learning_rate
from training.trainer import Trainer, train

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "tiny-cpu.yaml"
CORPUS = REPO / "preprocessing" / "sample_corpus" / "stories.jsonl"
VOCAB = 1024
SEQ = 64
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s"}


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus as the tiny-cpu recipe's shard set, shared with the parallel tests."""
    return tiny_shard_set(tmp_path_factory)


def overrides(shards: Path, values: dict[str, Any] | None = None) -> list[str]:
    """``--set`` strings: the tiny-cpu recipe shrunk to a 2-layer, hidden-64 model."""
    settings: dict[str, Any] = {
        "data.output": shards,
        "data.seq_length": SEQ,
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.ffn_hidden_size": 128,
        "model.vocab_size": "null",  # filled from the shard set's tokenizer
        "model.max_position_embeddings": SEQ,
        "training.micro_batch_size": 8,
        "training.global_batch_size": 8,
        "training.train_iters": 30,
        "training.eval_interval": 10,
        "training.eval_iters": 2,
        "training.log_interval": 1,
        "scheduler.warmup_iters": 5,
        "checkpoint.interval": 0,
        "logging.mlflow": "false",
        **(values or {}),
    }
    return [f"{key}={value}" for key, value in settings.items()]


def tiny_config(shards: Path, values: dict[str, Any] | None = None) -> MegalithConfig:
    return load_config(RECIPE, overrides(shards, values))


def cli(shards: Path, output: Path, values: dict[str, Any], *extra: str) -> list[str]:
    """A ``megalith train`` command line for a subprocess."""
    sets = [arg for setting in overrides(shards, values) for arg in ("--set", setting)]
    command = ["train", "--config", str(RECIPE), *sets, "--output", str(output), *extra]
    return [sys.executable, "-m", "pipelines.cli", *command]


def subprocess_env() -> dict[str, str]:
    # The same thread count as this process: the same float reductions, bit for bit.
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


def losses(metrics: list[dict[str, Any]]) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in metrics}


def assert_same_model_files(a: Path, b: Path) -> None:
    first, second = load_file(str(a)), load_file(str(b))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


# --- learning and metrics.jsonl ---------------------------------------------------------


def test_loss_falls_and_metrics_jsonl_has_one_record_per_step(shards: Path, tmp_path: Path) -> None:
    config = tiny_config(shards)
    result = train(config, tmp_path, show_progress=False)

    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [record["step"] for record in metrics] == list(range(1, 31))
    for record in metrics:
        assert record.keys() >= METRIC_KEYS
        assert all(math.isfinite(record[key]) for key in METRIC_KEYS)
        assert record["grad_norm"] > 0 and record["tokens_per_s"] > 0
        # The learning rate of the step just taken (0-based step - 1).
        expected_lr = learning_rate(record["step"] - 1, config.scheduler, config.optimizer, 30)
        assert record["lr"] == pytest.approx(expected_lr, rel=1e-12)
    assert [r["step"] for r in metrics if "val_loss" in r] == [10, 20, 30]

    first = metrics[0]["loss"]
    last_five = sum(r["loss"] for r in metrics[-5:]) / 5
    assert first == pytest.approx(math.log(VOCAB), abs=0.3)  # a fresh model guesses uniformly
    assert last_five < first - 0.5
    assert last_five < math.log(VOCAB) - 0.5
    val = [r["val_loss"] for r in metrics if "val_loss" in r]
    assert val[-1] < val[0] - 0.3

    assert result.steps == 30 and result.final_loss == metrics[-1]["loss"]
    assert result.val_loss == metrics[-1]["val_loss"]
    assert result.checkpoint == tmp_path / "checkpoints" / "step-00000030"
    state = json.loads((result.checkpoint / "state.json").read_text())
    assert state["step"] == 30 and state["consumed_samples"] == 30 * 8
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_recording_each_step_one_step_late_writes_the_same_records(
    shards: Path, tmp_path: Path
) -> None:
    # On a GPU fit reads step k's metrics after launching step k + 1; evaluation and
    # checkpoint steps are recorded at once, before the weights move on.
    values = {"training.train_iters": 12, "training.eval_interval": 5, "checkpoint.interval": 4}

    def records(late: bool) -> list[dict[str, Any]]:
        trainer = Trainer(tiny_config(shards, values), tmp_path / f"late-{late}")
        trainer.records_one_step_late = late
        trainer.fit(show_progress=False)
        return read_metrics(tmp_path / f"late-{late}" / "metrics.jsonl")

    late, at_once = records(True), records(False)
    assert [r["step"] for r in late] == list(range(1, 13))
    assert [r["step"] for r in late if "val_loss" in r] == [5, 10, 12]
    keys = ("step", "loss", "lr", "grad_norm", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in late] == [
        {k: r.get(k) for k in keys} for r in at_once
    ]
    assert (tmp_path / "late-True" / "checkpoints" / "step-00000008").is_dir()


# --- exact resume -------------------------------------------------------------------------

N = 4
RESUME = {
    "training.train_iters": 2 * N,
    "training.micro_batch_size": 4,  # two micro-batches per step
    "training.eval_interval": N,
    "checkpoint.interval": N,
    "model.dropout": 0.1,  # the dropout masks come from the RNG, which must resume too
}


@pytest.fixture(scope="module")
def uninterrupted(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run to step 2N in one go."""
    output = tmp_path_factory.mktemp("uninterrupted")
    train(tiny_config(shards, RESUME), output, show_progress=False)
    return output


def test_resume_in_process_continues_the_same_curve(
    shards: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    expected = read_metrics(uninterrupted / "metrics.jsonl")
    config = tiny_config(shards, RESUME)

    first = Trainer(config, tmp_path)
    batches = iter(first._loader(first.train_data, 0, N * 8))
    head = [first.train_step(batches)["loss"] for _ in range(N)]
    assert head == [record["loss"] for record in expected[:N]]
    first.save()
    del first

    second = Trainer(config, tmp_path)  # fresh weights, optimizer and RNG
    assert second.resume()
    assert (second.step, second.consumed_samples) == (N, N * 8)
    result = second.fit(show_progress=False)

    assert losses(result.metrics) == {s: loss for s, loss in losses(expected).items() if s > N}
    assert result.metrics[-1]["val_loss"] == expected[-1]["val_loss"]
    assert_same_model_files(
        tmp_path / "model" / "model.safetensors", uninterrupted / "model" / "model.safetensors"
    )

    # Resuming the finished run trains nothing and reports what it had done.
    again = Trainer(config, tmp_path)
    assert again.resume()
    final = again.fit(show_progress=False)
    assert final.steps == 2 * N
    assert final.final_loss == expected[-1]["loss"]
    assert final.val_loss == expected[-1]["val_loss"]
    assert final.checkpoint == tmp_path / "checkpoints" / f"step-{2 * N:08d}"
    assert final.metrics == result.metrics


def test_resume_requiring_signatures_refuses_an_unsigned_checkpoint(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.require_signature reaches the trainer's resume; saving signs with the key."""
    monkeypatch.delenv("MEGALITH_SIGNING_KEY", raising=False)
    config = tiny_config(shards, {**RESUME, "training.train_iters": 1})
    unsigned = Trainer(config, tmp_path / "unsigned")
    unsigned.train_step(iter(unsigned._loader(unsigned.train_data, 0, 8)))
    unsigned.save()
    strict = config.model_copy(deep=True)
    strict.checkpoint.require_signature = True
    with pytest.raises(MegalithError, match="signature"):
        Trainer(strict, tmp_path / "unsigned").resume()

    monkeypatch.setenv("MEGALITH_SIGNING_KEY", "k" * 32)
    signed = Trainer(config, tmp_path / "signed")
    signed.train_step(iter(signed._loader(signed.train_data, 0, 8)))
    signed.save()
    assert (signed.checkpoint / "signature.json").is_file()
    assert Trainer(strict, tmp_path / "signed").resume()
    monkeypatch.setenv("MEGALITH_SIGNING_KEY", "x" * 32)  # another key: refused
    with pytest.raises(MegalithError, match="signature"):
        Trainer(strict, tmp_path / "signed").resume()


def test_sigkill_then_resume_equals_an_uninterrupted_run(
    shards: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    output = tmp_path / "run"
    latest = output / "checkpoints" / "latest.json"
    log = (tmp_path / "killed.log").open("w")
    process = subprocess.Popen(
        cli(shards, output, RESUME, "--quiet"),
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while not latest.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert process.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    assert json.loads(latest.read_text())["step"] == N
    assert (output / "checkpoints" / f"step-{N:08d}").is_dir()
    # A kill can also land in the middle of writing a line of metrics.jsonl.
    with (output / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 7, "loss": 5.')

    resumed = subprocess.run(
        cli(shards, output, RESUME, "--quiet", "--resume"),
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {output / 'checkpoints' / f'step-{N:08d}'}" in resumed.stdout

    expected = read_metrics(uninterrupted / "metrics.jsonl")
    actual = read_metrics(output / "metrics.jsonl")
    assert [r["step"] for r in actual] == list(range(1, 2 * N + 1))  # one curve, no repeats
    assert losses(actual) == losses(expected)  # exactly, not approximately
    assert [r["grad_norm"] for r in actual] == [r["grad_norm"] for r in expected]
    assert [r.get("val_loss") for r in actual] == [r.get("val_loss") for r in expected]
    assert_same_model_files(
        output / "model" / "model.safetensors", uninterrupted / "model" / "model.safetensors"
    )
    last = f"step-{2 * N:08d}"
    got = read_global_tensors(output / "checkpoints" / last)
    want = read_global_tensors(uninterrupted / "checkpoints" / last)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# --- gradient accumulation ----------------------------------------------------------------


def test_two_micro_batches_of_four_give_the_gradient_of_one_batch_of_eight(
    shards: Path, tmp_path: Path
) -> None:
    def first_step(micro_batch_size: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        values = {
            "training.micro_batch_size": micro_batch_size,
            "training.train_iters": 1,
            "training.grad_clip": 0,
        }
        trainer = Trainer(tiny_config(shards, values), tmp_path / f"micro-{micro_batch_size}")
        batches = iter(trainer._loader(trainer.train_data, 0, 8))
        record = trainer.train_step(batches)
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        return record, grads

    whole, whole_grads = first_step(8)
    accumulated, accumulated_grads = first_step(4)

    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert accumulated["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert whole_grads.keys() == accumulated_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(accumulated_grads[name], grad, rtol=1e-4, atol=1e-7)


def test_clipping_inside_the_fused_step_equals_clipping_before_it(
    shards: Path, tmp_path: Path
) -> None:
    # A clip threshold well below the first step's norm, so the clipping really acts.
    def three_steps(fused: bool) -> tuple[Trainer, list[dict[str, float]]]:
        values = {"optimizer.fused": fused, "training.grad_clip": 0.05, "training.train_iters": 3}
        trainer = Trainer(tiny_config(shards, values), tmp_path / f"fused-{fused}")
        batches = iter(trainer._loader(trainer.train_data, 0, 24))
        return trainer, [trainer.train_step(batches) for _ in range(3)]

    folded, folded_records = three_steps(fused=True)
    separate, separate_records = three_steps(fused=False)
    assert folded.clips_in_step and not separate.clips_in_step
    assert folded_records[0]["grad_norm"] > 0.05 * 10
    for a, b in zip(folded_records, separate_records, strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for (name, a), b in zip(
        folded.model.named_parameters(), separate.model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


# --- schedules ----------------------------------------------------------------------------

PEAK, FLOOR = 1e-3, 1e-4
OPTIMIZER = OptimizerConfig(lr=PEAK, min_lr=FLOOR)


def lr(step: int, schedule: Schedule, train_iters: int = 110) -> float:
    return learning_rate(step, schedule, OPTIMIZER, train_iters)


def test_warmup_then_cosine() -> None:
    schedule = Schedule(name="cosine", warmup_iters=10)
    assert lr(0, schedule) == pytest.approx(PEAK / 10)
    assert lr(4, schedule) == pytest.approx(PEAK / 2)
    assert lr(9, schedule) == pytest.approx(PEAK)  # the end of the warmup
    assert lr(10, schedule) == pytest.approx(PEAK)
    assert lr(60, schedule) == pytest.approx((PEAK + FLOOR) / 2)  # half way through the decay
    assert lr(110, schedule) == pytest.approx(FLOOR)
    assert lr(500, schedule) == pytest.approx(FLOOR)  # never below the floor
    decay = [lr(step, schedule) for step in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))

    short = Schedule(name="cosine", warmup_iters=10, decay_iters=60)
    assert lr(35, short) == pytest.approx((PEAK + FLOOR) / 2)
    assert lr(60, short) == pytest.approx(FLOOR)
    assert lr(100, short) == pytest.approx(FLOOR)
    assert lr(0, Schedule(name="cosine", warmup_iters=0)) == pytest.approx(PEAK)


def test_warmup_stable_decay() -> None:
    schedule = Schedule(name="wsd", warmup_iters=10, wsd_decay_fraction=0.2)  # decays from 80
    assert lr(0, schedule, 100) == pytest.approx(PEAK / 10)
    assert lr(9, schedule, 100) == pytest.approx(PEAK)
    assert lr(50, schedule, 100) == pytest.approx(PEAK)
    assert lr(80, schedule, 100) == pytest.approx(PEAK)
    assert lr(90, schedule, 100) == pytest.approx((PEAK + FLOOR) / 2)
    assert lr(100, schedule, 100) == pytest.approx(FLOOR)
    assert lr(150, schedule, 100) == pytest.approx(FLOOR)


def test_constant_after_warmup() -> None:
    schedule = Schedule(name="constant", warmup_iters=4)
    assert lr(0, schedule) == pytest.approx(PEAK / 4)
    assert lr(3, schedule) == pytest.approx(PEAK)
    assert lr(60, schedule) == pytest.approx(PEAK)
    assert lr(110, schedule) == pytest.approx(PEAK)


# --- precision ----------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_training_tracks_eager_with_either_backend(shards: Path, tmp_path: Path) -> None:
    """``training.compile`` runs the model through torch.compile with
    ``training.compile_backend``: Inductor (the default) generates kernels; ``aot_eager``
    traces the same graphs (dynamo and AOT autograd) without code generation, which the
    pipeline tests use to keep CPU compiles short. Both give eager's losses."""
    from torch._dynamo.utils import counters

    values = {"training.train_iters": 3, "training.eval_interval": 0}  # one graph, fwd + bwd
    curves = {}
    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        counters.clear()
        compiled = {"training.compile": "true", "training.compile_backend": backend}
        settings = values if backend == "eager" else {**values, **compiled}
        result = train(tiny_config(shards, settings), tmp_path / backend, show_progress=False)
        curves[backend] = [r["loss"] for r in result.metrics]
        graphs = counters["stats"]["unique_graphs"]
        assert (graphs > 0) == (backend != "eager"), (backend, dict(counters["stats"]))
        generated = sum(counters["inductor"].values())
        assert (generated > 0) == (backend == "inductor"), (backend, dict(counters["inductor"]))
    assert curves["aot_eager"] == pytest.approx(curves["eager"], abs=1e-5)
    assert curves["inductor"] == pytest.approx(curves["eager"], abs=1e-4)


def test_bf16_autocast_trains_on_cpu(shards: Path, tmp_path: Path) -> None:
    """The MLP blocks compute in bf16 (a run ignoring the setting computes them in fp32),
    while the trained parameters and the saved tensors stay fp32 master weights."""
    values = {
        "mixed_precision.dtype": "bf16",
        "training.train_iters": 4,
        "training.eval_interval": 4,
    }
    with module_output_dtypes() as dtypes:
        result = train(tiny_config(shards, values), tmp_path, show_progress=False)
    assert dtypes["MLP"] == {torch.bfloat16}, dict(dtypes)
    saved = read_global_tensors(result.checkpoint)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert len(result.metrics) == 4
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in result.metrics)
    assert math.isfinite(result.val_loss)
    assert "loss_scale" not in result.metrics[0]
    assert json.loads((result.checkpoint / "state.json").read_text())["scaler"] is None


def test_fp16_with_loss_scaling_trains_and_resumes_the_scale(shards: Path, tmp_path: Path) -> None:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
    except RuntimeError as error:
        pytest.skip(f"this torch has no fp16 autocast on CPU: {error}")
    values = {
        "mixed_precision.dtype": "fp16",
        "mixed_precision.initial_loss_scale": 1024,
        "mixed_precision.loss_scale_growth_interval": 2,
        "training.train_iters": 5,
        "training.eval_interval": 5,
    }
    config = tiny_config(shards, values)
    result = train(config, tmp_path, show_progress=False)

    assert all(math.isfinite(r["loss"]) for r in result.metrics)
    scales = [r["loss_scale"] for r in result.metrics]
    assert scales[0] == 1024 and scales[-1] > 1024  # grows every 2 clean steps
    saved = json.loads((result.checkpoint / "state.json").read_text())["scaler"]
    assert saved["scale"] == scales[-1]

    resumed = Trainer(config, tmp_path)
    assert resumed.precision.scaler.get_scale() == 1024
    assert resumed.resume()
    assert resumed.precision.scaler.get_scale() == scales[-1]
    assert resumed.precision.scaler.state_dict() == saved


# --- weight decay -------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_no_weight_decay_on_norms_biases_and_embeddings(style: str) -> None:
    config = ModelConfig(
        style=style,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_embeddings=style == "gpt2",
        backend="torch",
    )
    model = GPTModel(config)
    optimizer, names = build_optimizer(
        model, OptimizerConfig(weight_decay=0.1), torch.device("cpu")
    )
    assert isinstance(optimizer, torch.optim.AdamW)

    decay_of = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            decay_of[id(param)] = group["weight_decay"]
    params = dict(model.named_parameters())
    assert len(decay_of) == len(params) and sorted(names) == sorted(params)
    for name, param in params.items():
        exempt = ".norm." in name or name.startswith(("final_norm.", "embedding."))
        exempt = exempt or name.endswith(".bias")
        assert decay_of[id(param)] == (0.0 if exempt else 0.1), name
    if style == "llama":  # an untied output head is a matrix like any other
        assert decay_of[id(params["output.weight"])] == 0.1
    else:
        assert decay_of[id(params["embedding.position.weight"])] == 0.0
        assert any(name.endswith(".bias") for name in params)


# --- MLflow -------------------------------------------------------------------------------


def test_megalith_train_logs_one_mlflow_run(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "run"
    values = {
        "logging.mlflow": "true",
        "logging.experiment": "trainer-test",
        "training.train_iters": 3,
        "training.eval_interval": 3,
    }
    sets = [arg for setting in overrides(shards, values) for arg in ("--set", setting)]
    assert main(["train", "--config", str(RECIPE), *sets, "--output", str(output)]) == 0

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("trainer-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert json.loads((output / "result.json").read_text())["mlflow_run_id"] == run.info.run_id

    params = run.data.params
    assert params["model.hidden_size"] == "64"
    assert params["model.vocab_size"] == str(VOCAB)  # as built, filled from the shard set
    assert params["training.train_iters"] == "3"
    assert params["optimizer.lr"] == "0.003"
    assert params["data.output"] == str(shards)

    history = client.get_metric_history(run.info.run_id, "loss")
    expected = losses(read_metrics(output / "metrics.jsonl"))
    assert {m.step: m.value for m in history} == expected
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [3]

    manifest = shards / "manifest.json"
    tags = run.data.tags
    assert tags["megalith.tokenizer.id"] == json.loads(manifest.read_text())["tokenizer"]["id"]
    assert (
        tags["megalith.data.manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    )
    assert tags["megalith.code.version"]
    checkout = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True)
    if head.returncode == 0:  # run from a checkout (CI clones one): the run names its commit
        assert tags["mlflow.source.git.commit"] == head.stdout.decode().strip()
        assert tags["megalith.code.version"].startswith(tags["mlflow.source.git.commit"])
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert artifacts == ["plots/loss_curve.png"]


# --- command line -------------------------------------------------------------------------


def test_megalith_train_help_documents_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--config YAML", "--set KEY=VALUE", "--output DIR", "--resume", "--quiet"):
        assert flag in text
    assert "metrics.jsonl" in text and "checkpoint" in text


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("training.bogus_key=1", "training.bogus_key: unknown key"),
        ("training.train_iters=many", "training.train_iters: Input should be a valid integer"),
        ("training.train_iters.x=1", "training.train_iters is a value, not a section"),
    ],
)
def test_a_bad_setting_is_a_short_error_naming_the_key(
    tmp_path: Path, setting: str, message: str
) -> None:
    command = ["train", "--config", str(RECIPE), "--set", setting, "--output", str(tmp_path)]
    completed = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert completed.returncode == 1
    assert message in completed.stderr
    assert completed.stderr.startswith("error: ")
    assert "Traceback" not in completed.stderr
    assert len(completed.stderr.strip().splitlines()) <= 2
    assert completed.stdout == ""
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_checkpoint_resumes_with_this_runs_optimizer_kernel(shards: Path, tmp_path: Path) -> None:
    """The optimizer's kernel choice (fused, foreach) belongs to the process, not to the
    run: a checkpoint saved without the fused step (a laptop's CPU run) resumes with it, the
    clipping still folded into the step, and the other way round."""
    for saved_fused, resumed_fused in [(False, True), (True, False)]:
        values = {"optimizer.fused": saved_fused, "training.grad_clip": 0.05}
        first = Trainer(tiny_config(shards, values), tmp_path / str(saved_fused))
        batches = iter(first._loader(first.train_data, 0, 16))
        first.train_step(batches)
        first.save()
        values["optimizer.fused"] = resumed_fused
        second = Trainer(tiny_config(shards, values), tmp_path / str(saved_fused))
        assert second.resume()
        assert [group["fused"] for group in second.optimizer.param_groups] == [
            resumed_fused or None
        ] * len(second.optimizer.param_groups)
        assert second.clips_in_step == resumed_fused
        record = second.train_step(iter(second._loader(second.train_data, 0, 16)))
        assert record["grad_norm"] > 0.05 and math.isfinite(record["loss"])
