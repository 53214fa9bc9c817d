"""The typed configuration tree shared by every stage.

One Pydantic model per section. The same classes are the YAML recipe schema, the
values behind ``--set key=value`` on the command line, and the parameters of the
Prefect flows (Prefect renders them as forms). Unknown keys are errors.

This module imports only Pydantic and PyYAML so that any stage can use it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from training.errors import MegalithError


class ConfigError(MegalithError, ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys and type mismatches are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DEFAULT_SPECIAL_TOKENS = [
    "<|eod|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]


class TokenizerConfig(StrictModel):
    """How to train (or where to find) the SentencePiece tokenizer."""

    model: str | None = Field(
        default=None,
        description="An existing SentencePiece .model file; when set, nothing is trained.",
    )
    output_prefix: str | None = Field(
        default=None,
        description="Where a trained model goes (PREFIX.model, PREFIX.vocab). "
        "Defaults to DATA_OUTPUT/tokenizer.",
    )
    model_type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = Field(default=8000, ge=64, le=1_048_576)
    pad_vocab_multiple: int = Field(
        default=128,
        ge=1,
        description="The model's embedding table is padded to a multiple of this.",
    )
    byte_fallback: bool = True
    character_coverage: float = Field(default=0.9995, gt=0.0, le=1.0)
    special_tokens: list[str] = Field(default_factory=lambda: list(DEFAULT_SPECIAL_TOKENS))
    max_training_documents: int = Field(
        default=200_000,
        ge=1,
        description="Sampling cap: at most this many documents (reservoir-sampled) train the model.",
    )
    max_sentence_length: int = Field(default=16384, ge=16)
    seed: int = 1234


class DatasetSource(StrictModel):
    """One shard set in a training blend."""

    path: str
    weight: float = Field(default=1.0, gt=0.0)


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
    workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1)
    shards: int = Field(default=1, ge=1)
    on_bad_record: Literal["fail", "skip"] = "fail"
    max_bad_examples: int = Field(default=20, ge=0)
    append_eod: bool = True
    batch_documents: int = Field(default=512, ge=1, description="Documents per worker batch.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (e.g. endpoint_url for S3)."
    )

    # Training-time dataset.
    blend: list[DatasetSource] = Field(
        default_factory=list,
        description="Shard sets to train on with weights; defaults to [output].",
    )
    split: tuple[float, float, float] = Field(
        default=(0.98, 0.01, 0.01), description="train/valid/test shares, by document."
    )
    seq_length: int = Field(default=1024, ge=8)
    seed: int = 1234
    cache_dir: str | None = Field(
        default=None,
        description="Where sample indices are cached; defaults to beside local data, "
        "or ~/.cache/megalith for remote data.",
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


class MegalithConfig(StrictModel):
    """The root of a recipe. Later stages add their sections here."""

    name: str = "megalith"
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"{source}: {error.error_count()} problem(s) in the configuration"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in item and item["type"] != "missing":
            message = f"{message} (got {item['input']!r})"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (safe) so numbers and lists work."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. data.workers=4")
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from exc
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
            raise ConfigError(f"--set {text!r}: {exc}") from None
    return tree


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
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
