"""The prepare stage end to end: text → shards → tokens → text, manifests, resume, s3."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megalith.config import DataConfig, TokenizerConfig
from preprocessing import corpus_generator
from preprocessing.engines import OrderedPool, WorkerError
from preprocessing.indexed_dataset import IndexedDatasetReader
from preprocessing.manifest import MANIFEST_NAME, Manifest, read_manifest
from preprocessing.prepare import PrepareReport, encode_job, prepare_dataset, shard_name
from preprocessing.readers import REJECT_REASONS, BadRecordError, InputError
from preprocessing.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

CORPUS = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"
SMALL_DOCUMENTS = 400
MEGATRON_MADE = Path(__file__).parent / "data" / "megatron_preprocess"


# ---------------------------------------------------------------- helpers


def prepare(
    tokenizer: Tokenizer,
    inputs: list,
    output: Path | str,
    tokenizer_config: TokenizerConfig | None = None,
    **settings,
) -> PrepareReport:
    settings = {"workers": 1, "shards": 3, **settings}
    data = DataConfig(inputs=[str(i) for i in inputs], output=str(output), **settings)
    return prepare_dataset(data, tokenizer, tokenizer_config, show_progress=False)


def documents_of(root: Path) -> list[np.ndarray]:
    """Every document's tokens, in manifest (= corpus) order."""
    manifest = read_manifest(str(root))
    documents = []
    for shard in manifest.shards:
        reader = IndexedDatasetReader(str(root / shard.name))
        documents += [np.array(reader[i]) for i in range(len(reader))]
    return documents


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every shard file in ``root``."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.glob("shard-*"))
        if path.suffix in (".bin", ".idx")
    }


