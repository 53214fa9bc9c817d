"""T5 span-corruption samples (``model.family: t5``) from the same shard sets as GPT.

A sample starts as a raw window of ``R`` tokens: the GPT dataset's sample at the same
global index, built with ``seq_length = R`` (so windows come from the same split,
document shuffle, sample shuffle, blend and index cache as GPT samples, and never
overlap). Then, with a random state seeded by ``(data.seed, split, index)`` alone, T5's
``random_spans_noise_mask`` picks the noise: ``round(R · noise_density)`` tokens in
``round(noise / mean_span_length)`` spans, alternating non-noise / noise spans starting
with non-noise, every such mask equally likely (Raffel et al. 2020, §3.1.4;
``t5.data.preprocessors.random_spans_noise_mask``). As in T5, the counts are fixed by
``R``, so every sample has the same lengths, and the last span is always noise.

- encoder input: the non-noise tokens, each noise span replaced by one sentinel
  (``<extra_id_0>`` for the first span, ``<extra_id_1>`` for the next, ...), then EOS;
- targets: each span's sentinel followed by its tokens, then EOS;
- decoder input: the targets shifted right, starting with the pad id (T5's decoder
  start token).

``R`` is the longest window whose encoder input fits ``S = encoder_length`` (T5's
``random_spans_helper``), and ``T = decoder_length`` defaults to the targets' exact
length; shorter inputs are padded with the pad id (``encoder_mask`` False there,
``labels`` -100). EOS is the shard set's end-of-document id, so generation stops where
pretraining documents do.

Sample ``i`` depends on the data, split, seed and lengths only: the same on every
data-parallel rank and after a resume (the trainer's ResumableSampler asks by global
sample index), and the same as one process gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from megalith.config import ConfigError, DataConfig
from preprocessing.megatron_shards import read_shard_set_manifest
from preprocessing.tokenizer import load_tokenizer, require_sentinels
from training.data.builder import build_gpt_datasets
from training.data.gpt_dataset import SPLIT_NAMES
from training.data.shard_set import ShardSetError

T5_KEYS = ("encoder_tokens", "decoder_tokens", "labels", "encoder_mask")
IGNORE_INDEX = -100
_SPAN_STREAM = 2  # beside gpt_dataset's document (0) and sample (1) streams


def span_counts(raw_length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """Noise tokens and noise spans of a window of ``raw_length`` tokens (T5's rounding:
    at least one of each, and at least one token left unmasked)."""
    noise = min(max(round(raw_length * noise_density), 1), raw_length - 1)
    spans = max(round(noise / mean_span_length), 1)
    return noise, spans


@dataclass(frozen=True)
class SpanLengths:
    """The fixed lengths of every sample, from ``data.span_corruption`` and ``data.seq_length``."""

    raw: int  # R: tokens of the raw window
    noise: int  # masked tokens per window
    spans: int  # masked spans per window (= sentinels needed)
    encoder: int  # S
    decoder: int  # T

    @property
    def encoder_used(self) -> int:
        """Encoder tokens before padding: non-noise tokens, a sentinel per span, EOS."""
        return self.raw - self.noise + self.spans + 1

    @property
    def targets_used(self) -> int:
        """Target tokens before padding: a sentinel per span, the noise tokens, EOS."""
        return self.noise + self.spans + 1


def span_corruption_lengths(data: DataConfig) -> SpanLengths:
    """R, the noise counts, S and T; errors name the ``data.span_corruption`` key to change."""
    config = data.span_corruption
    encoder = config.encoder_length or data.seq_length

    def encoder_used(raw: int) -> int:
        noise, spans = span_counts(raw, config.noise_density, config.mean_span_length)
        return raw - noise + spans + 1

    raw = 2
    while encoder_used(raw + 1) <= encoder:
        raw += 1
    noise, spans = span_counts(raw, config.noise_density, config.mean_span_length)
    if raw - noise < spans:
        raise ConfigError(
            f"data.span_corruption: noise_density {config.noise_density} with mean_span_length "
            f"{config.mean_span_length} leaves {raw - noise} unmasked tokens for {spans} spans "
            "in a window; lower noise_density or raise mean_span_length"
        )
    targets = noise + spans + 1
    decoder = config.decoder_length or targets
    if decoder < targets:
        raise ConfigError(
            f"data.span_corruption.decoder_length {decoder} is shorter than the {targets} "
            f"target tokens each sample has ({spans} sentinels, {noise} masked tokens, EOS) at "
            f"encoder length {encoder}: raise it, or leave it unset"
        )
    return SpanLengths(raw, noise, spans, encoder, decoder)


def random_segmentation(
    num_items: int, num_segments: int, rng: np.random.RandomState
) -> np.ndarray:
    """Lengths of ``num_segments`` non-empty segments that add up to ``num_items``, every
    segmentation equally likely: ``num_segments - 1`` distinct cut points among the
    ``num_items - 1`` gaps."""
    cuts = np.sort(rng.permutation(num_items - 1)[: num_segments - 1] + 1)
    return np.diff(np.concatenate([[0], cuts, [num_items]]))


def random_spans_noise_mask(
    length: int, noise: int, spans: int, rng: np.random.RandomState
) -> np.ndarray:
    """A bool mask of ``length`` with ``noise`` True tokens in ``spans`` runs; non-noise
    and noise spans alternate, starting with non-noise (so ending with noise)."""
    noise_lengths = random_segmentation(noise, spans, rng)
    keep_lengths = random_segmentation(length - noise, spans, rng)
    interleaved = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)
    is_noise = np.tile([False, True], spans)
    return np.repeat(is_noise, interleaved)


def _replace_spans(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """``tokens`` with the ``k``-th run of True in ``mask`` replaced by ``sentinels[k]``."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    span = np.cumsum(starts) - 1
    return np.where(starts, sentinels[span], tokens)[~mask | starts]


