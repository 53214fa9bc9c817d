"""The GPU benchmarks run end to end on CPU at their smoke shapes, so a device call never
spends its minutes finding a broken path."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_t5_throughput_runs_ours_and_the_hugging_face_baseline(tmp_path: Path) -> None:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--shape", "t5-tiny",
        "--variants", "ours,hf", "--steps", "1", "--warmup", "1", "--micro-batch", "2",
        "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]

    results = json.loads((tmp_path / "throughput-t5-tiny.json").read_text())["results"]
    for variant in ("ours", "hf"):
        result = results[variant]
        assert "error" not in result, f"{variant}: {result.get('error')}"
        assert result["tokens_per_s"] > 0 and math.isfinite(result["last_loss"]), result
    assert "| hf |" in completed.stdout and "| ours |" in completed.stdout


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
