"""The typed configuration tree shared by every stage.

One Pydantic model per section. The same classes are the YAML recipe schema, the
values behind ``--set key=value`` on the command line, and the parameters of the
Prefect flows (Prefect renders them as forms). Unknown keys are errors.

This module imports only Pydantic, PyYAML and the shared safe reader so that any stage
can use it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from megalith import safe_read
from megalith.errors import MegalithError

# Upper bounds on every number that sizes a model, a buffer or a process count, so a
# crafted recipe, package, checkpoint or HF config.json is refused before anything is
# built. Each admits the largest public models with room to spare (Llama 3.1 405B: 126
# layers, hidden 16384, 128 heads, vocab 128256, 131072 positions; DeepSeek-V3: 256
# experts, vocab 129280; Llama 4: 10M positions) and refuses what no machine could hold.
MAX_LAYERS = 1024
MAX_HIDDEN = 65536
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_FFN = 262144
MAX_VOCAB = 1 << 21
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 4096
MAX_PARAMETERS = 10**13
MAX_PROBLEMS_SHOWN = 10  # a file with 10,000 bad keys gets a screenful, not 10,000 lines


class ConfigError(MegalithError, ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys and type mismatches are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Pydantic reads true as 1 for a number; a file saying ``num_layers: true`` is wrong."""
        if isinstance(value, bool) and info.field_name:
            annotation = cls.model_fields[info.field_name].annotation
            if not any(t in (bool, Any) for t in _types_in(annotation)):
                raise ValueError("expected a number or text, not a boolean")
        return value


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


STYLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "normalization": "rmsnorm",
        "activation": "swiglu",
        "position_embedding": "rope",
        "bias": False,
        "tie_embeddings": False,
    },
    "gpt2": {
        "normalization": "layernorm",
        "activation": "gelu",
        "position_embedding": "learned",
        "bias": True,
        "tie_embeddings": True,
    },
}

# model.family t5 fills unset choices from these instead of ``style`` (T5 v1.1).
T5_DEFAULTS: dict[str, Any] = {
    "normalization": "rmsnorm",
    "activation": "geglu",
    "position_embedding": "relative",
    "bias": False,
    "tie_embeddings": False,
}


@dataclass(frozen=True)
class FamilyRules:
    """What a ``model.family`` fills and refuses in the config, as data (the family's code
    is its spec in training/families, which this module may not import)."""

    defaults: dict[str, Any] | None  # unset choices; None: STYLE_DEFAULTS[model.style]
    # (key, refuses(value), message), checked in order once the defaults are filled
    refused: tuple[tuple[str, Callable[[Any], bool], str], ...]
    decoder_stack: bool  # num_decoder_layers more blocks after the num_layers (encoder) ones


FAMILY_RULES: dict[str, FamilyRules] = {
    "gpt": FamilyRules(
        defaults=None,
        refused=(
            (
                "position_embedding",
                lambda v: v == "relative",
                "model.position_embedding 'relative' needs model.family t5",
            ),
            (
                "activation",
                lambda v: v == "geglu",
                "model.activation 'geglu' needs model.family t5",
            ),
            (
                "num_decoder_layers",
                lambda v: v is not None,
                "model.num_decoder_layers needs model.family t5",
            ),
        ),
        decoder_stack=False,
    ),
    "t5": FamilyRules(
        defaults=T5_DEFAULTS,
        refused=(
            (
                "position_embedding",
                lambda v: v == "learned",
                "model.position_embedding 'learned' with model.family t5: T5 uses relative or "
                "rope positions",
            ),
            (
                "normalization",
                lambda v: v == "layernorm",
                "model.normalization 'layernorm' with model.family t5: T5 uses rmsnorm",
            ),
            ("bias", lambda v: v is True, "model.bias True with model.family t5: T5 has no biases"),
            (
                "tie_embeddings",
                lambda v: v is True,
                "model.tie_embeddings True with model.family t5: T5 v1.1 has an untied output head",
            ),
            (
                "num_experts",
                bool,
                "model.num_experts with model.family t5: T5 MLPs are dense",
            ),
            (
                "activation",
                lambda v: v == "swiglu",
                "model.activation 'swiglu' with model.family t5: use geglu or gelu",
            ),
        ),
        decoder_stack=True,
    ),
}


