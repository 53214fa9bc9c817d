"""The shipped sample corpus is exactly what the generator writes, and its facts hold."""

from __future__ import annotations

import json
from pathlib import Path

from preprocessing import corpus_generator

SHIPPED = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"


def test_shipped_corpus_matches_generator(tmp_path: Path) -> None:
    output = tmp_path / "stories.jsonl"
    corpus_generator.main(["--output", str(output), "--seed", "0"])
    assert output.read_bytes() == SHIPPED.read_bytes(), (
        "preprocessing/sample_corpus/stories.jsonl is stale: regenerate it with "
        "python -m preprocessing.corpus_generator --output "
        "preprocessing/sample_corpus/stories.jsonl --seed 0"
    )


def test_shipped_corpus_shape() -> None:
    records = [json.loads(line) for line in SHIPPED.read_text(encoding="utf-8").splitlines()]
    assert 2000 <= len(records) <= 4000
    assert SHIPPED.stat().st_size < 3 * 1024 * 1024
    assert len({r["id"] for r in records}) == len(records)
    assert all(set(r) == {"text", "id"} and r["text"].strip() for r in records)


def test_multiple_choice_answers_are_stated_in_the_corpus() -> None:
    text = SHIPPED.read_text(encoding="utf-8")
    items = corpus_generator.multiple_choice_items(seed=0)
    assert {item["kind"] for item in items} == {"capital", "color", "sound", "pet", "arithmetic"}
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == 4
        answer = item["choices"][item["answer"]]
        assert f"{item['query']} {answer}" in text
        for index, wrong in enumerate(item["choices"]):
            if index != item["answer"]:
                assert f"{item['query']} {wrong}" not in text, item
