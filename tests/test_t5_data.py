"""T5 span-corruption data: sentinel tokens in the tokenizer and the span-corruption dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preprocessing.tokenizer import (
    TokenizerError,
    require_sentinels,
    sentinel_ids,
    train_tokenizer,
)
from training.config import TokenizerConfig

CORPUS = Path(__file__).resolve().parents[1] / "preprocessing" / "sample_corpus" / "stories.jsonl"


@pytest.fixture(scope="module")
def documents() -> list[str]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:200]
    return [json.loads(line)["text"] for line in lines]


# --- sentinel tokens ---------------------------------------------------------------------


def test_sentinels_are_user_defined_pieces_in_order(documents, tmp_path: Path) -> None:
    config = TokenizerConfig(vocab_size=400, sentinel_tokens=5)
    tokenizer = train_tokenizer(documents, config, str(tmp_path / "t5"))
    ids = sentinel_ids(tokenizer)
    assert [tokenizer.id_to_piece(i) for i in ids] == [f"<extra_id_{i}>" for i in range(5)]
    assert tokenizer.vocab_size == 400  # the sentinels count in the vocabulary size
    # Each sentinel is one token in text, never split into pieces.
    assert ids[3] in tokenizer.encode("a<extra_id_3>b")
    assert require_sentinels(tokenizer, 3) == ids[:3]
    with pytest.raises(TokenizerError, match=r"t5\.model: has 5 sentinel tokens .* needs 6"):
        require_sentinels(tokenizer, 6)
    plain = train_tokenizer(documents, TokenizerConfig(vocab_size=400), str(tmp_path / "plain"))
    assert sentinel_ids(plain) == []
    assert set(plain.special_ids) < set(tokenizer.special_ids)


def test_sentinels_clashing_with_special_tokens_are_refused(documents, tmp_path: Path) -> None:
    config = TokenizerConfig(
        vocab_size=400, sentinel_tokens=2, special_tokens=["<|eod|>", "<extra_id_1>"]
    )
    with pytest.raises(TokenizerError, match="extra_id_1"):
        train_tokenizer(documents, config, str(tmp_path / "clash"))
