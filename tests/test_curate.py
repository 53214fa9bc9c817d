"""Curation (``megalith data curate``): each rule removes the document crafted to fail it
and keeps the rest, in input order; the counts reach the curation record, the shard
manifest and the MLflow lineage tags; the same inputs and seed give the same bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megalith.config import ConfigError, load_config
from pipelines.cli import main
from preprocessing.curate import curate_corpus
from preprocessing.manifest import read_manifest
from preprocessing.prepare import prepare_dataset
from preprocessing.tokenizer import load_tokenizer
from training.mlflow_store.runs import lineage_tags

TOKENIZER = Path(__file__).parent / "data" / "megatron_preprocess" / "tokenizer.model"
STOP = ["the", "be", "to", "of", "and", "that", "have", "with"]


def vocabulary(rng: random.Random, size: int, lengths: tuple[int, int]) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = {"".join(rng.choices(letters, k=rng.randint(*lengths))) for _ in range(size)}
    return sorted(words - set(STOP))


RNG = random.Random(7)
VOCAB = vocabulary(RNG, 3000, (4, 8))
LONG_WORDS = vocabulary(RNG, 100, (14, 16))


def prose(words: int, rng: random.Random = RNG) -> str:
    """Sentences of random words with stop words: passes every quality rule."""
    out: list[str] = []
    while len(out) < words:
        sentence = [
            rng.choice(STOP),
            *rng.sample(VOCAB, 2),
            rng.choice(STOP),
            *rng.sample(VOCAB, 3),
        ]
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out[:words])


ITEM = prose(20)  # an evaluation item's context
GOOD = [prose(300) for _ in range(4)]
PII = prose(80) + " Write to jane.doe@example.org or call 555-123-4567 from 10.1.2.3 today."

# (rule that removes it, text): in input order, each after the good document it copies.
CRAFTED = [
    (None, GOOD[0]),
    ("exact_duplicate", "  " + GOOD[0].upper().replace(" ", "   ") + "\n"),
    (None, GOOD[1]),
    ("near_duplicate", GOOD[1] + " and then some more"),
    ("word_count", "Too short to keep, with the few words it has."),
    ("mean_word_length", " ".join(RNG.choices(LONG_WORDS, k=60))),
    ("symbol_ratio", prose(80) + " #tag" * 20),
    ("bullet_lines", "\n".join("- " + prose(8) for _ in range(10))),
    ("ellipsis_lines", "\n".join(prose(15) + ("..." if i < 4 else "") for i in range(10))),
    ("alpha_words", prose(60) + " 1234" * 60),
    ("stop_words", " ".join(RNG.sample(VOCAB, 80))),
    ("duplicate_lines", "\n".join([prose(10)] * 5 + [prose(10) for _ in range(5)])),
    ("top_ngram", prose(60) + " red fox" * 20),
    ("duplicate_ngrams", " ".join([(p := prose(30)), p, prose(40)])),
    ("decontamination", " ".join([prose(60), ITEM, prose(20)])),
    (None, GOOD[2]),
    (None, PII),
    (None, GOOD[3]),
]
REMOVED = [rule for rule, _ in CRAFTED if rule]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("curate")
    lines = [json.dumps({"text": text}) for _, text in CRAFTED]
    lines.insert(3, '{"text": 5}')  # a bad record, skipped and counted
    (root / "raw.jsonl").write_text("\n".join(lines) + "\n")
    task = {"context": ITEM, "choices": [" yes", " no"], "answer": 0}
    (root / "task.jsonl").write_text(json.dumps(task) + "\n")
    return root


def curate(corpus: Path, output: str, *overrides: str, task_files=("task.jsonl",)):
    config = load_config(
        None,
        ["data.on_bad_record=skip", "data.curate.pii.enabled=true", "data.workers=1", *overrides],
        {"data.inputs": [str(corpus / "raw.jsonl")], "data.curate.output": output},
    )
    return curate_corpus(config.data, [str(corpus / t) for t in task_files], show_progress=False)


def kept_texts(output: Path) -> list[str]:
    return [json.loads(line)["text"] for line in (output / "part-00000.jsonl").open()]


def test_each_rule_removes_its_document_and_keeps_the_rest(corpus: Path) -> None:
    report = curate(corpus, str(corpus / "curated"))
    record = report.record
    redacted = PII.replace("jane.doe@example.org", "<email>").replace("555-123-4567", "<phone>")
    redacted = redacted.replace("10.1.2.3", "<ip>")
    assert kept_texts(corpus / "curated") == [GOOD[0], GOOD[1], GOOD[2], redacted, GOOD[3]]
    assert record.removed.counts == {rule: 1 for rule in REMOVED}
    # Each example is the crafted document of its rule (N: its number among valid records).
    where = {e["rule"]: int(e["location"].rsplit("#", 1)[1]) for e in record.removed.examples}
    assert where == {rule: i + 1 for i, (rule, _) in enumerate(CRAFTED) if rule}
    assert record.changed.counts == {"pii_email": 1, "pii_ip": 1, "pii_phone": 1}
    assert record.redactions == {"email": 1, "ip": 1, "phone": 1}
    # The same accounting as bad records: every valid document is kept or removed once.
    assert record.documents_in == len(CRAFTED) == record.documents_out + record.removed.total
    assert record.rejected.counts == {"not_a_string": 1}
    assert record.inputs[0].documents == len(CRAFTED) and record.inputs[0].rejected == 1

    # Each rule switches off: every valid document is kept, contamination only reported.
    off = curate(
        corpus,
        str(corpus / "off"),
        "data.curate.exact_dedup.enabled=false",
        "data.curate.near_dedup.enabled=false",
        "data.curate.quality.enabled=false",
        "data.curate.decontamination.action=report",
        "data.curate.pii.enabled=false",
    ).record
    assert kept_texts(corpus / "off") == [text for _, text in CRAFTED]
    assert off.removed.total == 0 and off.changed.total == 0
    assert off.flagged.counts == {"decontamination": 1}

    # A threshold moves a rule: 15 words are enough, so the short document stays.
    loose = curate(corpus, str(corpus / "loose"), "data.curate.quality.min_words=5").record
    assert "word_count" not in loose.removed.counts
    assert CRAFTED[4][1] in kept_texts(corpus / "loose")


def test_same_inputs_and_seed_give_the_same_bytes_and_a_rerun_reuses_them(corpus: Path) -> None:
    first = curate(corpus, str(corpus / "a"), "data.batch_documents=1")
    second = curate(corpus, str(corpus / "b"), "data.batch_documents=512")
    part = "part-00000.jsonl"
    assert (corpus / "a" / part).read_bytes() == (corpus / "b" / part).read_bytes()
    assert first.record.outputs == second.record.outputs
    again = curate(corpus, str(corpus / "a"), "data.batch_documents=1")
    assert again.reused and again.record == first.record
    # Another seed draws other permutations: its signatures, not the documents, change.
    other = curate(corpus, str(corpus / "c"), "data.curate.near_dedup.seed=99")
    assert not other.reused and kept_texts(corpus / "c") == kept_texts(corpus / "a")


def test_prepare_carries_the_curation_into_the_manifest_and_the_lineage(
    corpus: Path, capsys: pytest.CaptureFixture
) -> None:
    curated = corpus / "for-shards"
    code = main(
        [
            "data", "curate", "--quiet", "--input", str(corpus / "raw.jsonl"),
            "--output", str(curated), "--on-bad-record", "skip",
            "--decontaminate", str(corpus / "task.jsonl"),
        ]
    )  # fmt: skip
    assert code == 0
    assert "kept 5 of 18 documents" in capsys.readouterr().out
    config = load_config(
        None,
        [],
        {"data.inputs": [str(curated)], "data.output": str(corpus / "shards"), "data.workers": 1},
    )
    prepare_dataset(config.data, load_tokenizer(str(TOKENIZER)), show_progress=False)
    manifest = read_manifest(str(corpus / "shards"))
    assert manifest.documents == 5 and manifest.curation is not None
    assert manifest.curation.removed.counts == {rule: 1 for rule in REMOVED}
    assert manifest.curation.inputs[0].url == str(corpus / "raw.jsonl")
    assert manifest.rejected.counts == {"not_a_string": 1}  # met while curating
    tags = lineage_tags([str(corpus / "shards")])
    assert tags["megalith.data.curation.documents_in"] == "18"
    assert tags["megalith.data.curation.documents_out"] == "5"
    assert tags["megalith.data.curation.removed.near_duplicate"] == "1"
    assert json.loads(tags["megalith.data.curation.config"])["near_dedup"]["threshold"] == 0.8
    assert main(["data", "inspect", str(corpus / "shards")]) == 0
    assert "kept 5 of 18 documents" in capsys.readouterr().out
    assert main(["data", "verify", str(corpus / "shards")]) == 0  # the accounting adds up


def test_bad_settings_are_refused_naming_the_key(
    corpus: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = str(corpus / "raw.jsonl")
    for setting, expected in [
        ("data.curate.near_dedup.bands=4", "data.curate.near_dedup: Value error, set both"),
        ("data.curate.quality.min_word=3", "did you mean data.curate.quality.min_words?"),
        ("data.curate.quality.max_top_ngram={2: 1.5}", "data.curate.quality.max_top_ngram"),
        ("data.curate.decontamination.action=drop", "data.curate.decontamination.action"),
    ]:
        assert main(["data", "curate", "--input", raw, "--set", setting]) == 1
        assert expected in capsys.readouterr().err
    with pytest.raises(ConfigError, match="bands 20 x rows 10 = 200 exceeds num_perm 128"):
        load_config(None, ["data.curate.near_dedup.bands=20", "data.curate.near_dedup.rows=10"])
    missing = corpus / "absent.jsonl"
    assert main(["data", "curate", "--input", raw, "--output", str(corpus / "x"),
                 "--decontaminate", str(missing)]) == 1  # fmt: skip
    assert f"{missing}: cannot read the task file" in capsys.readouterr().err
    assert main(["data", "curate", "--input", raw, "--output", str(corpus / "x"),
                 "--decontaminate", "/dev/zero"]) == 1  # fmt: skip
    assert "/dev/zero: not a regular file" in capsys.readouterr().err


def test_curates_from_and_to_s3(corpus: Path, s3_bucket: str, s3_endpoint: dict) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3_endpoint)
    fs.put_file(str(corpus / "raw.jsonl"), f"{s3_bucket}/raw/raw.jsonl")
    config = load_config(
        None,
        ["data.on_bad_record=skip"],
        {
            "data.inputs": [f"{s3_bucket}/raw/"],
            "data.output": f"{s3_bucket}/shards",
            "data.storage_options": s3_endpoint,
        },
    )
    report = curate_corpus(config.data, [str(corpus / "task.jsonl")], show_progress=False)
    assert report.output == f"{s3_bucket}/shards/curated"
    remote = fs.cat_file(f"{s3_bucket}/shards/curated/part-00000.jsonl").decode()
    assert [json.loads(line)["text"] for line in remote.splitlines()][:2] == GOOD[:2]
    assert report.record.removed.total == len(REMOVED)
    assert curate_corpus(config.data, [str(corpus / "task.jsonl")], show_progress=False).reused
