"""``megalith data ...`` as a user runs it: real processes, exit codes and messages."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import main
from preprocessing import corpus_generator
from preprocessing.manifest import MANIFEST_NAME, read_manifest

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"
DOCUMENTS = 300


def megalith(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipelines.cli", *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def assert_clean_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1 with one ``error: ...`` message naming every fragment, and no traceback.

    Progress bars may come before it; a config error lists each problem on an indented
    line after it.
    """
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, result.stderr
    assert all(line.startswith("  ") for line in lines[starts[0] + 1 :]), result.stderr
    message = "\n".join(lines[starts[0] :])
    for fragment in fragments:
        assert fragment in message, (fragment, result.stderr)
    return message


@pytest.fixture(scope="module")
def texts() -> list[str]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:DOCUMENTS]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    """A working directory with a corpus whose text sits under "body", plus one bad record."""
    root = tmp_path_factory.mktemp("cli")
    lines = [json.dumps({"body": text}) for text in texts]
    lines.insert(7, '{"body": 17}')  # line 8: not a string
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer_model(work: Path) -> Path:
    result = megalith(
        "data",
        "train-tokenizer",
        "--input",
        "corpus.jsonl",
        "--json-key",
        "body",
        "--on-bad-record",
        "skip",
        "--output",
        "tok",
        "--vocab-size",
        "512",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    return work / "tok.model"


@pytest.fixture(scope="module")
def shards(work: Path, tokenizer_model: Path) -> Path:
    """`megalith data prepare` with every flag the issue names, relative paths, cwd=work."""
    result = megalith(
        "data",
        "prepare",
        "--input",
        "corpus.jsonl",
        "--output",
        "shards",
        "--tokenizer",
        "tok.model",
        "--workers",
        "2",
        "--shards",
        "2",
        "--json-key",
        "body",
        "--on-bad-record",
        "skip",
        "--quiet",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 2 shard(s), skipped 0 already complete" in result.stdout
    assert f"{DOCUMENTS:,} documents" in result.stdout
    assert "rejected 1 record(s): {'not_a_string': 1}" in result.stdout
    return work / "shards"


def damaged_copy(shards: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    return copy


# ---------------------------------------------------------------- help


def test_console_script_lists_data() -> None:
    script = Path(sys.executable).parent / "megalith"
    assert script.exists(), "the megalith console script is not installed"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "data" in result.stdout.split("positional arguments:")[1]


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("train-tokenizer", ["--input", "--output", "--vocab-size", "--model-type"]),
        (
            "prepare",
            [
                "--input",
                "--output",
                "--tokenizer",
                "--workers",
                "--shards",
                "--json-key",
                "--on-bad-record",
                "--config",
                "--set",
            ],
        ),
        ("curate", ["--input", "--output", "--decontaminate", "--redact-pii", "--set"]),
        ("inspect", ["PATH", "--decode"]),
        ("verify", ["PATH"]),
    ],
)
def test_subcommand_help(command: str, flags: list[str]) -> None:
    result = megalith("data", command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: megalith data {command}")
    for flag in flags:
        assert flag in result.stdout


def test_data_without_a_command_shows_its_commands(capsys: pytest.CaptureFixture) -> None:
    assert main(["data"]) == 2
    shown = capsys.readouterr().out
    for command in ("train-tokenizer", "curate", "prepare", "inspect", "verify"):
        assert command in shown


# ---------------------------------------------------------------- the happy path


def test_train_tokenizer(tokenizer_model: Path) -> None:
    from preprocessing.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_model))
    assert tokenizer.vocab_size == 512
    assert tokenizer.id == hashlib.sha256(tokenizer_model.read_bytes()).hexdigest()
    assert tokenizer_model.with_suffix(".vocab").exists()


def test_prepare_writes_a_verified_shard_set(shards: Path, tokenizer_model: Path) -> None:
    manifest = read_manifest(str(shards))
    assert manifest.documents == DOCUMENTS
    assert manifest.tokenizer.id == hashlib.sha256(tokenizer_model.read_bytes()).hexdigest()
    assert manifest.config["data"]["json_key"] == "body"
    assert manifest.config["data"]["workers"] == 2
    assert manifest.rejected.examples[0]["location"].endswith("corpus.jsonl:8")
    assert main(["data", "verify", str(shards)]) == 0


