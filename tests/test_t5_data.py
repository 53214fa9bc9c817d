"""T5 span-corruption data: sentinel tokens in the tokenizer and the span-corruption dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from t5_helpers import t5_shard_set, uncorrupt
from torch.utils.data import DataLoader

from megalith.config import ConfigError, DataConfig, TokenizerConfig, load_config
from preprocessing.manifest import read_manifest
from preprocessing.tokenizer import (
    TokenizerError,
    load_tokenizer,
    require_sentinels,
    sentinel_ids,
    train_tokenizer,
)
from training.data import build_gpt_datasets
from training.data.t5_dataset import (
    T5_KEYS,
    build_t5_datasets,
    corrupt_spans,
    random_spans_noise_mask,
    span_corruption_lengths,
    span_counts,
)

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


# --- span lengths and noise masks --------------------------------------------------------


def test_lengths_follow_t5_random_spans_helper() -> None:
    # T5's published setting: inputs 512 at density 0.15, mean span 3 -> 568 raw tokens, 114 targets.
    lengths = span_corruption_lengths(DataConfig(seq_length=512))
    assert (lengths.raw, lengths.encoder, lengths.decoder) == (568, 512, 114)
    for seq_length in range(16, 300, 7):
        data = DataConfig(seq_length=seq_length)
        lengths = span_corruption_lengths(data)
        assert lengths.encoder_used <= seq_length  # the longest raw window that fits
        longer = span_counts(lengths.raw + 1, 0.15, 3.0)
        assert lengths.raw + 1 - longer[0] + longer[1] + 1 > seq_length
        assert lengths.decoder == lengths.targets_used == lengths.noise + lengths.spans + 1
    other = DataConfig(seq_length=64, span_corruption={"encoder_length": 128, "decoder_length": 40})
    assert span_corruption_lengths(other).encoder == 128
    assert span_corruption_lengths(other).decoder == 40


def test_bad_span_corruption_configs_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data\.span_corruption\.decoder_length 5 is shorter"):
        span_corruption_lengths(DataConfig(seq_length=128, span_corruption={"decoder_length": 5}))
    with pytest.raises(ConfigError, match=r"data\.span_corruption: noise_density 0\.9"):
        span_corruption_lengths(
            DataConfig(seq_length=64, span_corruption={"noise_density": 0.9, "mean_span_length": 1})
        )
    for key, value in [("noise_density", 0), ("noise_density", 1.0), ("mean_span_length", 0.5)]:
        with pytest.raises(ConfigError, match=rf"data\.span_corruption\.{key}"):
            load_config(values={f"data.span_corruption.{key}": value})
    with pytest.raises(ConfigError, match="data.span_corruption.encoder_lenght: unknown key"):
        load_config(values={"data.span_corruption.encoder_lenght": 64})


@pytest.mark.parametrize("length,density,mean", [(70, 0.15, 3.0), (200, 0.3, 5.0), (31, 0.5, 2.0)])
def test_noise_masks_have_t5_counts_and_spread(length: int, density: float, mean: float) -> None:
    noise, spans = span_counts(length, density, mean)
    hits = np.zeros(length)
    span_lengths = []
    draws = 400
    for seed in range(draws):
        mask = random_spans_noise_mask(length, noise, spans, np.random.RandomState(seed))
        assert mask.shape == (length,) and mask.sum() == noise
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]]))
        assert len(starts) == spans and not mask[0] and mask[-1]  # T5: last span is noise
        span_lengths += (ends - starts + 1).tolist()
        hits += mask
    assert noise == pytest.approx(length * density, abs=0.5 + 1e-9)  # rounded
    assert noise / spans == pytest.approx(mean, rel=0.2)
    # Uniform segmentation: the k-th span is as long as any other, on average.
    per_span = np.mean(span_lengths, axis=0)
    assert per_span == pytest.approx(np.full(spans, noise / spans), rel=0.15)
    # Every position but the first (non-noise comes first) is masked sometimes.
    assert hits[0] == 0 and (hits[1:] > 0).all()


def test_corrupt_spans_writes_sentinels_in_order() -> None:
    tokens = np.arange(100, 112)
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 1, 1], dtype=bool)
    encoder, targets = corrupt_spans(tokens, mask, [7, 8, 9], eos_id=2)
    assert encoder.tolist() == [100, 101, 7, 104, 105, 106, 8, 108, 109, 9, 2]
    assert targets.tolist() == [7, 102, 103, 8, 107, 9, 110, 111, 2]
    assert uncorrupt(encoder[:-1], targets[:-1], [7, 8, 9]).tolist() == tokens.tolist()


# --- the dataset over real shards ----------------------------------------------------------


@pytest.fixture(scope="module")
def t5_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return t5_shard_set(tmp_path_factory)


def t5_data(shards: Path, **span: object) -> DataConfig:
    return DataConfig(
        output=str(shards), seq_length=48, split=(0.9, 0.05, 0.05), span_corruption=span
    )


def test_samples_round_trip_to_the_raw_window(t5_shards: Path) -> None:
    data = t5_data(t5_shards, decoder_length=20)
    train, valid, test = build_t5_datasets(data, (32, 8, 0))
    assert test is None and len(train) == 32 and len(valid) == 8
    lengths, pad = train.lengths, train.pad_id
    manifest = read_manifest(str(t5_shards))
    tokenizer = load_tokenizer(manifest.tokenizer.path)
    sentinels = sentinel_ids(tokenizer)
    assert train.sentinels == sentinels[: lengths.spans] and pad == manifest.tokenizer.pad_id
    for index in range(len(train)):
        sample = train[index]
        assert {k: (v.dtype, tuple(v.shape)) for k, v in sample.items()} == {
            "encoder_tokens": (torch.int64, (48,)),
            "decoder_tokens": (torch.int64, (20,)),
            "labels": (torch.int64, (20,)),
            "encoder_mask": (torch.bool, (48,)),
        }
        used = int(sample["encoder_mask"].sum())
        encoder = sample["encoder_tokens"][:used].numpy()
        labels = sample["labels"].numpy()
        targets = labels[labels != -100]
        assert (sample["encoder_tokens"][used:] == pad).all()
        assert used == lengths.encoder_used and targets.size == lengths.targets_used
        assert encoder[-1] == targets[-1] == manifest.tokenizer.eod_id
        # Decoder input: the targets shifted right behind the pad id, padded after.
        decoder = sample["decoder_tokens"].numpy()
        assert decoder[0] == pad and (decoder[1 : targets.size] == targets[:-1]).all()
        assert (decoder[targets.size :] == pad).all() and (labels[targets.size :] == -100).all()
        # One sentinel per span, <extra_id_0> first, in the same order in both.
        in_encoder = [t for t in encoder.tolist() if t in sentinels]
        assert in_encoder == [t for t in targets.tolist() if t in sentinels]
        assert in_encoder == sentinels[: lengths.spans]
        raw = train.raw_tokens(index)
        assert uncorrupt(encoder[:-1], targets[:-1], sentinels).tolist() == raw.tolist()
    # The raw windows are the GPT samples of length R at the same index.
    (windows, _, _) = build_gpt_datasets(
        data.model_copy(update={"seq_length": lengths.raw}), (32, 0, 0)
    )
    assert train.raw_tokens(5).tolist() == windows[5]["tokens"][: lengths.raw].tolist()


def test_samples_are_deterministic_and_resumable(t5_shards: Path) -> None:
    data = t5_data(t5_shards)
    first, _, _ = build_t5_datasets(data, (24, 0, 0))
    again, _, _ = build_t5_datasets(data, (48, 0, 0))  # more samples: same start
    reseeded, _, _ = build_t5_datasets(data.model_copy(update={"seed": 7}), (24, 0, 0))
    for index in (0, 5, 23):
        for key, value in first[index].items():
            assert torch.equal(value, again[index][key]), (index, key)
    assert not torch.equal(first[3]["encoder_tokens"], first[4]["encoder_tokens"])
    assert any(
        not torch.equal(first[i]["labels"], reseeded[i]["labels"]) for i in range(len(first))
    )
    # A worker process (the dataset pickled: spawned, not forked from this busy test
    # process) resuming at sample 8 reads the same samples.
    from training.trainer import ResumableSampler

    loader = DataLoader(
        first,
        batch_size=4,
        sampler=ResumableSampler(8, 24, 4),
        num_workers=1,
        multiprocessing_context="spawn",
    )
    batches = list(loader)
    assert len(batches) == 4
    for number, batch in enumerate(batches):
        for row in range(4):
            want = first[8 + 4 * number + row]
            for key in T5_KEYS:
                assert torch.equal(batch[key][row], want[key])


def test_a_tokenizer_without_enough_sentinels_is_named(t5_shards: Path, shards: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: has 16 sentinel tokens .* needs"):
        build_t5_datasets(t5_data(t5_shards, encoder_length=512), (8, 0, 0))
    with pytest.raises(TokenizerError, match=r"tokenizer\.model: has 0 sentinel tokens"):
        build_t5_datasets(t5_data(shards), (8, 0, 0))
    with pytest.raises(ConfigError, match="data.format=chat"):
        build_t5_datasets(t5_data(t5_shards).model_copy(update={"format": "chat"}), (8, 0, 0))


def test_blended_shard_sets_give_span_corruption_samples(t5_shards: Path) -> None:
    """A blend reads its raw windows through the GPT blend (BlendedDataset)."""
    from training.data import BlendedDataset

    blend = [{"path": str(t5_shards), "weight": 1.0}, {"path": str(t5_shards), "weight": 3.0}]
    data = DataConfig(blend=blend, seq_length=48, split=(0.9, 0.05, 0.05))
    train, _, _ = build_t5_datasets(data, (16, 0, 0))
    assert isinstance(train.windows, BlendedDataset) and len(train) == 16
    sentinels = train.sentinels
    for index in range(16):
        sample = train[index]
        used = int(sample["encoder_mask"].sum())
        labels = sample["labels"][sample["labels"] != -100].numpy()
        encoder = sample["encoder_tokens"][:used].numpy()
        restored = uncorrupt(encoder[:-1], labels[:-1], sentinels)
        assert restored.tolist() == train.raw_tokens(index).tolist()
