"""The data stage's sections: the tokenizer, the shard set and its sources, span corruption
and curation."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from megalith.config.base import MAX_POSITIONS, ConfigError, StrictModel

DEFAULT_SPECIAL_TOKENS = [
    "<|eod|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]


class TokenizerConfig(StrictModel):
    """How to train (or where to find) the tokenizer."""

    model: str | None = Field(
        default=None,
        description="An existing tokenizer: a SentencePiece .model, a Hugging Face "
        "tokenizer.json, or a GPT-2 *vocab.json with *merges.txt beside it; when set, nothing "
        "is trained.",
    )
    output_prefix: str | None = Field(
        default=None,
        description="Where a trained model goes (PREFIX.model, PREFIX.vocab). "
        "Defaults to DATA_OUTPUT/tokenizer.",
    )
    model_type: Literal["bpe", "unigram", "byte_bpe"] = Field(
        default="bpe",
        description="SentencePiece bpe or unigram (PREFIX.model), or byte_bpe: a GPT-2-style "
        "byte-level BPE trained with Hugging Face tokenizers (PREFIX.json).",
    )
    vocab_size: int = Field(default=8000, ge=64, le=1_048_576)
    pad_vocab_multiple: int = Field(
        default=128,
        ge=1,
        le=65536,
        description="The model's embedding table is padded to a multiple of this.",
    )
    byte_fallback: bool = True
    character_coverage: float = Field(default=0.9995, gt=0.0, le=1.0)
    special_tokens: list[str] = Field(default_factory=lambda: list(DEFAULT_SPECIAL_TOKENS))
    sentinel_tokens: int = Field(
        default=0,
        ge=0,
        le=1000,
        description="T5 span-corruption sentinels <extra_id_0> .. <extra_id_{n-1}> added to "
        "the vocabulary after special_tokens (T5 uses 100); 0: none.",
    )
    max_training_documents: int = Field(
        default=200_000,
        ge=1,
        description="Sampling cap: at most this many documents (reservoir-sampled) train the model.",
    )
    max_sentence_length: int = Field(default=16384, ge=16, le=1 << 30)
    seed: int = 1234


class DatasetSource(StrictModel):
    """One shard set in a training blend."""

    path: str
    weight: float = Field(default=1.0, gt=0.0)
    tokenizer: str | None = Field(
        default=None,
        description="Only for a Megatron-LM preprocess_data.py output (path: PREFIX of "
        "PREFIX.bin/.idx, no manifest.json): the tokenizer it was made with (a .model, a "
        "tokenizer.json, or a GPT-2 *vocab.json with *merges.txt beside it).",
    )
    eod: Literal["token", "eos"] | None = Field(
        default=None,
        description="With tokenizer: the EOD it appended (eos: </s>, GPTSentencePieceTokenizer).",
    )

    @property
    def record_file(self) -> str:
        """The file whose sha256 identifies this data in a run's lineage: the manifest of a
        prepared shard set, the index of a Megatron-LM prefix (which has no manifest)."""
        if self.tokenizer is not None:
            return f"{self.path}.idx"
        return self.path.rstrip("/") + "/manifest.json"


class SpanCorruptionConfig(StrictModel):
    """T5 span corruption (``model.family: t5``, training.data.t5_dataset): a share of each
    raw window's tokens, in spans, is replaced by sentinels in the encoder input, and the
    decoder predicts the spans."""

    noise_density: float = Field(
        default=0.15, gt=0.0, lt=1.0, description="Share of the raw tokens that are masked."
    )
    mean_span_length: float = Field(
        default=3.0, ge=1.0, description="Mean length of a masked span, in tokens."
    )
    encoder_length: int | None = Field(
        default=None,
        ge=8,
        le=MAX_POSITIONS,
        description="Encoder tokens per sample (S); None: data.seq_length. Also a T5 chat "
        "fine-tune's (data.format chat) encoder length.",
    )
    decoder_length: int | None = Field(
        default=None,
        ge=2,
        le=MAX_POSITIONS,
        description="Decoder tokens per sample (T); None: exactly what the encoder length and "
        "noise density need (T5's random_spans_helper: 114 for S 512 at 0.15 / 3.0). A T5 "
        "chat fine-tune's answer length (None: data.seq_length).",
    )


# Gopher's stop words (Rae et al. 2021): a document of English prose holds at least two.
GOPHER_STOP_WORDS = ["the", "be", "to", "of", "and", "that", "have", "with"]


class ExactDedupConfig(StrictModel):
    """Exact duplicates: a hash of the lower-cased, whitespace-collapsed text."""

    enabled: bool = True


class NearDedupConfig(StrictModel):
    """Near duplicates: MinHash signatures of word shingles in an LSH index (datasketch).
    The first document of a cluster, in input order, is kept."""

    enabled: bool = True
    shingle_size: int = Field(default=5, ge=1, le=64, description="Words per shingle.")
    num_perm: int = Field(default=128, ge=2, le=1024, description="MinHash permutations.")
    threshold: float = Field(
        default=0.8,
        gt=0.0,
        lt=1.0,
        description="Estimated Jaccard similarity of the shingle sets at which two documents "
        "are near duplicates; picks bands and rows (datasketch's optimum) unless both are set.",
    )
    bands: int | None = Field(default=None, ge=2, le=1024, description="LSH bands (with rows).")
    rows: int | None = Field(default=None, ge=1, le=1024, description="MinHash values per band.")
    seed: int = Field(default=1234, description="Seed of the MinHash permutations.")

    @model_validator(mode="after")
    def _bands_with_rows(self) -> NearDedupConfig:
        if (self.bands is None) != (self.rows is None):
            raise ValueError("set both bands and rows, or neither (threshold then picks them)")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"bands {self.bands} x rows {self.rows} = {self.bands * self.rows} exceeds "
                f"num_perm {self.num_perm}"
            )
        return self


def _ngram_thresholds(value: dict[int, float], name: str) -> dict[int, float]:
    for n, share in value.items():
        if not 1 <= n <= 64 or not 0.0 < share <= 1.0:
            raise ValueError(f"{name}: {n}: {share}: expected n in 1..64 and a share in (0, 1]")
    return value


class QualityConfig(StrictModel):
    """Gopher / C4 / FineWeb-style heuristics (Rae et al. 2021, Gopher's defaults). A
    document failing one is removed and counted under that rule; null switches a rule off."""

    enabled: bool = True
    min_words: int | None = Field(default=50, ge=0, description="Rule word_count.")
    max_words: int | None = Field(default=100_000, ge=1, description="Rule word_count.")
    min_mean_word_length: float | None = Field(
        default=3.0, ge=0, description="Rule mean_word_length (characters per word)."
    )
    max_mean_word_length: float | None = Field(
        default=10.0, gt=0, description="Rule mean_word_length."
    )
    max_symbol_ratio: float | None = Field(
        default=0.1, ge=0, description="Rule symbol_ratio: '#' and ellipses per word."
    )
    max_bullet_lines: float | None = Field(
        default=0.9,
        ge=0,
        le=1,
        description="Rule bullet_lines: share of lines starting with a bullet.",
    )
    max_ellipsis_lines: float | None = Field(
        default=0.3,
        ge=0,
        le=1,
        description="Rule ellipsis_lines: share of lines ending in an ellipsis.",
    )
    min_alpha_words: float | None = Field(
        default=0.8, ge=0, le=1, description="Rule alpha_words: share of words with a letter."
    )
    min_stop_words: int | None = Field(
        default=2, ge=0, description="Rule stop_words: distinct stop words the text must hold."
    )
    stop_words: list[str] = Field(default_factory=lambda: list(GOPHER_STOP_WORDS))
    max_duplicate_lines: float | None = Field(
        default=0.3, ge=0, le=1, description="Rule duplicate_lines: share of lines seen before."
    )
    max_duplicate_line_chars: float | None = Field(
        default=0.2, ge=0, le=1, description="Rule duplicate_lines: share of characters in them."
    )
    max_top_ngram: dict[int, float] = Field(
        default_factory=lambda: {2: 0.2, 3: 0.18, 4: 0.16},
        description="Rule top_ngram: {n: share}, the most frequent word n-gram may cover at "
        "most this share of the characters; {} switches it off.",
    )
    max_duplicate_ngrams: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="Rule duplicate_ngrams: {n: share}, word n-grams that occur more than "
        "once may cover at most this share of the characters; {} switches it off.",
    )

    @field_validator("max_top_ngram", "max_duplicate_ngrams")
    @classmethod
    def _check_ngrams(cls, value: dict[int, float], info: ValidationInfo) -> dict[int, float]:
        return _ngram_thresholds(value, info.field_name)


class DecontaminationConfig(StrictModel):
    """Documents sharing a word n-gram with an evaluation item are removed (or reported)."""

    enabled: bool = True
    task_files: list[str] = Field(
        default_factory=list,
        description="Evaluation files (jsonl: every string of a record is one item's text; "
        "txt: one item per line). The pipelines add the task files they evaluate on.",
    )
    ngram: int = Field(default=13, ge=1, le=64, description="Words per n-gram (GPT-3: 13).")
    action: Literal["remove", "report"] = Field(
        default="remove", description="remove the document, or keep it and only count it."
    )


class PIIConfig(StrictModel):
    """Redaction of emails, IPv4 addresses and phone numbers (documents kept, text changed)."""

    enabled: bool = False
    emails: bool = True
    ip_addresses: bool = True
    phone_numbers: bool = True
    email_replacement: str = "<email>"
    ip_replacement: str = "<ip>"
    phone_replacement: str = "<phone>"


class CurateConfig(StrictModel):
    """Curation before tokenization (``megalith data curate``, preprocessing.curate): the
    corpus, filtered and redacted, is written as jsonl for the tokenizer and shards."""

    enabled: bool = Field(
        default=True, description="Whether the pipelines curate before tokenizing."
    )
    output: str | None = Field(
        default=None, description="Where the curated jsonl goes; default DATA_OUTPUT/curated."
    )
    exact_dedup: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    decontamination: DecontaminationConfig = Field(default_factory=DecontaminationConfig)
    pii: PIIConfig = Field(default_factory=PIIConfig)
    max_examples: int = Field(
        default=5, ge=0, le=1000, description="Removed documents kept as examples per rule."
    )


class DataConfig(StrictModel):
    """Raw corpus → shards (preprocessing) and shards → samples (training)."""

    # Preprocessing.
    inputs: list[str] = Field(
        default_factory=list,
        description="Corpus files: local paths, globs, directories or fsspec URLs such as s3://.",
    )
    output: str | None = Field(default=None, description="Shard directory or URL prefix.")
    input_format: Literal["auto", "jsonl", "parquet", "text"] = "auto"
    json_key: str = Field(default="text", description="Field holding the text (jsonl, parquet).")
    text_mode: Literal["paragraph", "line", "file"] = Field(
        default="paragraph",
        description="How plain text splits into documents: blank-line separated paragraphs, "
        "single lines, or one document per file.",
    )
    workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1, le=1024)
    engine: Literal["local", "ray"] = Field(
        default="local",
        description="Where prepare and curate run their per-document work: local processes "
        "(data.workers), or Ray Data on a Ray cluster; the output is the same "
        "(preprocessing.engines).",
    )
    ray_address: str | None = Field(
        default=None,
        description="The Ray cluster for engine ray (HEAD:6379 or ray://HEAD:10001); "
        "default $RAY_ADDRESS.",
    )
    shards: int = Field(default=1, ge=1, le=1_000_000)
    on_bad_record: Literal["fail", "skip"] = "fail"
    max_bad_examples: int = Field(default=20, ge=0)
    append_eod: bool = True
    eod: Literal["token", "eos"] = Field(
        default="token",
        description="The end-of-document id appended: our <|eod|> piece ('token'), or the "
        "tokenizer's </s> ('eos', as Megatron-LM's tools/preprocess_data.py does).",
    )
    batch_documents: int = Field(
        default=512, ge=1, le=1 << 20, description="Documents per worker batch."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (e.g. endpoint_url for S3)."
    )
    format: Literal["pretrain", "chat"] = Field(
        default="pretrain",
        description="pretrain: documents of text, loss on every token. chat: jsonl "
        "conversations (preprocessing.chat) prepared with a loss mask and trained as packed "
        "whole conversations with the loss on assistant tokens only (training.objectives.sft).",
    )

    # Training-time dataset.
    blend: list[DatasetSource] = Field(
        default_factory=list,
        description="Shard sets to train on with weights; defaults to [output].",
    )
    split: tuple[float, float, float] = Field(
        default=(0.98, 0.01, 0.01), description="train/valid/test shares, by document."
    )
    seq_length: int = Field(default=1024, ge=8, le=MAX_POSITIONS)
    seed: int = 1234
    cache_dir: str | None = Field(
        default=None,
        description="Where sample indices are cached; defaults to beside local data, "
        "or ~/.cache/megalith for remote data.",
    )
    span_corruption: SpanCorruptionConfig = Field(
        default_factory=SpanCorruptionConfig,
        description="T5 span-corruption samples (used with model.family t5).",
    )
    curate: CurateConfig = Field(
        default_factory=CurateConfig,
        description="Deduplication, quality filters, decontamination and PII redaction "
        "before tokenization (megalith data curate; on by default in the pipelines).",
    )

    @model_validator(mode="after")
    def _check_split(self) -> DataConfig:
        if any(s < 0 for s in self.split) or sum(self.split) <= 0:
            raise ValueError(f"split must be three non-negative shares, got {self.split}")
        return self

    def training_sources(self) -> list[DatasetSource]:
        if self.blend:
            return self.blend
        if self.output:
            return [DatasetSource(path=self.output)]
        raise ConfigError("data.blend is empty and data.output is not set: nothing to train on")