def test_prepare_rerun_skips_complete_shards(work: Path, shards: Path) -> None:
    result = megalith(
        "data",
        "prepare",
        "--input",
        "corpus.jsonl",
        "--output",
        "shards",
        "--tokenizer",
        "tok.model",
        "--json-key",
        "body",
        "--on-bad-record",
        "skip",
        "--workers",
        "1",
        "--shards",
        "2",
        "--quiet",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 0 shard(s), skipped 2 already complete" in result.stdout


def test_inspect_summarises_the_manifest(shards: Path) -> None:
    result = megalith("data", "inspect", shards)
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(str(shards))
    assert f"documents     {DOCUMENTS}" in result.stdout
    assert manifest.tokenizer.id[:16] in result.stdout
    assert "rejected      1" in result.stdout and "not_a_string" in result.stdout
    for shard in manifest.shards:
        assert f"{shard.name:<14}{shard.documents:>12,}{shard.tokens:>14,}" in result.stdout
    assert "--- document" not in result.stdout


def test_inspect_decode_shows_the_text(shards: Path, texts: list[str], tmp_path: Path) -> None:
    # From another directory: the relative tokenizer path used at prepare time still resolves.
    result = megalith("data", "inspect", shards, "--decode", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- document") == 3
    for text in texts[:3]:
        assert text[:400] in result.stdout


def test_inspect_decode_finds_the_tokenizer_beside_a_moved_set(
    work: Path, texts: list[str], tmp_path: Path
) -> None:
    """Without --tokenizer, prepare trains OUTPUT/tokenizer.model; the set can then move."""
    first = megalith(
        "data",
        "prepare",
        "--input",
        work / "corpus.jsonl",
        "--output",
        tmp_path / "own",
        "--json-key",
        "body",
        "--on-bad-record",
        "skip",
        "--set",
        "tokenizer.vocab_size=512",
        "--workers",
        "1",
    )
    assert first.returncode == 0, first.stderr
    # Without --quiet: progress bars with documents, tokens and throughput.
    progress = first.stderr.splitlines()[-1]
    assert "tokenizing: 100%" in progress
    assert f"docs={DOCUMENTS}" in progress and "tokens=" in progress and "B/s" in progress
    model = tmp_path / "own" / "tokenizer.model"
    assert read_manifest(str(tmp_path / "own")).tokenizer.id == (
        hashlib.sha256(model.read_bytes()).hexdigest()
    )
    moved = tmp_path / "moved"
    (tmp_path / "own").rename(moved)
    result = megalith("data", "inspect", moved, "--decode", "1")
    assert result.returncode == 0, result.stderr
    assert texts[0][:400] in result.stdout


def test_inspect_json_is_the_manifest(shards: Path) -> None:
    result = megalith("data", "inspect", shards, "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout) == json.loads((shards / MANIFEST_NAME).read_text())


def test_inspect_refuses_a_different_tokenizer(shards: Path, work: Path, tmp_path: Path):
    other = megalith(
        "data",
        "train-tokenizer",
        "--input",
        work / "corpus.jsonl",
        "--json-key",
        "body",
        "--on-bad-record",
        "skip",
        "--output",
        tmp_path / "other",
        "--vocab-size",
        "400",
    )
    assert other.returncode == 0, other.stderr
    result = megalith("data", "inspect", shards, "--decode", "1", "--tokenizer", "x")
    assert_clean_error(result, "tokenizer model not found: x")
    result = megalith(
        "data", "inspect", shards, "--decode", "1", "--tokenizer", tmp_path / "other.model"
    )
    assert_clean_error(result, "is not the one these shards were made with")


# ---------------------------------------------------------------- verify


def test_verify_passes(shards: Path) -> None:
    result = megalith("data", "verify", shards)
    assert result.returncode == 0, result.stderr
    assert "every file matches its manifest" in result.stdout


def test_verify_catches_one_flipped_byte(shards: Path, tmp_path: Path) -> None:
    copy = damaged_copy(shards, tmp_path)
    target = copy / "shard-00001.bin"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    result = megalith("data", "verify", copy)
    assert result.returncode == 1
    assert f"FAIL {target}: sha256" in result.stderr
    assert "1 problem(s)" in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_catches_a_deleted_shard(shards: Path, tmp_path: Path) -> None:
    copy = damaged_copy(shards, tmp_path)
    (copy / "shard-00000.bin").unlink()
    (copy / "shard-00000.idx").unlink()
    result = megalith("data", "verify", copy)
    assert result.returncode == 1
    assert f"FAIL {copy / 'shard-00000.bin'}: missing" in result.stderr
    assert f"FAIL {copy / 'shard-00000.idx'}: missing" in result.stderr


def test_verify_checks_every_shard_after_a_failure(shards: Path, tmp_path: Path) -> None:
    """A missing first shard must not hide a damaged index in the second."""
    from preprocessing.verify import verify_shard_set

    copy = damaged_copy(shards, tmp_path)
    (copy / "shard-00000.bin").unlink()
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["shards"][1]["documents"] += 1  # the index no longer agrees with the manifest
    manifest["documents"] += 1
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    problems = verify_shard_set(str(copy))
    assert len(problems) == 2
    assert "shard-00000.bin: missing" in problems[0]
    assert "shard-00001: holds" in problems[1]


def test_verify_without_a_manifest(tmp_path: Path) -> None:
    result = megalith("data", "verify", tmp_path)
    assert result.returncode == 1
    assert "manifest.json not found" in result.stderr


# ---------------------------------------------------------------- clear errors


def test_missing_input_is_a_clean_error(work: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = megalith(
        "data",
        "prepare",
        "--input",
        work / "corpus.jsonl",
        tmp_path / "absent.jsonl",
        "--output",
        out,
        "--tokenizer",
        work / "tok.model",
    )
    assert_clean_error(result, f"{tmp_path / 'absent.jsonl'}: no such file or directory")
    assert not out.exists()


def test_missing_input_without_tokenizer_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = megalith("data", "prepare", "--input", tmp_path / "nope/*.jsonl", "--output", out)
    assert_clean_error(result, "the pattern matches no files")
    assert not out.exists()


def test_bad_config_key_is_a_clean_error(tmp_path: Path) -> None:
    result = megalith("data", "prepare", "--set", "data.shardz=3", "--output", tmp_path / "o")
    assert_clean_error(result, "data.shardz: unknown key")


def test_bad_recipe_is_named(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("data:\n  shards: four\n  inputs: [x.jsonl]\n")
    result = megalith("data", "prepare", "--config", recipe)
    assert_clean_error(result, str(recipe), "data.shards", "'four'")


def test_bad_flag_value_names_the_key(tmp_path: Path) -> None:
    result = megalith("data", "prepare", "--input", "x", "--output", tmp_path, "--workers", "0")
    assert_clean_error(result, "data.workers", "greater than or equal to 1")


def test_bad_record_fails_naming_file_and_line(work: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = megalith(
        "data",
        "prepare",
        "--input",
        work / "corpus.jsonl",
        "--output",
        out,
        "--tokenizer",
        work / "tok.model",
        "--json-key",
        "body",
    )
    assert_clean_error(result, f"{work / 'corpus.jsonl'}:8:", "not a string", "skip")
    assert not (out / MANIFEST_NAME).exists()


def test_missing_tokenizer_is_a_clean_error(work: Path, tmp_path: Path) -> None:
    result = megalith(
        "data",
        "prepare",
        "--input",
        work / "corpus.jsonl",
        "--output",
        tmp_path / "out",
        "--tokenizer",
        tmp_path / "none.model",
    )
    assert_clean_error(result, "tokenizer model not found")


def test_inspect_of_a_broken_manifest_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert_clean_error(megalith("data", "inspect", tmp_path), "not valid JSON")
    (tmp_path / MANIFEST_NAME).write_text('{"format": "something-else"}')
    assert_clean_error(megalith("data", "inspect", tmp_path), "not a Megalith shard manifest")


def test_inspect_of_a_missing_set_is_a_clean_error(tmp_path: Path) -> None:
    assert_clean_error(megalith("data", "inspect", tmp_path / "nothing"), "not found")


# ---------------------------------------------------------------- the README's main job


def test_sample_recipe_runs(tmp_path: Path) -> None:
    """`megalith data prepare --config configs/sample-data.yaml`, pointed at a temp dir."""
    out = tmp_path / "sample-shards"
    result = megalith(
        "data",
        "prepare",
        "--config",
        "configs/sample-data.yaml",
        "--set",
        f"data.output={out}",
        "--workers",
        "2",
        "--quiet",
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(str(out))
    assert len(manifest.shards) == 4
    assert manifest.documents == 2250
    assert manifest.tokenizer.vocab_size == 2048
    assert (out / "tokenizer.model").exists()
    assert megalith("data", "verify", out).returncode == 0