def write_jsonl(path: Path, texts: list[str]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return path


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prepare")


@pytest.fixture(scope="module")
def tokenizer(texts: list[str], workdir: Path) -> Tokenizer:
    return train_tokenizer(texts, TokenizerConfig(vocab_size=1024), str(workdir / "tok"))


@pytest.fixture(scope="module")
def small_corpus(texts: list[str], workdir: Path) -> Path:
    return write_jsonl(workdir / "small.jsonl", texts[:SMALL_DOCUMENTS])


@pytest.fixture(scope="module")
def full_set(tokenizer: Tokenizer, workdir: Path) -> tuple[Path, PrepareReport]:
    """The whole sample corpus in 4 shards, 2 workers, EOD appended."""
    root = workdir / "full"
    settings = TokenizerConfig(vocab_size=1024, model=tokenizer.model_path)
    report = prepare(tokenizer, [CORPUS], root, settings, workers=2, shards=4)
    return root, report


@pytest.fixture(scope="module")
def small_set(tokenizer: Tokenizer, small_corpus: Path, workdir: Path) -> Path:
    root = workdir / "small"
    prepare(tokenizer, [small_corpus], root)
    return root


# ---------------------------------------------------------------- round trip


def test_round_trip_with_eod(full_set, tokenizer: Tokenizer, texts: list[str]) -> None:
    root, report = full_set
    documents = documents_of(root)
    assert len(documents) == len(texts) == report.manifest.documents
    for tokens, text in zip(documents, texts, strict=True):
        assert tokens[-1] == tokenizer.eod_id
        assert tokenizer.eod_id not in tokens[:-1]
        assert tokenizer.decode(tokens[:-1]) == text
    assert sum(map(len, documents)) == report.manifest.tokens


def test_round_trip_without_eod(
    small_set: Path, tokenizer: Tokenizer, small_corpus: Path, texts: list[str], tmp_path: Path
) -> None:
    # Start from the set made with EOD: the changed setting invalidates every shard.
    shutil.copytree(small_set, tmp_path, dirs_exist_ok=True)
    report = prepare(tokenizer, [small_corpus], tmp_path, append_eod=False, workers=2)
    assert report.skipped == [] and len(report.written) == 3
    assert report.manifest.append_eod is False
    plain = documents_of(tmp_path)
    assert [tokenizer.decode(tokens) for tokens in plain] == texts[:SMALL_DOCUMENTS]
    assert not any(tokenizer.eod_id in tokens for tokens in plain)
    # With EOD, each document is the same tokens plus exactly one EOD.
    with_eod = documents_of(small_set)
    assert len(plain) == len(with_eod)
    for a, b in zip(plain, with_eod, strict=True):
        assert np.array_equal(b, np.append(a, tokenizer.eod_id))


def test_eod_eos_appends_the_tokenizers_eos_like_megatron(
    small_set: Path, tokenizer: Tokenizer, small_corpus: Path, tmp_path: Path
) -> None:
    # Same tokenizer, `eod: eos`: every shard is rewritten with </s> where <|eod|> was.
    shutil.copytree(small_set, tmp_path, dirs_exist_ok=True)
    report = prepare(tokenizer, [small_corpus], tmp_path, eod="eos")
    eos_id = tokenizer.eos_id
    assert eos_id != tokenizer.eod_id and len(report.written) == 3
    assert report.manifest.tokenizer.eod_id == eos_id
    for a, b in zip(documents_of(small_set), documents_of(tmp_path), strict=True):
        assert a[-1] == tokenizer.eod_id and np.array_equal(b, np.append(a[:-1], eos_id))


def test_eod_eos_shards_are_byte_identical_to_megatrons_preprocess_data(tmp_path: Path) -> None:
    # megatron_text_document.* were written by Megatron-LM's own tools/preprocess_data.py
    # (--append-eod, GPTSentencePieceTokenizer) from the same corpus and model: make_shards.py.
    tokenizer = load_tokenizer(str(MEGATRON_MADE / "tokenizer.model"), 64)
    report = prepare(tokenizer, [MEGATRON_MADE / "corpus.jsonl"], tmp_path, shards=1, eod="eos")
    (ours,) = report.manifest.shards
    for suffix in (".bin", ".idx"):
        theirs = (MEGATRON_MADE / f"megatron_text_document{suffix}").read_bytes()
        assert (tmp_path / f"{ours.name}{suffix}").read_bytes() == theirs, suffix


def test_megatron_core_reads_prepared_shards(full_set, tokenizer: Tokenizer) -> None:
    megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    root, report = full_set
    shard = report.manifest.shards[1]
    ours = IndexedDatasetReader(str(root / shard.name))
    theirs = megatron_indexed.IndexedDataset(str(root / shard.name))
    assert len(theirs) == shard.documents
    assert theirs.index.dtype == np.uint16
    for i in (0, 1, len(theirs) // 2, len(theirs) - 1):
        assert np.array_equal(theirs[i], ours[i])
        assert theirs[i][-1] == tokenizer.eod_id


def test_shards_hold_roughly_equal_tokens(full_set) -> None:
    root, report = full_set
    shards = report.manifest.shards
    assert [s.name for s in shards] == [shard_name(i) for i in range(4)]
    tokens = [s.tokens for s in shards]
    assert max(tokens) / min(tokens) < 1.05, tokens
    assert sum(s.documents for s in shards) == report.manifest.documents
    assert report.written == [s.name for s in shards]
    assert report.skipped == [] and report.empty == []


def test_more_shards_than_documents(tokenizer: Tokenizer, texts: list[str], tmp_path: Path):
    corpus = write_jsonl(tmp_path / "three.jsonl", texts[:3])
    out = tmp_path / "out"
    report = prepare(tokenizer, [corpus], out, shards=5)
    names = [s.name for s in report.manifest.shards]
    assert len(names) == 3 and report.manifest.documents == 3
    assert sorted(names + report.empty) == [shard_name(i) for i in range(5)]
    assert [tokenizer.decode(d[:-1]) for d in documents_of(out)] == texts[:3]
    # A rerun knows the empty shards are done: it reads nothing and writes nothing.
    again = prepare(tokenizer, [corpus], out, shards=5)
    assert again.written == [] and again.skipped == names and again.empty == report.empty
    assert again.tokenized_bytes == 0


# ---------------------------------------------------------------- dtype


def test_dtype_follows_vocabulary(
    small_set: Path, tokenizer: Tokenizer, small_corpus: Path, workdir: Path, tmp_path: Path
) -> None:
    assert read_manifest(str(small_set)).dtype == "uint16"
    # Padding the vocabulary past 65,500 ids makes int32 necessary.
    wide = load_tokenizer(str(workdir / "tok.model"), pad_vocab_multiple=65536)
    assert wide.id == tokenizer.id and wide.padded_vocab_size == 65536
    report = prepare(wide, [small_corpus], tmp_path)
    assert report.manifest.dtype == "int32"
    for shard in report.manifest.shards:
        narrow_idx = (small_set / f"{shard.name}.idx").read_bytes()
        wide_idx = (tmp_path / f"{shard.name}.idx").read_bytes()
        assert narrow_idx[17] == 8 and wide_idx[17] == 4  # Megatron's dtype codes
        wide_bin = (tmp_path / f"{shard.name}.bin").stat().st_size
        assert wide_bin == 2 * (small_set / f"{shard.name}.bin").stat().st_size
    narrow_docs, wide_docs = documents_of(small_set), documents_of(tmp_path)
    assert wide_docs[0].dtype == np.int32 and narrow_docs[0].dtype == np.uint16
    assert all(np.array_equal(a, b) for a, b in zip(narrow_docs, wide_docs, strict=True))


# ---------------------------------------------------------------- workers


def test_byte_identical_for_any_worker_count(full_set, tokenizer: Tokenizer, tmp_path: Path):
    root, report = full_set  # 2 workers, batches of 512 documents
    one = prepare(tokenizer, [CORPUS], tmp_path, workers=1, shards=4, batch_documents=64)
    assert one.manifest.shards == report.manifest.shards
    digests = file_digests(tmp_path)
    assert len(digests) == 8
    assert digests == file_digests(root)


def test_dead_worker_fails_the_run(tokenizer: Tokenizer, texts: list[str]) -> None:
    """A worker killed mid-batch (as the OOM killer does) must fail the run, not hang it."""
    pool = OrderedPool(1, encode_job, tokenizer)
    try:
        # About 10 s of encoding on one core, so the kill lands mid-batch.
        job = (0, texts * 12, tokenizer.eod_id, "uint16", False)
        assert list(pool.submit(job)) == []
        time.sleep(0.5)
        for pid in list(pool.pool._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="worker process died"):
            list(pool.drain())
    finally:
        pool.close()


UNGUARDED_SCRIPT = """
import sys
from megalith.config import DataConfig
from preprocessing.prepare import prepare_dataset
from preprocessing.tokenizer import load_tokenizer

corpus, output, tokenizer = sys.argv[1:]
prepare_dataset(DataConfig(inputs=[corpus], output=output, workers=2), load_tokenizer(tokenizer))
"""


def test_a_script_that_prepares_at_import_is_told_to_guard_it(
    tokenizer: Tokenizer, small_corpus: Path, tmp_path: Path
) -> None:
    """Run from a user's script without a ``__main__`` guard, the spawned workers import
    the script again and die starting; the error names the script and the guard (and
    leaves no output looking complete)."""
    script = tmp_path / "prepare_my_data.py"
    script.write_text(UNGUARDED_SCRIPT)
    output = tmp_path / "shards"
    command = [sys.executable, str(script), str(small_corpus), str(output), tokenizer.model_path]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    assert "WorkerError" in last_line and str(script) in last_line, last_line
    assert 'if __name__ == "__main__":' in last_line, last_line
    # Each worker fails before making a pool of its own, so none dies holding the pool's
    # semaphores and Python's resource tracker has nothing to warn about after the error.
    assert "was asked to start a pool of its own" in done.stderr
    assert "resource_tracker" not in done.stderr, done.stderr[-2000:]
    assert not (output / MANIFEST_NAME).exists()


# ---------------------------------------------------------------- bad records


BAD_LINES = {
    "malformed_json": b'{"text": "unterminated\n',
    "missing_field": b'{"body": "no text field"}\n',
    "not_a_string": b'{"text": 42}\n',
    "invalid_utf8": b'{"text": "caf\xe9"}\n',
    "empty_text": b'{"text": "   "}\n',
}


@pytest.fixture
def dirty_corpus(texts: list[str], tmp_path: Path) -> tuple[Path, list[str], dict[str, int]]:
    """Good documents with one bad record of every reason; returns the line of each."""
    path = tmp_path / "dirty.jsonl"
    good = texts[:60]
    lines, where = [], {}
    for i, text in enumerate(good):
        lines.append(json.dumps({"text": text}).encode() + b"\n")
        if i % 10 == 5 and len(where) < len(BAD_LINES):
            reason = list(BAD_LINES)[len(where)]
            lines.append(BAD_LINES[reason])
            where[reason] = len(lines)
    path.write_bytes(b"".join(lines))
    assert set(where) == set(REJECT_REASONS)
    return path, good, where


def test_skip_counts_every_reason_in_the_manifest(
    dirty_corpus, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path, good, where = dirty_corpus
    out = tmp_path / "out"
    report = prepare(tokenizer, [path], out, on_bad_record="skip", max_bad_examples=3)
    manifest = read_manifest(str(out))
    assert manifest.rejected.total == len(REJECT_REASONS)
    assert manifest.rejected.counts == {reason: 1 for reason in REJECT_REASONS}
    assert manifest.inputs[0].rejected == len(REJECT_REASONS)
    assert manifest.inputs[0].documents == len(good) == manifest.documents
    # Up to max_bad_examples examples, in file order, each with file:line.
    first = sorted(where.items(), key=lambda item: item[1])[:3]
    assert [(e["reason"], e["location"]) for e in manifest.rejected.examples] == [
        (reason, f"{path}:{line}") for reason, line in first
    ]
    assert [tokenizer.decode(d[:-1]) for d in documents_of(out)] == good
    assert report.manifest == manifest

    # A rerun asking for more examples gets them, without redoing the shards.
    again = prepare(tokenizer, [path], out, on_bad_record="skip", max_bad_examples=5)
    assert len(again.manifest.rejected.examples) == 5
    assert again.written == [] and len(again.skipped) == 3


def test_fail_names_file_and_line_and_leaves_no_manifest(
    dirty_corpus, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path, _, where = dirty_corpus
    out = tmp_path / "out"
    with pytest.raises(BadRecordError) as caught:
        prepare(tokenizer, [path], out, on_bad_record="fail")
    first_reason, first_line = min(where.items(), key=lambda item: item[1])
    assert f"{path}:{first_line}:" in str(caught.value)
    assert first_reason == "malformed_json" and "malformed JSON" in str(caught.value)
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.glob("shard-*"))


def test_missing_input_fails_before_any_output(
    tokenizer: Tokenizer, small_corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(InputError, match=f"{missing}: no such file"):
        prepare(tokenizer, [small_corpus, missing], out)
    assert not out.exists()


def test_unreadable_input_fails_before_any_output(
    tokenizer: Tokenizer, small_corpus: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"this is not gzip data")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="cannot read input"):
        prepare(tokenizer, [small_corpus, broken], out)
    assert not out.exists()


# ---------------------------------------------------------------- manifest


def test_manifest_contents(full_set, tokenizer: Tokenizer, workdir: Path) -> None:
    root, report = full_set
    manifest = read_manifest(str(root))
    assert manifest == report.manifest
    raw = json.loads((root / MANIFEST_NAME).read_text())
    assert Manifest.model_validate(raw) == manifest
    assert raw["format"] == "megalith-shards" and raw["version"] == 1

    model_file = workdir / "tok.model"
    assert manifest.tokenizer.id == hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert Path(manifest.tokenizer.path) == model_file.resolve()
    assert manifest.tokenizer.vocab_size == tokenizer.vocab_size == 1024
    assert manifest.tokenizer.padded_vocab_size == 1024
    assert manifest.tokenizer.eod_id == tokenizer.eod_id
    assert manifest.tokenizer.pad_id == tokenizer.special_ids["<|pad|>"]
    assert manifest.dtype == "uint16" and manifest.append_eod is True

    for shard in manifest.shards:
        assert set(shard.files) == {f"{shard.name}.bin", f"{shard.name}.idx"}
        for name, info in shard.files.items():
            data = (root / name).read_bytes()
            assert info.sha256 == hashlib.sha256(data).hexdigest()
            assert info.bytes == len(data)
        reader = IndexedDatasetReader(str(root / shard.name))
        assert (reader.num_documents, reader.num_tokens) == (shard.documents, shard.tokens)
    assert manifest.documents == sum(s.documents for s in manifest.shards) == 2250
    assert manifest.tokens == sum(s.tokens for s in manifest.shards)

    assert [(i.url, i.bytes, i.documents, i.rejected) for i in manifest.inputs] == [
        (str(CORPUS), CORPUS.stat().st_size, 2250, 0)
    ]
    assert manifest.rejected.total == 0 and manifest.rejected.examples == []
    data = DataConfig(inputs=[str(CORPUS)], output=str(root), workers=2, shards=4)
    settings = TokenizerConfig(vocab_size=1024, model=tokenizer.model_path)
    assert manifest.config == {
        "data": data.model_dump(mode="json", exclude={"engine", "ray_address"}),
        "tokenizer": settings.model_dump(mode="json"),
    }


# ---------------------------------------------------------------- resume


def test_resume_redoes_only_damaged_shards(
    small_set: Path, tokenizer: Tokenizer, small_corpus: Path, tmp_path: Path
) -> None:
    clean = file_digests(small_set)
    out = tmp_path / "resume"
    shutil.copytree(small_set, out)
    state = out / ".prepare"

    def rerun() -> PrepareReport:
        report = prepare(tokenizer, [small_corpus], out)
        assert file_digests(out) == clean
        assert read_manifest(str(out)).shards == report.manifest.shards
        return report

    everything = [shard_name(i) for i in range(3)]

    # A deleted shard and its marker.
    (out / "shard-00001.bin").unlink()
    (state / "shard-00001.json").unlink()
    report = rerun()
    assert report.written == ["shard-00001"]
    assert report.skipped == ["shard-00000", "shard-00002"]

    # A corrupted shard whose marker is still there: the hash check catches it.
    with (out / "shard-00000.bin").open("r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    report = rerun()
    assert report.written == ["shard-00000"]
    assert report.skipped == ["shard-00001", "shard-00002"]

    # A truncated index, its marker gone as after a crash between rename and marker.
    (out / "shard-00002.idx").write_bytes(b"MMIDIDX")
    (state / "shard-00002.json").unlink()
    report = rerun()
    assert report.written == ["shard-00002"]

    # Nothing to do: nothing is read or written.
    report = rerun()
    assert report.written == [] and report.skipped == everything
    assert report.tokenized_bytes == 0


def test_missing_input_on_rerun_leaves_the_set_alone(
    small_set: Path, tokenizer: Tokenizer, small_corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(small_set, out)
    before = file_digests(out)
    with pytest.raises(InputError, match="gone.jsonl"):
        prepare(tokenizer, [small_corpus, tmp_path / "gone.jsonl"], out)
    assert (out / MANIFEST_NAME).read_bytes() == (small_set / MANIFEST_NAME).read_bytes()
    assert file_digests(out) == before


@pytest.mark.slow
def test_crash_and_resume_is_byte_identical(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """SIGKILL a real `megalith data prepare` mid-run, rerun it, compare with a clean run."""
    big = tmp_path / "big.jsonl"
    sample = CORPUS.read_bytes()
    big.write_bytes(sample * 5)
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "data",
        "prepare",
        "--input",
        str(big),
        "--tokenizer",
        tokenizer.model_path,
        "--workers",
        "2",
        "--shards",
        "5",
        "--quiet",
        "--output",
    ]
    crashed = tmp_path / "crashed"
    process = subprocess.Popen(
        [*command, str(crashed)],
        start_new_session=True,  # its own process group: the kill takes the workers too
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    markers = crashed / ".prepare"
    try:
        deadline = time.monotonic() + 120
        while not list(markers.glob("shard-*.json")):
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "no shard finished in time"
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    finished = sorted(p.stem for p in markers.glob("shard-*.json"))
    assert 1 <= len(finished) < 5, finished
    assert not (crashed / MANIFEST_NAME).exists()

    resumed = subprocess.run([*command, str(crashed)], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipped {len(finished)} already complete" in resumed.stdout
    assert f"wrote {5 - len(finished)} shard(s)" in resumed.stdout

    clean = tmp_path / "clean"
    subprocess.run([*command, str(clean)], check=True, capture_output=True)
    assert file_digests(crashed) == file_digests(clean)
    assert len(file_digests(clean)) == 10
    resumed_manifest, clean_manifest = read_manifest(str(crashed)), read_manifest(str(clean))
    assert resumed_manifest.shards == clean_manifest.shards
    assert resumed_manifest.documents == 5 * 2250


# ---------------------------------------------------------------- s3


def test_s3_input_and_output(
    s3_endpoint: dict,
    s3_bucket: str,
    small_set: Path,
    small_corpus: Path,
    tokenizer: Tokenizer,
    texts: list[str],
    tmp_path: Path,
) -> None:
    import s3fs

    from training.data import build_gpt_datasets

    fs = s3fs.S3FileSystem(**s3_endpoint)
    fs.put_file(str(small_corpus), f"{s3_bucket}/raw/part-0.jsonl")
    root = f"{s3_bucket}/shards/v1"
    settings = {"storage_options": s3_endpoint, "workers": 2}

    report = prepare(tokenizer, [f"{s3_bucket}/raw/*.jsonl"], root, **settings)
    assert report.output == root
    assert report.manifest.inputs[0].url == f"{s3_bucket}/raw/part-0.jsonl"
    assert report.manifest.inputs[0].bytes == small_corpus.stat().st_size
    # The same text gives the same bytes wherever it is read from and written to.
    local = file_digests(small_set)
    remote = {name: hashlib.sha256(fs.cat_file(f"{root}/{name}")).hexdigest() for name in local}
    assert remote == local
    assert fs.exists(f"{root}/{MANIFEST_NAME}")

    again = prepare(tokenizer, [f"{s3_bucket}/raw/*.jsonl"], root, **settings)
    assert again.written == [] and again.skipped == [shard_name(i) for i in range(3)]

    verify = [sys.executable, "-m", "pipelines.cli", "data", "verify", root]
    ok = subprocess.run(verify, capture_output=True, text=True)  # endpoint from AWS_ENDPOINT_URL
    assert ok.returncode == 0, ok.stderr
    assert "every file matches its manifest" in ok.stdout
    inspect = [sys.executable, "-m", "pipelines.cli", "data", "inspect", root, "--decode", "2"]
    shown = subprocess.run(inspect, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert f"documents     {SMALL_DOCUMENTS}" in shown.stdout
    for text in texts[:2]:
        assert text[:300] in shown.stdout

    # Training reads the shards through the manifest, downloading and checking each file;
    # it sees exactly the samples the local copy gives.
    split = (0.9, 0.05, 0.05)
    remote_data = DataConfig(
        output=root,
        storage_options=s3_endpoint,
        cache_dir=str(tmp_path / "cache-remote"),
        seq_length=64,
        split=split,
    )
    local_data = DataConfig(
        output=str(small_set), cache_dir=str(tmp_path / "cache-local"), seq_length=64, split=split
    )
    counts = (50, 5, 5)
    remote_sets = build_gpt_datasets(remote_data, counts)
    local_sets = build_gpt_datasets(local_data, counts)
    for remote_set, local_set, count in zip(remote_sets, local_sets, counts, strict=True):
        assert len(remote_set) == count
        for index in range(count):
            tokens = remote_set[index]["tokens"]
            assert tokens.shape == (65,)
            assert tokens.equal(local_set[index]["tokens"])
    assert int(remote_sets[0][0]["tokens"].max()) < tokenizer.vocab_size

    # A changed object fails verification, naming it.
    fs.pipe_file(f"{root}/shard-00001.bin", b"\x00" * local_size(small_set, "shard-00001.bin"))
    bad = subprocess.run(verify, capture_output=True, text=True)
    assert bad.returncode == 1
    assert f"{root}/shard-00001.bin" in bad.stderr


def local_size(root: Path, name: str) -> int:
    return (root / name).stat().st_size


def test_failed_s3_run_leaves_no_local_staging(
    s3_endpoint: dict,
    s3_bucket: str,
    dirty_corpus,
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shards bound for s3:// are staged in a local temp dir; a failure must not leak it."""
    import tempfile

    staging_root = tmp_path / "tmp"
    staging_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging_root))
    path, _, _ = dirty_corpus
    with pytest.raises(BadRecordError):
        prepare(tokenizer, [path], f"{s3_bucket}/out", storage_options=s3_endpoint)
    assert list(staging_root.iterdir()) == []
