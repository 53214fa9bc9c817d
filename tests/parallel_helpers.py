"""Shared by the multi-process tests: one tiny shard set per session, tiny configs,
and torchrun command lines.

The shard set is built once per pytest session (a directory under the session's base
temp dir, guarded by a lock), whichever test module asks first.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "tiny-cpu.yaml"
CORPUS = REPO / "preprocessing" / "sample_corpus" / "stories.jsonl"
VOCAB = 1024
SEQ = 32
# The parity tests run on GPUs (NCCL) too: MEGALITH_TEST_DEVICE=cuda.
DEVICE = os.environ.get("MEGALITH_TEST_DEVICE", "cpu")


def tiny_shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus as shards with a 1024-piece tokenizer, built once per session."""
    from preprocessing.stage import run_tokenize_stage
    from training.config import load_config

    root = tmp_path_factory.getbasetemp() / "megalith-tiny-shards"
    root.mkdir(exist_ok=True)
    output = root / "shards"
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (output / "manifest.json").exists():
            config = load_config(
                RECIPE,
                [f"data.output={output}", f"tokenizer.vocab_size={VOCAB}", "data.workers=1"],
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
    import json
    import subprocess

    (out / "spec.json").write_text(json.dumps(spec))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), "--max-restarts", "0",
        str(REPO / "tests" / worker), str(out / "spec.json"),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=child_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (
        f"{label} worker failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return out
