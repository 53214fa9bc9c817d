"""Shards made by Megatron-LM's tools/preprocess_data.py (no manifest) accepted by
``data verify`` and training once their tokenizer and EOD are named.

tests/data/megatron_preprocess/ holds a corpus, a SentencePiece model and the .bin/.idx
that Megatron-LM's own tool made from them (make_shards.py there says how, at which tag);
tests/test_prepare.py checks that ``data prepare --eod eos`` writes the same bytes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from megalith.config import load_config
from pipelines.cli import main
from preprocessing.indexed_dataset import IndexedDatasetReader, IndexedDatasetWriter
from preprocessing.megatron_shards import read_shard_set_manifest
from preprocessing.verify import verify_shard_set
from training.data.shard_set import open_shard_set
from training.metrics.run_logger import read_metrics
from training.trainer import train

MEGATRON = Path(__file__).parent / "data" / "megatron_preprocess"
RECIPE = Path(__file__).parent.parent / "configs" / "tiny-cpu.yaml"
EOS = sentencepiece.SentencePieceProcessor(
    model_file=str(MEGATRON / "tokenizer.model")
).piece_to_id("</s>")


def megatron_copy(tmp_path: Path, tokens: np.ndarray | None = None) -> Path:
    """The Megatron-made pair copied under ``tmp_path``, its tokens optionally replaced."""
    prefix = tmp_path / "megatron_text_document"
    shutil.copy(MEGATRON / "megatron_text_document.idx", f"{prefix}.idx")
    shutil.copy(MEGATRON / "megatron_text_document.bin", f"{prefix}.bin")
    if tokens is not None:
        Path(f"{prefix}.bin").write_bytes(tokens.tobytes())
    return prefix


def test_verify_accepts_megatron_shards_once_tokenizer_and_eod_are_named(tmp_path: Path) -> None:
    prefix = megatron_copy(tmp_path)
    named = ["--tokenizer", str(MEGATRON / "tokenizer.model"), "--eod", "eos"]
    assert main(["data", "verify", str(prefix), *named]) == 0
    folder, manifest = read_shard_set_manifest(str(prefix), None, named[1], "eos")
    assert folder == str(tmp_path) and manifest.tokenizer.eod_id == EOS
    theirs = IndexedDatasetReader(str(prefix))
    assert (manifest.documents, manifest.tokens) == (theirs.num_documents, theirs.num_tokens)
    unnamed = verify_shard_set(str(prefix))
    assert len(unnamed) == 1 and f"{prefix}.idx: a Megatron-LM shard" in unnamed[0]


def test_verify_names_the_file_of_a_megatron_set_that_does_not_fit(tmp_path: Path) -> None:
    model = str(MEGATRON / "tokenizer.model")
    tokens = np.fromfile(MEGATRON / "megatron_text_document.bin", dtype=np.uint16)
    tokens[7] = 400  # the vocabulary has 400 ids
    (tmp_path / "id").mkdir()
    prefix = megatron_copy(tmp_path / "id", tokens)
    problems = verify_shard_set(str(prefix), tokenizer=model, eod="eos")
    assert problems == [
        f"{prefix}.bin: document 0 holds token id 400; expected below 400 "
        "(the vocabulary size in the manifest)"
    ]
    # As preprocess_data.py writes for a tokenizer of 65,500 ids or more: int32.
    theirs = IndexedDatasetReader(str(MEGATRON / "megatron_text_document"))
    prefix = tmp_path / "int32"
    writer = IndexedDatasetWriter(str(prefix), np.dtype(np.int32))
    writer.add_documents(theirs.tokens.astype(np.int32), theirs.sequence_lengths.astype(np.int64))
    writer.finalize()
    (problem,) = verify_shard_set(str(prefix), tokenizer=model, eod="eos")
    assert problem.startswith(f"{prefix}.idx: ") and "int32" in problem
    (tmp_path / "short").mkdir()
    prefix = megatron_copy(tmp_path / "short")
    Path(f"{prefix}.idx").write_bytes((MEGATRON / "megatron_text_document.idx").read_bytes()[:40])
    (problem,) = verify_shard_set(str(prefix), tokenizer=model, eod="eos")
    assert problem.startswith(f"{prefix}.idx: ")


def test_two_training_steps_on_megatron_shards(tmp_path: Path) -> None:
    prefix = megatron_copy(tmp_path)
    source = {"path": str(prefix), "tokenizer": str(MEGATRON / "tokenizer.model"), "eod": "eos"}
    config = load_config(
        RECIPE,
        [
            f"data.blend={json.dumps([source])}",
            "data.seq_length=32",
            "data.split=[1.0,0.0,0.0]",
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.ffn_hidden_size=64",
            "model.num_attention_heads=2",
            "model.vocab_size=null",
            "model.max_position_embeddings=32",
            "training.micro_batch_size=2",
            "training.global_batch_size=2",
            "training.train_iters=2",
            "training.eval_interval=0",
            "checkpoint.interval=0",
            "logging.mlflow=false",
        ],
    )
    result = train(config, tmp_path / "run", show_progress=False)
    assert result.steps == 2 and math.isfinite(result.final_loss)
    steps = [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert steps == [1, 2]
    package = result.model_package
    # The vocabulary and the packaged tokenizer come from the named tokenizer (400 ids, padded).
    assert json.loads((package / "config.json").read_text())["model"]["vocab_size"] == 512
    assert (package / "tokenizer.model").read_bytes() == (MEGATRON / "tokenizer.model").read_bytes()


def test_inspect_reads_a_megatron_prefix_once_tokenizer_and_eod_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = megatron_copy(tmp_path)
    model = str(MEGATRON / "tokenizer.model")
    assert main(["data", "inspect", str(prefix), "--tokenizer", model, "--eod", "eos",
                 "--decode", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    first = json.loads((MEGATRON / "corpus.jsonl").read_text().splitlines()[0])["text"]
    theirs = IndexedDatasetReader(str(prefix))
    assert f"{theirs.num_documents:,} (" in out and f"eod id {EOS}" in out
    assert f"--- document 0 ---\n{first}" in out
    assert main(["data", "inspect", str(prefix)]) != 0
    assert f"{prefix}.idx: a Megatron-LM shard with no manifest.json" in capsys.readouterr().err


def test_a_megatron_prefix_on_s3_is_read_from_a_cached_copy(
    s3_bucket: str, s3_endpoint: dict, tmp_path: Path
) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_endpoint)
    url = f"{s3_bucket}/megatron/my_text_document"
    for suffix in (".bin", ".idx"):
        fs.put(str(MEGATRON / f"megatron_text_document{suffix}"), f"{url}{suffix}")
    model, cache = str(MEGATRON / "tokenizer.model"), str(tmp_path / "cache")
    assert verify_shard_set(url, s3_endpoint, model, "eos") == []
    folder, manifest = read_shard_set_manifest(url, s3_endpoint, model, "eos", cache)
    local = Path(folder) / "my_text_document.bin"
    assert local.read_bytes() == (MEGATRON / "megatron_text_document.bin").read_bytes()
    assert manifest.config["megatron_prefix"] == url and manifest.tokenizer.eod_id == EOS
    shard_set = open_shard_set(url, s3_endpoint, cache, model, "eos")
    theirs = IndexedDatasetReader(str(MEGATRON / "megatron_text_document"))
    assert shard_set.manifest.documents == theirs.num_documents
    # Read again from the copy; fetched again once the remote file changes.
    before = local.stat().st_mtime_ns
    read_shard_set_manifest(url, s3_endpoint, model, "eos", cache)
    assert local.stat().st_mtime_ns == before
    tokens = np.fromfile(MEGATRON / "megatron_text_document.bin", dtype=np.uint16)
    tokens[0] = 1
    fs.pipe(f"{url}.bin", tokens.tobytes())
    read_shard_set_manifest(url, s3_endpoint, model, "eos", cache)
    assert local.read_bytes() == tokens.tobytes()
    (problem,) = verify_shard_set(url, s3_endpoint)
    assert problem.startswith(f"{url}.idx: a Megatron-LM shard with no manifest.json")
