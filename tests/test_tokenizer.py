"""SentencePiece training and loading on the shipped sample corpus."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from megalith.config import DEFAULT_SPECIAL_TOKENS, TokenizerConfig
from megalith.errors import MegalithError
from preprocessing import corpus_generator
from preprocessing.tokenizer import (
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    padded_vocab_size,
    sample_documents,
    split_for_training,
    train_tokenizer,
)

CORPUS = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"
UNSEEN = "Émoji 🦙🚀, 中文字符 and ÅÄÖ — “quotes”\ttab\n\nnew  line  "


@pytest.fixture(scope="module")
def documents() -> list[str]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


def config(**overrides: Any) -> TokenizerConfig:
    return TokenizerConfig(**{"vocab_size": 1000, **overrides})


@pytest.fixture(scope="module")
def trained(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        kind: train_tokenizer(documents, config(model_type=kind), str(root / kind))
        for kind in ("bpe", "unigram")
    }


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_trains_and_writes_model_and_vocab(trained: dict[str, Tokenizer], kind: str) -> None:
    tokenizer = trained[kind]
    model = Path(tokenizer.model_path)
    assert model.name == f"{kind}.model"
    assert model.read_bytes() == tokenizer.model_bytes
    vocab = model.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == tokenizer.vocab_size == 1000
    assert vocab[3].split("\t")[0] == "<|eod|>"
    assert len(tokenizer.id) == 64
    assert not list(model.parent.glob("*.tmp"))


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_special_tokens_are_single_ids(trained: dict[str, Tokenizer], kind: str) -> None:
    tokenizer = trained[kind]
    assert list(tokenizer.special_ids)[:3] == ["<unk>", "<s>", "</s>"]
    for token in DEFAULT_SPECIAL_TOKENS:
        token_id = tokenizer.special_ids[token]
        text = f"Mira{token}Ben"
        ids = tokenizer.encode(text)
        pieces = [tokenizer.id_to_piece(i) for i in ids]
        assert ids.count(token_id) == 1
        assert [p for p in pieces if "|" in p] == [token]  # never split into fragments
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode([token_id]) == token
        # At the very start SentencePiece's dummy prefix adds a "▁" piece first.
        assert tokenizer.encode(token)[-1] == token_id
    assert tokenizer.eod_id == tokenizer.special_ids["<|eod|>"]
    assert tokenizer.pad_id == tokenizer.special_ids["<|pad|>"]
    text = "<|user|>What is the capital of Valdoria?<|end|><|assistant|>Mirelle.<|eod|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.eod_id) == 1


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_byte_fallback_round_trips_unseen_text(trained: dict[str, Tokenizer], kind: str) -> None:
    tokenizer = trained[kind]
    ids = tokenizer.encode(UNSEEN)
    assert tokenizer.decode(ids) == UNSEEN
    assert 0 not in ids  # no <unk>
    assert any(tokenizer.id_to_piece(i).startswith("<0x") for i in ids)


def test_corpus_documents_round_trip_exactly(
    trained: dict[str, Tokenizer], documents: list[str]
) -> None:
    tokenizer = trained["bpe"]
    batch = tokenizer.encode_batch(documents[:200])
    assert batch == [tokenizer.encode(text) for text in documents[:200]]
    assert [tokenizer.decode(ids) for ids in batch] == documents[:200]
    # Learned pieces, not bytes: the corpus compresses to well under one token per 2 bytes.
    assert sum(map(len, batch)) < sum(len(t.encode()) for t in documents[:200]) / 2


def test_without_byte_fallback_unseen_characters_become_unk(
    documents: list[str], tmp_path: Path
) -> None:
    tokenizer = train_tokenizer(
        documents[:300], config(vocab_size=400, byte_fallback=False), str(tmp_path / "t")
    )
    assert 0 in tokenizer.encode("🦙")


def test_padded_vocab_size() -> None:
    assert padded_vocab_size(1000, 128) == 1024
    assert padded_vocab_size(1024, 128) == 1024
    assert padded_vocab_size(1025, 128) == 1152
    assert padded_vocab_size(1000, 1) == 1000
    with pytest.raises(ValueError):
        padded_vocab_size(1000, 0)


def test_padded_vocab_size_follows_config(trained: dict[str, Tokenizer]) -> None:
    assert trained["bpe"].padded_vocab_size == 1024
    again = load_tokenizer(trained["bpe"].model_path, pad_vocab_multiple=48)
    assert again.padded_vocab_size == 1008


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_training_is_deterministic(
    trained: dict[str, Tokenizer], documents: list[str], tmp_path: Path, kind: str
) -> None:
    again = train_tokenizer(documents, config(model_type=kind), str(tmp_path / "again"))
    assert again.id == trained[kind].id
    assert (tmp_path / "again.model").read_bytes() == trained[kind].model_bytes
    assert (tmp_path / "again.vocab").read_bytes() == Path(trained[kind].model_path).with_suffix(
        ".vocab"
    ).read_bytes()


def test_settings_change_the_id(
    trained: dict[str, Tokenizer], documents: list[str], tmp_path: Path
) -> None:
    assert trained["bpe"].id != trained["unigram"].id
    smaller = train_tokenizer(documents, config(vocab_size=900), str(tmp_path / "smaller"))
    assert smaller.id != trained["bpe"].id


def test_load_existing_model(trained: dict[str, Tokenizer]) -> None:
    original = trained["unigram"]
    loaded = load_tokenizer(original.model_path)
    assert loaded == original
    assert loaded.encode("Mira has a dog named Biscuit.") == original.encode(
        "Mira has a dog named Biscuit."
    )


def test_a_path_object_loads_like_its_string(trained: dict[str, Tokenizer]) -> None:
    original = trained["unigram"]  # load_model_package hands back pathlib paths
    assert load_tokenizer(Path(original.model_path)) == original


def test_copies_carry_a_working_processor(trained: dict[str, Tokenizer]) -> None:
    clone = copy.deepcopy(trained["bpe"])
    assert clone == trained["bpe"]
    assert clone.encode("The cow says moo.") == trained["bpe"].encode("The cow says moo.")
    assert "model_bytes" not in repr(clone)


def test_fsspec_url_round_trip(documents: list[str]) -> None:
    prefix = "memory://megalith-test/tok/spm"
    tokenizer = train_tokenizer(documents[:400], config(vocab_size=600), prefix)
    assert tokenizer.model_path == f"{prefix}.model"
    loaded = load_tokenizer(f"{prefix}.model")
    assert loaded.id == tokenizer.id


def test_s3_round_trip(documents: list[str], s3_bucket: str, s3_endpoint: dict[str, Any]) -> None:
    prefix = f"{s3_bucket}/tokenizer/spm"
    tokenizer = train_tokenizer(documents[:400], config(vocab_size=600), prefix, s3_endpoint)
    loaded = load_tokenizer(f"{prefix}.model", storage_options=s3_endpoint)
    assert loaded.id == tokenizer.id
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(f"{s3_bucket}/missing.model", storage_options=s3_endpoint)


def test_sample_documents_is_a_deterministic_capped_reservoir() -> None:
    texts = [f"document {i}" for i in range(1000)]
    sample = sample_documents(iter(texts), 50, seed=7)
    assert len(sample) == 50
    assert sample == sample_documents(texts, 50, seed=7)
    assert sample != sample_documents(texts, 50, seed=8)
    assert sample == sorted(sample, key=texts.index)  # corpus order kept
    assert any(int(t.split()[1]) >= 500 for t in sample)  # not just the head
    assert sample_documents(texts[:30], 50, seed=7) == texts[:30]
    with pytest.raises(ValueError):
        sample_documents(texts, 0, seed=7)


def test_training_uses_only_the_capped_sample(documents: list[str], tmp_path: Path) -> None:
    settings = config(vocab_size=600, max_training_documents=300, seed=3)
    capped = train_tokenizer(documents, settings, str(tmp_path / "capped"))
    sample = sample_documents(documents, 300, seed=3)
    direct = train_tokenizer(sample, settings, str(tmp_path / "direct"))
    assert capped.id == direct.id


def test_long_lines_are_split_for_training() -> None:
    line = " ".join(["naïve"] * 2000) + " " + "x" * 100
    pieces = list(split_for_training(f"short line\n\n{line}\n", 64))
    assert pieces[0] == "short line"
    assert all(len(p.encode("utf-8")) <= 64 for p in pieces)
    assert "".join(pieces[1:]) == line


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.model"
    with pytest.raises(MegalithError, match=str(missing)):
        load_tokenizer(str(missing))


def test_non_model_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a protobuf \x00\xff")
    with pytest.raises(TokenizerError, match=f"{bad}: not a SentencePiece model"):
        load_tokenizer(str(bad))
    with pytest.raises(MegalithError, match="not a regular file"):
        load_tokenizer(str(tmp_path))


def test_a_model_only_sentencepiece_accepts_is_a_clear_error(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    # Found by the reader fuzz: SentencePiece's parser loads these bytes, protobuf's does not.
    bad = tmp_path / "prefixed.model"
    prefix = bytes.fromhex("e80000dd000000000099808080100000000000000000")
    bad.write_bytes(prefix + trained["bpe"].model_bytes)
    with pytest.raises(TokenizerError, match=f"{bad}: not a SentencePiece model file"):
        load_tokenizer(str(bad))


def test_vocab_too_large_suggests_smaller(documents: list[str], tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"too large.*--vocab-size \(at most \d+\)"):
        train_tokenizer(documents[:20], config(vocab_size=20000), str(tmp_path / "big"))
    assert not (tmp_path / "big.model").exists()


def test_duplicate_special_tokens_are_rejected(documents: list[str], tmp_path: Path) -> None:
    settings = config(special_tokens=["<|eod|>", "<|eod|>"])
    with pytest.raises(TokenizerError, match="more than once"):
        train_tokenizer(documents[:20], settings, str(tmp_path / "dup"))


def test_training_is_quiet(
    documents: list[str], tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    train_tokenizer(documents[:200], config(vocab_size=500), str(tmp_path / "quiet"))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_eod_falls_back_to_eos_without_the_special_token(
    documents: list[str], tmp_path: Path
) -> None:
    tokenizer = train_tokenizer(
        documents[:300], config(vocab_size=500, special_tokens=[]), str(tmp_path / "plain")
    )
    assert tokenizer.eod_id == 2 and tokenizer.pad_id is None
    assert set(tokenizer.special_ids) == {"<unk>", "<s>", "</s>"}