def corrupt_spans(
    tokens: np.ndarray, mask: np.ndarray, sentinels: list[int], eos_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Encoder input and targets of ``tokens`` with noise ``mask`` (one sentinel a span).

    The targets are the same replacement with the mask inverted: the mask starts with
    non-noise, so non-noise run ``k`` becomes sentinel ``k`` right before noise span ``k``.
    """
    if mask[0]:
        raise ValueError("a noise mask must start with a non-noise token")
    ids = np.asarray(sentinels, dtype=np.int64)
    eos = np.array([eos_id], dtype=np.int64)
    encoder = _replace_spans(tokens, mask, ids)
    targets = _replace_spans(tokens, ~mask, ids)
    return np.concatenate([encoder, eos]), np.concatenate([targets, eos])


def t5_sample(
    encoder: np.ndarray, targets: np.ndarray, encoder_length: int, decoder_length: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """The fixed-length batch item: padded encoder tokens and mask, decoder input, labels."""
    encoder_tokens = np.full(encoder_length, pad_id, dtype=np.int64)
    encoder_tokens[: encoder.size] = encoder
    labels = np.full(decoder_length, IGNORE_INDEX, dtype=np.int64)
    labels[: targets.size] = targets
    decoder_tokens = np.full(decoder_length, pad_id, dtype=np.int64)
    decoder_tokens[1 : targets.size] = targets[:-1]
    return {
        "encoder_tokens": torch.from_numpy(encoder_tokens),
        "decoder_tokens": torch.from_numpy(decoder_tokens),
        "labels": torch.from_numpy(labels),
        "encoder_mask": torch.arange(encoder_length) < encoder.size,
    }


def encoder_mask_on(mask: Tensor, device: torch.device) -> Tensor | None:
    """A batch's ``encoder_mask`` on ``device``, or None where no sample pads (span
    corruption at the window length never does): the encoder's relative bias then stays
    one ``[1, heads, S, S]`` for the batch, whose gradient the shared-bias attention sums
    in its kernel (:mod:`training.models.shared_bias_attention`). Give it the host copy:
    checking a CUDA mask would wait for the device."""
    if not mask.is_cuda and bool(mask.all()):
        return None
    return mask.to(device, non_blocking=True)


class SpanCorruptionDataset(Dataset):
    """Span-corrupted samples of the raw windows ``windows`` (GPT samples of ``R`` tokens)."""

    def __init__(
        self,
        windows: Dataset,
        lengths: SpanLengths,
        sentinels: list[int],
        eos_id: int,
        pad_id: int,
        seed: int,
        split: str,
    ):
        if len(sentinels) < lengths.spans:
            raise ValueError(f"{lengths.spans} sentinels needed, got {len(sentinels)}")
        self.windows = windows
        self.lengths = lengths
        self.sentinels = list(sentinels)
        self.eos_id, self.pad_id = eos_id, pad_id
        self.seed, self.split = seed, split

    def __len__(self) -> int:
        return len(self.windows)

    def noise_mask(self, index: int) -> np.ndarray:
        """Sample ``index``'s noise mask: from ``(seed, split, index)`` only."""
        rng = np.random.RandomState(
            [self.seed % 2**32, _SPAN_STREAM, SPLIT_NAMES.index(self.split), index]
        )
        return random_spans_noise_mask(
            self.lengths.raw, self.lengths.noise, self.lengths.spans, rng
        )

    def raw_tokens(self, index: int) -> np.ndarray:
        """The raw window of sample ``index``, before corruption."""
        return self.windows[index]["tokens"][: self.lengths.raw].numpy()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        encoder, targets = corrupt_spans(
            self.raw_tokens(index), self.noise_mask(index), self.sentinels, self.eos_id
        )
        return t5_sample(encoder, targets, self.lengths.encoder, self.lengths.decoder, self.pad_id)


