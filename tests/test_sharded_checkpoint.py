"""Sharded checkpoints (format v2) through the real Trainer: resharding, partial reads,
async save under SIGKILL, S3, and v1 checkpoints.

- Resharding: an 8-process run (TP=2 × PP=2 × DP=2, sequence parallel, distributed
  optimizer) saves at steps 2 and 4; its step-2 checkpoint resumes in one process, at
  TP=4 (4 processes), at DP=4 with the distributed optimizer, at DP=4 with FSDP and at
  TP=2 x FSDP DP=2 (2-D), and every continuation matches the uninterrupted
  single-process run (losses within 1e-5,
  grad norms within 1e-4 relative, as the parity tests). In every layout run, each
  rank's boxes cut out of a whole tensor equal what the older ``shard_loaded`` load
  paths give.
- 2-D: a TP=2 x FSDP DP=2 run (sequence parallel) matches one process; its checkpoint
  (FSDP rows of TP slices) resumes at TP=2, at FSDP DP=4 and in one process.
- Partial reads: on resume each rank reads exactly the bytes it holds (parameters and
  AdamW state), and the TP=4 ranks of the first half never open the TP=2 rank-1 files.
- Async save: a run killed (SIGKILL) while its second save is being written (a test-only
  env var makes the writer sleep before the commit) leaves the first checkpoint
  complete, verifiable and resumable exactly; the next save removes the leftover.
- S3 (moto server): save to ``s3://bucket/run/checkpoints`` and resume from it.
- A v1 (whole-tensor) checkpoint still resumes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_helpers import (
    BACKEND,
    DEVICE,
    LOSS_ATOL,
    RECIPE,
    RESUME_STEP,
    STEPS,
    assert_metrics_match,
    assert_one_process_resume,
    child_env,
    config_of,
    fit_one_process,
    metrics,
    run_torchrun_worker,
    set_args,
    trainer_settings,
)
from safetensors.torch import load_file, save_file

from pipelines.cli import main as cli_main
from training.checkpoint.async_save import TEST_WRITE_DELAY_ENV
from training.checkpoint.convert import consolidate
from training.checkpoint.format import CheckpointError, save_checkpoint
from training.checkpoint.sharded_index import latest_sharded_checkpoint, read_index
from training.checkpoint.sharded_reader import read_global_tensor, verify_sharded_checkpoint
from training.checkpoint.signing import sign_directory
from training.trainer import Trainer

# 4 layers for 2 pipeline stages; 4 KV groups so that TP=4 divides them.
MODEL = {"model.num_layers": 4, "model.num_query_groups": 4}
SAVED = {
    "parallel.tensor": 2,
    "parallel.pipeline": 2,
    "parallel.sequence_parallel": "true",
    "parallel.data_parallel_mode": "distributed_optimizer",
}
TWO_D = {
    "parallel.tensor": 2,
    "parallel.sequence_parallel": "true",
    "parallel.data_parallel_mode": "fsdp",
}
RESUMED = {
    "tp4": {"parallel.tensor": 4},
    "dp4-distributed-optimizer": {"parallel.data_parallel_mode": "distributed_optimizer"},
    # 2 eval micro-batches for 4 FSDP ranks: the two ranks without one run an uncounted
    # forward, or the others would wait for them in FSDP's all-gathers.
    "dp4-fsdp": {"parallel.data_parallel_mode": "fsdp"},
    "tp2-fsdp": TWO_D,
}
# A 2-D run (FSDP rows of each TP shard) in the same job, and its step-2 checkpoint
# resumed at TP only and at FSDP only.
FROM_TWO_D = {
    "2d-to-tp2": {"parallel.tensor": 2},
    "2d-to-dp4-fsdp": {"parallel.data_parallel_mode": "fsdp"},
}
# Expert parallelism (EP=2 carved out of DP=4): run alongside the resumes above.
EXPERTS = {
    "model.num_experts": 4,
    "model.moe_top_k": 2,
    "model.moe_ffn_hidden_size": 32,
    "training.eval_iters": 4,  # every EP rank runs as many validation forwards
}


def settings(shards: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return trainer_settings(shards, {**MODEL, **(extra or {})})


def worker(out: Path, world: int, **parts: Any) -> Path:
    spec = {"recipe": str(RECIPE), "device": DEVICE, "resume_step": RESUME_STEP, "out": str(out)}
    return run_torchrun_worker(
        "pp_worker.py", {**spec, **parts}, out, world, f"sharded ({world} processes)"
    )


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted single-process run."""
    return fit_one_process(settings(shards), tmp_path_factory.mktemp("sharded-reference"))