class RopeScaling(StrictModel):
    """Llama 3's RoPE frequency scaling (Hugging Face ``rope_type: llama3``, Megatron-LM's
    ``--use-rope-scaling``): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``... /
    high_freq_factor`` kept, the ones between interpolated."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(default=8.0, gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")
        return self


class ModelConfig(StrictModel):
    """A transformer. ``style`` fills every architectural choice left unset; with
    ``family: t5`` (an encoder-decoder, training/models/t5.py) T5 v1.1's choices do."""

    family: Literal["gpt", "t5"] = Field(
        default="gpt",
        description="gpt: decoder-only (training/models/gpt.py); t5: encoder-decoder "
        "(training/models/t5.py, num_layers encoder layers), T5 v1.1 defaults.",
    )
    style: Literal["llama", "gpt2"] = "llama"
    num_layers: int = Field(default=2, ge=1, le=MAX_LAYERS)
    num_decoder_layers: int | None = Field(
        default=None,
        ge=1,
        le=MAX_LAYERS,
        description="family t5: decoder layers; None: num_layers.",
    )
    hidden_size: int = Field(default=128, ge=8, le=MAX_HIDDEN)
    num_attention_heads: int = Field(default=4, ge=1, le=MAX_HEADS)
    num_query_groups: int | None = Field(
        default=None,
        ge=1,
        le=MAX_HEADS,
        description="Grouped-query attention KV groups; None means one per head.",
    )
    ffn_hidden_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_FFN,
        description="None: 4h for GELU, 8h/3 rounded up to 64 for SwiGLU.",
    )
    vocab_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_VOCAB,
        description="None: the padded vocabulary of the training data.",
    )
    max_position_embeddings: int | None = Field(
        default=None, ge=1, le=MAX_POSITIONS, description="None: data.seq_length."
    )
    normalization: Literal["rmsnorm", "layernorm"] | None = None
    activation: Literal["swiglu", "gelu", "geglu"] | None = Field(
        default=None, description="geglu: gated GELU (tanh), T5 v1.1's; family t5 only."
    )
    gelu_approximation: Literal["tanh", "none"] = Field(
        default="tanh",
        description="activation gelu: tanh (GPT-2's; Megatron-Core's fused bias-GELU) or none "
        "(exact erf GELU: Megatron-Core without bias-GELU fusion or bias, HF 'gelu').",
    )
    position_embedding: Literal["rope", "learned", "relative"] | None = Field(
        default=None, description="relative: T5's bucketed attention biases; family t5 only."
    )
    relative_attention_num_buckets: int = Field(
        default=32, ge=2, le=4096, description="position_embedding relative: buckets per stack."
    )
    relative_attention_max_distance: int = Field(
        default=128,
        ge=2,
        le=MAX_POSITIONS,
        description="position_embedding relative: the farthest bucket.",
    )
    bias: bool | None = None
    tie_embeddings: bool | None = None
    rope_base: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(
        default=None, description="Llama 3 RoPE frequency scaling; None: plain RoPE."
    )
    nope_layers: list[int] = Field(
        default_factory=list,
        description="position_embedding rope: the layers (0-based) whose attention applies no "
        "RoPE (NoPE; Megatron-LM's --no-rope-freq).",
    )
    norm_eps: float = Field(default=1e-5, gt=0)
    init_std: float = Field(default=0.02, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    backend: Literal["auto", "torch", "te"] = Field(
        default="auto",
        description="Layer backend: Transformer Engine when importable (auto) or plain torch.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = Field(
        default="auto",
        description="The SDPA kernel tried first: auto keeps torch's order (flash, "
        "memory-efficient, math, cuDNN); cudnn puts cuDNN attention first (Hopper). Kernels "
        "that cannot run an input fall through to the next. With model.backend te, auto runs "
        "Transformer Engine's own attention and any other value runs SDPA (inside compiled "
        "graphs, where TE's attention is a graph break).",
    )
    loss_chunk_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_POSITIONS,
        description="Fuse the output layer with the cross-entropy, this many tokens at a "
        "time, so the whole [tokens, vocabulary] fp32 logits never exist (plain head, "
        "tensor parallelism 1); 0: off.",
    )
    # Mixture of experts (training/models/moe.py); None or 0 experts: every MLP is dense.
    num_experts: int | None = Field(
        default=None,
        ge=0,
        le=MAX_EXPERTS,
        description="Experts per MoE layer; None or 0: dense MLPs.",
    )
    moe_top_k: int = Field(
        default=2, ge=1, le=MAX_EXPERTS, description="Experts each token is routed to."
    )
    moe_ffn_hidden_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_FFN,
        description="Each expert's FFN width; None: ffn_hidden_size.",
    )
    moe_aux_loss_coeff: float = Field(
        default=0.01,
        ge=0.0,
        description="Weight of the Switch/GShard load-balancing loss added to the training loss.",
    )
    moe_capacity_factor: float | None = Field(
        default=None,
        gt=0.0,
        description="Tokens an expert takes, as a multiple of its fair share (top_k·tokens/"
        "experts); the lowest-weight assignments beyond it are dropped. None: dropless.",
    )
    moe_layer_frequency: int = Field(
        default=1,
        ge=1,
        le=MAX_LAYERS,
        description="Every k-th block (0, k, 2k, ...) is MoE; 1: every block.",
    )

    @model_validator(mode="after")
    def _fill_style(self) -> ModelConfig:
        rules = FAMILY_RULES[self.family]
        for key, value in (rules.defaults or STYLE_DEFAULTS[self.style]).items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        for key, refuses, message in rules.refused:  # the choices the family's model lacks
            if refuses(getattr(self, key)):
                raise ValueError(message)
        groups = self.num_query_groups or self.num_attention_heads
        object.__setattr__(self, "num_query_groups", groups)
        if self.ffn_hidden_size is None:
            if self.activation in ("swiglu", "geglu"):
                ffn = -(-(8 * self.hidden_size // 3) // 64) * 64
            else:
                ffn = 4 * self.hidden_size
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {groups}"
            )
        if self.gelu_approximation != "tanh" and self.activation != "gelu":
            raise ValueError("model.gelu_approximation applies to activation gelu only")
        if self.gelu_approximation != "tanh" and self.num_experts:
            raise ValueError("model.gelu_approximation none is not implemented for MoE experts")
        if self.rope_scaling is not None and self.position_embedding != "rope":
            raise ValueError("model.rope_scaling needs position_embedding rope")
        if self.nope_layers and self.position_embedding != "rope":
            raise ValueError("model.nope_layers needs position_embedding rope")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"model.nope_layers {self.nope_layers}: outside 0..num_layers-1")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(
                f"head_dim {self.head_dim} (hidden_size / num_attention_heads) must be even "
                "for rope positions"
            )
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim {self.head_dim} (hidden_size / num_attention_heads) exceeds "
                f"{MAX_HEAD_DIM}"
            )
        if self.num_experts:
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if self.moe_top_k > self.num_experts:
                raise ValueError(
                    f"moe_top_k {self.moe_top_k} exceeds num_experts {self.num_experts}"
                )
        if self.approximate_parameters() > MAX_PARAMETERS:
            raise ValueError(
                f"num_layers, hidden_size, ffn_hidden_size, num_experts and vocab_size "
                f"describe about {self.approximate_parameters():.2e} parameters, more than "
                f"the {MAX_PARAMETERS:.0e} limit"
            )
        return self

    def approximate_parameters(self) -> int:
        """A quick upper estimate of the weights (for the size limit; training.models.flops
        counts them exactly): every block's attention and MLP (all experts), T5's decoder
        cross-attention, untied embedding and head, learned positions."""
        hidden, width = self.hidden_size, self.num_attention_heads * self.head_dim
        attention = 2 * hidden * width + 2 * hidden * self.num_query_groups * self.head_dim
        mlp = (3 if self.activation in ("swiglu", "geglu") else 2) * hidden
        dense = mlp * self.ffn_hidden_size
        moe_layers = -(-self.num_layers // self.moe_layer_frequency) if self.num_experts else 0
        experts = moe_layers * (self.num_experts or 0) * mlp * (self.moe_ffn_hidden_size or 0)
        layers = self.stacked_layers
        cross = (layers - self.num_layers) * 2 * hidden * width  # the decoder's cross-attention
        positions = self.max_position_embeddings if self.position_embedding == "learned" else 0
        tables = (2 * (self.vocab_size or 0) + (positions or 0)) * hidden
        return layers * (attention + dense) + experts + cross + tables

    @property
    def decoder_layers(self) -> int:
        """family t5: the decoder's layer count (num_decoder_layers, else num_layers)."""
        return self.num_decoder_layers or self.num_layers

    @property
    def stacked_layers(self) -> int:
        """Every stack's blocks: GPT's layers, or T5's encoder then decoder layers (what a
        pipeline splits)."""
        decoder = self.decoder_layers if FAMILY_RULES[self.family].decoder_stack else 0
        return self.num_layers + decoder

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has a mixture-of-experts MLP (Megatron's moe_layer_freq)."""
        return bool(self.num_experts) and index % self.moe_layer_frequency == 0


# The GEMMs of a transformer block whose tensor-parallel communication Transformer Engine's
# userbuffers can overlap (``te.initialize_ub``'s names).
UserbufferGemm = Literal[
    "qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "proj_wgrad",
    "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad", "fc2_wgrad",
]  # fmt: skip


class UserbufferSettings(StrictModel):
    """How one GEMM overlaps its communication (an entry of TE's ``initialize_ub``
    ``ub_cfgs``, as Megatron-LM's ``--tp-comm-overlap-cfg`` file holds them); unset fields
    keep TE's defaults."""

    method: Literal["ring_exchange", "pipeline", "bulk", "external"] | None = Field(
        default=None,
        description="ring_exchange: point-to-point chunks, the GEMM reduces; pipeline: the "
        "GEMM in num_splits chunks, a reduction kernel on num_sm SMs beside it.",
    )
    num_sm: int | None = Field(default=None, ge=1, le=264, description="SMs for the copies.")
    cga_size: int | None = Field(default=None, ge=1, le=16)
    num_splits: int | None = Field(default=None, ge=1, le=64)
    set_sm_margin: bool | None = None
    atomic_gemm: bool | None = None
    aggregate: bool | None = None
    use_ce: bool | None = Field(default=None, description="Copy engines for the transfers.")
    fp8_buf: bool | None = None


class ParallelConfig(StrictModel):
    """How the model and data are split over GPUs; data parallel fills the rest of the world.

    world = tensor · context · pipeline · data, ranks ordered tensor-innermost (Megatron's
    order), so tensor-parallel peers share a node. Expert parallelism is carved out of
    data · context for the MoE layers.
    """

    tensor: int = Field(default=1, ge=1, description="Tensor-parallel size.")
    pipeline: int = Field(default=1, ge=1, description="Pipeline stages.")
    virtual_pipeline: int | None = Field(
        default=None, ge=1, description="Model chunks per pipeline rank (interleaved schedule)."
    )
    context: int = Field(default=1, ge=1, description="Context-parallel size (sequence split).")
    expert: int = Field(default=1, ge=1, description="Expert-parallel size for MoE layers.")
    sequence_parallel: bool = Field(
        default=False, description="With tensor > 1: norms and dropout on sequence shards."
    )
    async_tensor_parallel: bool = Field(
        default=False,
        description="With sequence_parallel and training.compile on CUDA: Inductor splits each "
        "all-gather and reduce-scatter of the TP linears into pieces overlapped with the "
        "matmul (torch's async TP, symmetric memory).",
    )
    tp_comm_overlap: bool = Field(
        default=False,
        description="With model.backend=te, sequence_parallel and CUDA: Transformer Engine "
        "overlaps each all-gather and reduce-scatter of the TP linears with their GEMMs "
        "through userbuffers; every training micro-batch must then be "
        "training.micro_batch_size x data.seq_length tokens.",
    )
    tp_comm_overlap_config: dict[UserbufferGemm, UserbufferSettings] = Field(
        default_factory=dict,
        description="Per GEMM, how parallel.tp_comm_overlap overlaps it (TE's ub_cfgs, e.g. "
        "{proj_fprop: {method: ring_exchange}}); GEMMs not named keep TE's defaults.",
    )
    data_parallel_mode: Literal["ddp", "distributed_optimizer", "fsdp"] = Field(
        default="ddp",
        description="ddp: bucketed all-reduce overlapped with backward; distributed_optimizer: "
        "optimizer state sharded over data-parallel ranks (ZeRO-1/2); fsdp: FSDP2.",
    )
    ddp_bucket_mb: float = Field(default=25.0, gt=0, le=16384, description="Gradient bucket size.")
    pipeline_schedule: Literal["1f1b", "interleaved", "zero-bubble"] = Field(
        default="1f1b",
        description="1f1b; interleaved (needs virtual_pipeline >= 2); zero-bubble (ZB1P: weight "
        "gradients deferred into the bubble, any virtual_pipeline).",
    )
    pipeline_layers: Literal["even", "balanced"] | list[int] = Field(
        default="even",
        description="Layers per virtual pipeline stage: even; balanced (embedding and output "
        "head count as a layer each); or a list of counts (training.parallel.pipeline_layout).",
    )


class TrainingConfig(StrictModel):
    """The training loop: batch sizes, length, evaluation cadence, device."""

    micro_batch_size: int = Field(
        default=4, ge=1, le=1 << 20, description="Samples per forward pass."
    )
    global_batch_size: int = Field(
        default=8,
        ge=1,
        le=1 << 24,
        description="Samples per optimizer step (gradient accumulation fills it).",
    )
    train_iters: int = Field(default=100, ge=1, description="Optimizer steps.")
    eval_interval: int = Field(default=50, ge=0, description="Steps between validation; 0: never.")
    eval_iters: int = Field(default=4, ge=1, description="Validation micro-batches per evaluation.")
    log_interval: int = Field(default=1, ge=1)
    seed: int = 1234
    grad_clip: float = Field(default=1.0, ge=0.0, description="Max global grad norm; 0: off.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = Field(default=False, description="torch.compile the model.")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        default="inductor",
        description="torch.compile's backend: inductor generates fused kernels (the speed); "
        "aot_eager traces the same graphs (dynamo and AOT autograd) and runs them eagerly, "
        "without code generation: for telling a compile problem from a kernel one, and "
        "fast compiled runs on CPU.",
    )
    num_workers: int = Field(default=1, ge=0, le=256, description="DataLoader worker processes.")

    @model_validator(mode="after")
    def _check_batches(self) -> TrainingConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size {self.micro_batch_size}"
            )
        return self


class OptimizerConfig(StrictModel):
    """AdamW with decoupled weight decay (none on norms, biases and embeddings)."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(default=3e-4, gt=0)
    min_lr: float = Field(default=3e-5, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    fused: bool | None = Field(default=None, description="None: fused when on CUDA.")


class SchedulerConfig(StrictModel):
    """Learning-rate schedule: linear warmup, then cosine, warmup-stable-decay or constant."""

    name: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_iters: int = Field(default=10, ge=0)
    decay_iters: int | None = Field(default=None, ge=1, description="None: training.train_iters.")
    wsd_decay_fraction: float = Field(
        default=0.2, gt=0, le=1, description="WSD: share of steps spent decaying at the end."
    )


class MixedPrecisionConfig(StrictModel):
    """Compute precision. ``auto``: bf16 on CUDA, fp32 on CPU (bf16 everywhere with fp8).

    ``fp8``: the transformer blocks' matrix products run in float8 on top of bf16
    autocast (:mod:`training.precision.fp8`): with ``model.backend`` torch through torchao's
    float8 training (``megalith[gpu]``), with the Transformer Engine backend under TE's
    fp8 autocast. Weights, gradients, optimizer state, checkpoints and model packages
    keep their bf16/fp32 whole-tensor format; only the matmul inputs are cast.
    ``fp8_recipe`` picks the scaling: ``tensorwise`` (one dynamic scale per tensor;
    torchao's tensorwise recipe, TE's Float8CurrentScaling), ``rowwise`` (a scale per
    row; torchao only) or ``delayed`` (scales from an amax history; TE's DelayedScaling,
    TE only).
    """

    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    initial_loss_scale: float = Field(default=2.0**16, gt=0, description="fp16 only.")
    loss_scale_growth_interval: int = Field(default=1000, ge=1, description="fp16 only.")
    fp8: bool = Field(
        default=False,
        description="float8 matmuls in the transformer blocks (needs bf16 compute; "
        "torchao with model.backend torch, Transformer Engine with te).",
    )
    fp8_recipe: Literal["tensorwise", "rowwise", "delayed"] = Field(
        default="tensorwise",
        description="float8 scaling: tensorwise (torchao, TE current scaling), rowwise "
        "(torchao only), delayed (TE only).",
    )

    @model_validator(mode="after")
    def _check_fp8(self) -> MixedPrecisionConfig:
        if self.fp8 and self.dtype in ("fp16", "fp32"):
            raise ValueError(
                f"fp8 needs bf16 compute, got dtype {self.dtype}: set mixed_precision.dtype "
                "to bf16 (or auto), or mixed_precision.fp8 to false"
            )
        return self


class CheckpointConfig(StrictModel):
    """Where and how often checkpoints are written (safetensors + JSON, never pickle)."""

    interval: int = Field(
        default=0, ge=0, description="Steps between checkpoints; 0: only at the end."
    )
    keep_last: int = Field(default=3, ge=1)
    directory: str | None = Field(default=None, description="None: OUTPUT/checkpoints.")
    resume: bool = Field(default=False, description="Continue from the latest checkpoint.")
    sign: bool | None = Field(
        default=None,
        description="Sign each checkpoint (HMAC with MEGALITH_SIGNING_KEY, or Ed25519 with a "
        "private key, MEGALITH_ED25519_PRIVATE_KEY); None: when a key is set.",
    )
    require_signature: bool = Field(
        default=False,
        description="Refuse to resume or fine-tune from an unsigned or wrongly signed "
        "checkpoint (MEGALITH_REQUIRE_SIGNATURE=1 asks the same of every loader).",
    )
    async_save: bool = Field(
        default=True,
        description="Write checkpoints in a background thread: training waits only while "
        "this rank's shards are copied to host memory; at most one save in flight.",
    )


class LoggingConfig(StrictModel):
    """Experiment tracking. MLFLOW_TRACKING_URI overrides tracking_uri."""

    mlflow: bool = True
    tracking_uri: str | None = Field(
        default=None,
        description="None: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory.",
    )
    experiment: str = "megalith"
    run_name: str | None = None
    registered_model: str = Field(
        default="megalith-demo", description="Registry name for the trained model."
    )


class MetricRule(StrictModel):
    """One eval metric the promotion gate compares (``registry.promotion``).

    ``margin``: the candidate must beat the champion by at least this fraction of the
    champion's value (0.01 = 1% better). ``max_regression``: the candidate may be worse by
    at most this fraction. A rule with neither only reports the metric."""

    metric: str = Field(description="Eval metric name, e.g. valid_perplexity, sample_facts_acc.")
    goal: Literal["min", "max"] = Field(description="min: lower is better; max: higher is.")
    margin: float | None = Field(default=None, ge=0)
    max_regression: float | None = Field(default=None, ge=0)


class PromotionConfig(StrictModel):
    """When a ``candidate`` may replace the ``champion`` (``megalith registry gate``)."""

    rules: list[MetricRule] = Field(
        default_factory=lambda: [
            MetricRule(metric="valid_perplexity", goal="min", margin=0.0),
            MetricRule(metric="sample_facts_acc_norm", goal="max", max_regression=0.05),
        ],
        description="Every rule must pass; a candidate without one of the metrics is refused.",
    )


class LoRAConfig(StrictModel):
    """Low-rank adapters (Hu et al. 2021): ``y = W x + (alpha/rank) · B A dropout(x)``.

    The base weights stay frozen and only ``A`` and ``B`` train (``B`` starts at zero, so
    the fine-tuned model starts as the base). Under tensor parallelism the adapters follow
    their base layer (Megatron/NeMo): on a column-parallel base ``A`` is replicated and
    ``B`` split on the output; on a row-parallel base ``A`` is split on the input, its
    partial product reduced like the base's, and ``B`` replicated (training.finetune.lora).
    """

    rank: int = Field(default=8, ge=1, le=65536, description="Rank r of the update B·A.")
    alpha: float = Field(default=16.0, gt=0, description="The update is scaled by alpha / rank.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input only."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["qkv", "proj", "fc1", "fc2"],
        min_length=1,
        description="Linear layers that get adapters, by module name: qkv, proj (attention), "
        "fc1, fc2 (MLP); every layer's module of that name.",
    )


class FinetuneConfig(StrictModel):
    """Fine-tuning: start from trained weights instead of a random init.

    ``base`` is where the weights come from: a Megalith checkpoint (a ``step-*``
    directory or a checkpoints root, v1 or v2: model weights only; the optimizer and
    the step start afresh), a model package directory, a registered model
    (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``) or a Hugging Face Llama/GPT-2
    directory. The model's architecture comes from the base; ``model`` keys set in the
    recipe must agree with it (runtime keys such as dropout or activation_checkpointing
    may differ). ``lora`` unset: full-parameter fine-tuning.
    """

    base: str | None = Field(
        default=None,
        description="The starting point: checkpoint dir, package dir, models:/NAME@ALIAS or "
        "an HF directory; None: pretraining from a random init.",
    )
    lora: LoRAConfig | None = Field(
        default=None, description="Low-rank adapters; None: every parameter trains."
    )

    @model_validator(mode="after")
    def _lora_needs_base(self) -> FinetuneConfig:
        if self.lora is not None and self.base is None:
            raise ValueError("finetune.lora needs finetune.base: adapters train on a base model")
        return self


class MegalithConfig(StrictModel):
    """The root of a recipe: one section per concern."""

    name: str = "megalith"
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)


def format_validation_error(
    error: ValidationError, source: str, names: dict[str, str] | None = None
) -> str:
    """One line per problem naming the dotted key; ``names`` shows a top-level key under the
    name its file uses (an HF config.json's ``num_hidden_layers`` for ``num_layers``)."""
    lines = [f"{source}: {error.error_count()} problem(s) in the configuration"]
    for item in error.errors()[:MAX_PROBLEMS_SHOWN]:
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        if names and item["loc"] and item["loc"][0] in names:
            key = f"{names[item['loc'][0]]} ({key})"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = _unknown_key_message(item["loc"])
        elif "input" in item and item["type"] != "missing":
            message = f"{message} (got {safe_read.brief(item['input'])})"
        lines.append(f"  {safe_read.clip(key, 120)}: {message}")
    if error.error_count() > MAX_PROBLEMS_SHOWN:
        lines.append(f"  ... and {error.error_count() - MAX_PROBLEMS_SHOWN} more")
    return "\n".join(lines)


def _unknown_key_message(loc: tuple) -> str:
    """ "unknown key", the nearest valid key when one is close, and the keys allowed."""
    allowed = keys_of_section(MegalithConfig, loc[:-1])
    if not allowed:
        return "unknown key"
    near = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
    section = "".join(f"{part}." for part in loc[:-1])
    hint = f" (did you mean {section}{near[0]}?)" if near else ""
    return f"unknown key{hint}; expected one of: {', '.join(allowed)}"


def keys_of_section(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys the section at ``loc`` accepts (empty when it cannot be told)."""
    for part in loc:
        if isinstance(part, int):  # an item of a list of sections
            continue
        field = model.model_fields.get(part)
        model = field and next(
            (
                t
                for t in _types_in(field.annotation)
                if isinstance(t, type) and issubclass(t, BaseModel)
            ),
            None,
        )
        if model is None:
            return []
    return list(model.model_fields)


def _types_in(annotation: Any):
    yield annotation
    for argument in get_args(annotation):
        yield from _types_in(argument)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (safe) so numbers and lists work."""
    if "=" not in text:
        raise ConfigError(f"--set {safe_read.brief(text)}: expected KEY=VALUE, e.g. data.workers=4")
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise ConfigError(f"--set {safe_read.brief(text)}: empty key")
    try:
        value = safe_read.loads_yaml(raw, f"--set {safe_read.brief(text)}") if raw.strip() else ""
    except safe_read.UnsafeFileError as exc:
        raise ConfigError(str(exc)) from None
    return path, value


def set_value(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: depth + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        try:
            set_value(tree, path, value)
        except ConfigError as exc:
            raise ConfigError(f"--set {safe_read.brief(text)}: {exc}") from None
    return tree


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        tree = safe_read.read_yaml(path)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except safe_read.UnsafeFileError as exc:
        raise ConfigError(str(exc)) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return tree


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    values: dict[str, Any] | None = None,
) -> MegalithConfig:
    """Load a YAML recipe, then apply ``--set key=value`` overrides, then explicit values.

    ``values`` maps dotted keys to Python values (what dedicated command-line flags set),
    so they need no YAML quoting.
    """
    tree = read_yaml(path) if path else {}
    tree = apply_overrides(tree, overrides or [])
    for key, value in (values or {}).items():
        set_value(tree, key.split("."), value)
    try:
        return MegalithConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path or "config"))) from None


def dump_config(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