@dataclass(frozen=True)
class SpecialIds:
    """The ids span corruption writes: sentinels, EOS (end of document) and pad."""

    sentinels: list[int]
    eos_id: int
    pad_id: int


def special_ids(data: DataConfig, spans: int) -> SpecialIds:
    """From the first shard set's tokenizer; errors name the tokenizer or manifest."""
    first = data.training_sources()[0]
    root = first.path
    try:
        _, manifest = read_shard_set_manifest(
            root, data.storage_options, first.tokenizer, first.eod
        )
    except (FileNotFoundError, ValueError) as exc:
        raise ShardSetError(str(exc)) from None
    info = manifest.tokenizer
    tokenizer = load_tokenizer(info.path, storage_options=data.storage_options)
    if tokenizer.id != info.id:
        raise ShardSetError(
            f"{info.path} is not the tokenizer {root} was prepared with (sha256 "
            f"{tokenizer.id[:16]}…, manifest says {info.id[:16]}…)"
        )
    if info.pad_id is None:
        raise ShardSetError(
            f"{info.path}: has no <|pad|> token, which T5 samples pad with (and start the "
            "decoder with): train the tokenizer with <|pad|> in tokenizer.special_tokens"
        )
    return SpecialIds(require_sentinels(tokenizer, spans), info.eod_id, info.pad_id)


def build_t5_datasets(
    data: DataConfig, num_samples: tuple[int, int, int]
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test span-corruption datasets (``None`` for an empty split), over
    the raw windows of :func:`~training.data.builder.build_gpt_datasets`."""
    if data.format != "pretrain":
        raise ConfigError(
            f"data.format={data.format}: T5 span corruption trains on pretraining documents; "
            "set data.format to pretrain"
        )
    lengths = span_corruption_lengths(data)
    ids = special_ids(data, lengths.spans)
    windows = build_gpt_datasets(data.model_copy(update={"seq_length": lengths.raw}), num_samples)
    return tuple(  # type: ignore[return-value]
        None
        if split is None
        else SpanCorruptionDataset(
            split, lengths, ids.sentinels, ids.eos_id, ids.pad_id, data.seed, name
        )
        for split, name in zip(windows, SPLIT_NAMES, strict=True)
    )