@pytest.fixture(scope="module")
def saved(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8-process run; its checkpoints are the ones resharded below."""
    out = tmp_path_factory.mktemp("sharded-8")
    return worker(out, 8, fit_cases={"saved": settings(shards, SAVED)}) / "saved"


@pytest.fixture(scope="module")
def resharded(shards: Path, saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-2 checkpoint of the 8-process run resumed by 4 processes in 4 layouts,
    and in the same job an expert-parallel run (EP=2 x DP=4) and a 2-D run (TP=2 x FSDP
    DP=2, sequence parallel) whose step-2 checkpoint resumes at TP=2 and at FSDP DP=4."""
    cases = {name: settings(shards, extra) for name, extra in {**RESUMED, **FROM_TWO_D}.items()}
    out = tmp_path_factory.mktemp("sharded-4")
    return worker(
        out,
        4,
        fit_cases={
            "ep2": settings(shards, {**EXPERTS, "parallel.expert": 2}),
            "2d": settings(shards, TWO_D),
        },
        resume_cases=cases,
        resume_from=dict.fromkeys(FROM_TWO_D, "2d"),
        checkpoint_root=str(saved / "checkpoints"),
    )


def reads(run: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((run / f"reads-rank{r}.json").read_text()) for r in range(world)]


# --- resharding -----------------------------------------------------------------------------


def test_eight_process_run_writes_one_index_over_its_shards(saved: Path, reference: Path) -> None:
    name = f"TP=2 x PP=2 x DP=2 ({BACKEND}, 8 processes)"
    assert_metrics_match(metrics(saved), metrics(reference), name)
    for rank in range(8):
        problems = json.loads((saved / f"boxes-rank{rank}.json").read_text())
        assert problems == [], f"{name}: boxes differ from shard_loaded: {problems}"
    path = saved / "checkpoints" / f"step-{STEPS:08d}"
    index = verify_sharded_checkpoint(path)
    assert index["layout"] == {
        "tp": 2, "pp": 2, "vpp": 1, "dp": 2, "cp": 1, "ep": 1,
        "data_parallel_mode": "distributed_optimizer", "world": 8,
    }  # fmt: skip
    # Model files from the first DP replica only (TP ranks 0, 1 of both stages);
    # ZeRO-1 state from every rank; the fused SwiGLU fc1 as two boxes per TP rank.
    files = set(index["files"])
    assert {f for f in files if f.startswith("model-")} == {
        f"model-r{r:05d}.safetensors" for r in (0, 1, 4, 5)
    }
    fc1 = index["tensors"]["layers.0.mlp.fc1.linear.weight"]["shards"]
    assert (
        sorted(s["key"] for s in fc1)
        == ["layers.0.mlp.fc1.linear.weight#0"] * 2 + ["layers.0.mlp.fc1.linear.weight#1"] * 2
    )
    # The whole tensors equal the single-process checkpoint's.
    want = reference / "checkpoints" / f"step-{STEPS:08d}"
    for tensor in (
        "layers.0.mlp.fc1.linear.weight",
        "optimizer/layers.3.attention.qkv.linear.weight/exp_avg",
    ):
        torch.testing.assert_close(
            read_global_tensor(path, tensor), read_global_tensor(want, tensor),
            rtol=1e-4, atol=1e-5, msg=lambda m, t=tensor: f"{name} {t}: {m}",
        )  # fmt: skip


def test_one_process_resumes_the_eight_process_checkpoint(
    saved: Path, shards: Path, tmp_path: Path
) -> None:
    assert_one_process_resume(saved, settings(shards), tmp_path, "TP=2 x PP=2 x DP=2 -> 1")


@pytest.mark.parametrize("case", RESUMED)
def test_other_layouts_resume_the_eight_process_checkpoint(
    case: str, resharded: Path, reference: Path
) -> None:
    name = f"TP=2 x PP=2 x DP=2 resumed at {case} ({BACKEND}, 4 processes)"
    want = [r for r in metrics(reference) if r["step"] > RESUME_STEP]
    assert_metrics_match(metrics(resharded / case), want, name, losses=("loss", "val_loss"))
    for record in reads(resharded / case, 4):
        assert record["box_problems"] == [], f"{name}: {record['box_problems']}"


@pytest.mark.parametrize("case", RESUMED)
def test_each_rank_reads_exactly_what_it_holds(case: str, resharded: Path) -> None:
    for rank, record in enumerate(reads(resharded / case, 4)):
        assert record["bytes"] == record["held_bytes"], (
            f"{case} rank {rank} read {record['bytes']} bytes, holds {record['held_bytes']}"
        )
    if case == "tp4":  # ranks 0, 1 hold the first half of every split tensor
        for rank, record in enumerate(reads(resharded / case, 4)[:2]):
            opened = set(record["files"])
            assert not opened & {"model-r00001.safetensors", "model-r00005.safetensors"}, (
                f"TP=4 rank {rank} opened a TP=2 rank-1 file: {sorted(opened)}"
            )


def test_one_process_resumes_an_expert_parallel_checkpoint(
    resharded: Path, shards: Path, tmp_path: Path
) -> None:
    run, name = resharded / "ep2", f"EP=2 x DP=4 ({BACKEND}, 4 processes)"
    for rank in range(4):
        problems = json.loads((run / f"boxes-rank{rank}.json").read_text())
        assert problems == [], f"{name}: boxes differ from shard_loaded: {problems}"
    experts = verify_sharded_checkpoint(run / "checkpoints" / f"step-{RESUME_STEP:08d}")
    stacked = [n for n in experts["tensors"] if ".experts." in n and "/" not in n]
    assert stacked and all(len(experts["tensors"][n]["shards"]) == 2 for n in stacked), name
    assert_one_process_resume(run, settings(shards, EXPERTS), tmp_path, f"{name} -> 1")


def test_a_two_d_checkpoint_resumes_in_other_layouts(
    resharded: Path, shards: Path, reference: Path, tmp_path: Path
) -> None:
    """TP=2 x FSDP DP=2 (sequence parallel) matches one process step by step; its
    checkpoint holds 2-D boxes (FSDP rows of TP slices) and resumes at TP=2 (DDP), at
    FSDP DP=4 and in one process as the uninterrupted single-process run continues."""
    run, name = resharded / "2d", f"TP=2 x FSDP DP=2, SP ({BACKEND}, 4 processes)"
    assert_metrics_match(metrics(run), metrics(reference), name)
    for rank in range(4):
        problems = json.loads((run / f"boxes-rank{rank}.json").read_text())
        assert problems == [], f"{name}: boxes differ from shard_loaded: {problems}"
    index = verify_sharded_checkpoint(run / "checkpoints" / f"step-{RESUME_STEP:08d}")
    # The fused SwiGLU fc1 [gate; up] of 128 rows: TP rank t holds rows [32t, 32t + 32)
    # of each chunk, FSDP rank d the d-th half of the shard: the gate part or the up part.
    fc1 = index["tensors"]["layers.0.mlp.fc1.linear.weight"]["shards"]
    assert sorted(tuple(s["box"][0]) for s in fc1) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    want = [r for r in metrics(reference) if r["step"] > RESUME_STEP]
    for case in FROM_TWO_D:
        resumed = f"{name} resumed at {case}"
        assert_metrics_match(metrics(resharded / case), want, resumed, losses=("loss", "val_loss"))
        for record in reads(resharded / case, 4):
            assert record["box_problems"] == [], f"{resumed}: {record['box_problems']}"
            assert record["bytes"] == record["held_bytes"], f"{resumed}: {record}"
    assert_one_process_resume(run, settings(shards), tmp_path, f"{name} -> 1")


# --- async save, killed ---------------------------------------------------------------------


def test_kill_during_an_async_save_leaves_the_previous_checkpoint(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    values = settings(shards)
    output = tmp_path / "run"
    staging = output / "checkpoints" / f"step-{STEPS:08d}.tmp"
    command = [sys.executable, "-m", "pipelines.cli", "train", "--config", str(RECIPE)]
    command += [*set_args(values), "--output", str(output), "--quiet"]
    process = subprocess.Popen(
        command,
        env=child_env(**{TEST_WRITE_DELAY_ENV: "3"}),  # test only: the writer sleeps
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        # The step-4 files are written; its commit waits out the delay.
        while not (staging / "state.json").exists() and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    checkpoints = output / "checkpoints"
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == RESUME_STEP
    assert not (checkpoints / f"step-{STEPS:08d}").exists()
    assert (staging / "model-r00000.safetensors").is_file()  # killed mid-save indeed
    verify_sharded_checkpoint(checkpoints / f"step-{RESUME_STEP:08d}")

    config = config_of({**values, "checkpoint.async_save": "false"})
    trainer = Trainer(config, output)
    assert trainer.resume() and trainer.step == RESUME_STEP
    trainer.fit(show_progress=False)
    want = {r["step"]: r["loss"] for r in metrics(reference)}
    assert {r["step"]: r["loss"] for r in metrics(output)} == want  # exactly
    assert not staging.exists(), "the next save removes the killed save's directory"
    # The step after a save reports how long training waited for it.
    assert metrics(reference)[RESUME_STEP]["checkpoint_blocked_s"] < 5.0


# --- S3 ------------------------------------------------------------------------------------


def test_save_to_s3_and_resume_from_it(
    shards: Path, s3_bucket: str, s3_endpoint: dict, tmp_path: Path
) -> None:
    import s3fs

    root = f"{s3_bucket}/run/checkpoints"
    values = settings(shards, {"checkpoint.directory": root})
    first = fit_one_process(values, tmp_path / "first")
    fs = s3fs.S3FileSystem(**s3_endpoint)
    step2, step4 = (f"{root}/step-{s:08d}" for s in (RESUME_STEP, STEPS))
    assert latest_sharded_checkpoint(root) == step4
    index = verify_sharded_checkpoint(step4)
    assert read_index(step4)["files"].keys() == index["files"].keys()
    # Back to step 2: drop step 4 and the pointer (the newest committed one counts), and
    # leave a save that never committed (no index.json): it is never loaded.
    fs.rm(step4, recursive=True)
    fs.rm(f"{root}/latest.json")
    fs.pipe(f"{root}/step-{8:08d}/model-r00000.safetensors", b"partial")
    assert latest_sharded_checkpoint(root) == step2

    trainer = Trainer(config_of(values), tmp_path / "second")
    assert trainer.resume() and trainer.step == RESUME_STEP
    assert trainer.checkpoint == step2
    trainer.fit(show_progress=False)
    got = {r["step"]: r["loss"] for r in metrics(tmp_path / "second")}
    assert got == {r["step"]: r["loss"] for r in metrics(first) if r["step"] > RESUME_STEP}
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/step-{8:08d}"), "an uncommitted save is cleaned up"


# --- convert ---------------------------------------------------------------------------------


def _resume_from(root: Path, settings_: dict[str, Any], out: Path) -> dict[int, float]:
    """Resume the latest checkpoint under ROOT in one process and train to the end."""
    trainer = Trainer(config_of({**settings_, "checkpoint.directory": str(root)}), out)
    assert trainer.resume() and trainer.step == RESUME_STEP
    trainer.fit(show_progress=False)
    return {r["step"]: r["loss"] for r in metrics(out)}


def test_convert_consolidates_the_eight_process_checkpoint(
    saved: Path, shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``megalith ckpt convert``: one model and one optimizer file of whole tensors, equal
    to the sharded ones; training resumes from it with the same losses."""
    source = saved / "checkpoints" / f"step-{RESUME_STEP:08d}"
    assert cli_main(["ckpt", "convert", str(source), str(tmp_path / "converted")]) == 0
    converted = tmp_path / "converted" / f"step-{RESUME_STEP:08d}"
    index = json.loads((converted / "index.json").read_text())
    assert set(index["files"]) == {
        "model-r00000.safetensors", "optimizer-r00000.safetensors", "state.json"
    }  # fmt: skip
    assert all(len(meta["shards"]) == 1 for meta in index["tensors"].values())
    assert set(index["tensors"]) == set(read_index(source)["tensors"])
    for name in ("layers.0.mlp.fc1.linear.weight", "optimizer/embedding.word.weight/exp_avg"):
        assert torch.equal(read_global_tensor(converted, name), read_global_tensor(source, name))
    assert cli_main(["ckpt", "verify", str(converted)]) == 0
    capsys.readouterr()
    losses = _resume_from(tmp_path / "converted", settings(shards), tmp_path / "run")
    straight = {r["step"]: r["loss"] for r in metrics(saved)}
    for step, loss in losses.items():
        assert loss == pytest.approx(straight[step], abs=LOSS_ATOL), f"converted: step {step}"


# --- v1 ------------------------------------------------------------------------------------


def test_a_v1_checkpoint_still_resumes(shards: Path, reference: Path, tmp_path: Path) -> None:
    """What the trainer wrote before v2: whole tensors by rank 0 (``save_checkpoint``)."""
    config = config_of(settings(shards, {"checkpoint.directory": str(tmp_path / "ckpt")}))
    old = Trainer(config, tmp_path / "old")
    batches = old.train_batches()
    for _ in range(RESUME_STEP):
        old.train_step(batches)
    old.consumed_samples = RESUME_STEP * config.training.global_batch_size
    state = {
        "consumed_samples": old.consumed_samples,
        "config": config.model_dump(mode="json"),
        "model_config": old.model_config.model_dump(mode="json"),
        "layout": old.parallel.layout(),
    }
    path = save_checkpoint(
        tmp_path / "ckpt", old.step, old.model, old.optimizer, old.param_names, state
    )
    assert read_index(path)["version"] == 1

    consolidate(path, tmp_path / "converted")  # v1 -> v2, before the resume below prunes
    resumed = Trainer(config, tmp_path / "new")
    assert resumed.resume() and resumed.step == RESUME_STEP
    resumed.fit(show_progress=False)
    want = {r["step"]: r["loss"] for r in metrics(reference) if r["step"] > RESUME_STEP}
    for record in metrics(tmp_path / "new"):
        assert record["loss"] == pytest.approx(want[record["step"]], abs=LOSS_ATOL), record
    # The same checkpoint converted to v2 resumes to the same losses (RNG state included).
    converted = _resume_from(tmp_path / "converted", settings(shards), tmp_path / "from-converted")
    assert converted == {r["step"]: r["loss"] for r in metrics(tmp_path / "new")}


# --- refusals --------------------------------------------------------------------------------


def test_a_checkpoint_without_a_needed_tensor_is_refused(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    step = f"step-{RESUME_STEP:08d}"
    shutil.copytree(reference / "checkpoints" / step, tmp_path / "ckpt" / step)
    index_path = tmp_path / "ckpt" / step / "index.json"
    index = json.loads(index_path.read_text())
    del index["tensors"]["layers.1.mlp.fc2.weight"]
    index_path.write_text(json.dumps(index))
    config = config_of(settings(shards, {"checkpoint.directory": str(tmp_path / "ckpt")}))
    trainer = Trainer(config, tmp_path / "run")
    before = trainer.model.final_norm.weight.detach().clone()
    with pytest.raises(CheckpointError, match="has no tensor layers.1.mlp.fc2.weight"):
        trainer.resume()
    assert torch.equal(trainer.model.final_norm.weight, before), "a refused load changed the model"


def test_a_shard_whose_file_disagrees_is_refused_before_any_copy(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """The last tensor's key renamed inside its file (and the index re-hashed, as an
    attacker would): refused, and not one parameter of the model changed."""
    step = f"step-{RESUME_STEP:08d}"
    root = tmp_path / "ckpt" / step
    shutil.copytree(reference / "checkpoints" / step, root)
    file = root / "model-r00000.safetensors"
    tensors = load_file(file)
    last = sorted(tensors)[-1]
    tensors[last + ".renamed"] = tensors.pop(last)
    save_file(tensors, file)
    index = json.loads((root / "index.json").read_text())
    index["files"][file.name] = {
        "bytes": file.stat().st_size,
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
    }
    (root / "index.json").write_text(json.dumps(index))
    config = config_of(settings(shards, {"checkpoint.directory": str(tmp_path / "ckpt")}))
    trainer = Trainer(config, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(CheckpointError, match=f"has no tensor {last}"):
        trainer.resume()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), f"a refused load changed {name}"


def test_convert_refuses_a_tampered_signed_checkpoint(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed checkpoint changed and re-hashed: ``convert`` refuses it (it would otherwise
    come out signed with the local key), and refuses an OUT holding an incomplete save."""
    monkeypatch.setenv("MEGALITH_SIGNING_KEY", "k" * 32)
    source = tmp_path / "src" / f"step-{STEPS:08d}"
    shutil.copytree(reference / "checkpoints" / f"step-{STEPS:08d}", source)
    sign_directory(source, "index.json")
    assert consolidate(source, tmp_path / "ok")  # signed and sound: converts
    index = json.loads((source / "index.json").read_text())
    index["step"] = 999  # any change after signing
    (source / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="signature"):
        consolidate(source, tmp_path / "bad")
    (tmp_path / "busy" / "step-00000005.tmp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        consolidate(tmp_path / "ok" / f"step-{STEPS:08d}", tmp_path / "busy")


def test_a_tampered_or_incomplete_checkpoint_is_refused(reference: Path, tmp_path: Path) -> None:
    path = tmp_path / "step"
    shutil.copytree(reference / "checkpoints" / f"step-{STEPS:08d}", path)
    file = path / "model-r00000.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-r00000.safetensors: sha256 does not match"):
        verify_sharded_checkpoint(path)
    index = json.loads((path / "index.json").read_text())
    shards = index["tensors"]["final_norm.weight"]["shards"]
    shards[0]["box"] = [[0, 1]]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="final_norm.weight: the shards cover 1 of its 32"):
        verify_sharded_checkpoint(path)
    # A shape (and box) claiming more than the files hold is refused before allocating.
    file.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))  # the original again
    shards[0]["box"] = [[0, 10**12]]
    index["tensors"]["final_norm.weight"]["shape"] = [10**12]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="final_norm.weight claims 4000000000000 bytes"):
        read_global_tensor(path, "final_norm.weight")
    (path / "index.json").unlink()
    with pytest.raises(CheckpointError, match="index.json is missing"):
        verify_sharded_checkpoint(path)
