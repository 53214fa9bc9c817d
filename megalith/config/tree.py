"""The root of a recipe (``MegalithConfig``) and how one is read: YAML, ``--set`` overrides,
explicit values, and errors that name the key."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
)

from megalith import safe_read
from megalith.config.base import MAX_PROBLEMS_SHOWN, ConfigError, StrictModel, types_in
from megalith.config.data import DataConfig, TokenizerConfig
from megalith.config.model import ModelConfig
from megalith.config.run import (
    CheckpointConfig,
    FinetuneConfig,
    LoggingConfig,
    MixedPrecisionConfig,
    OptimizerConfig,
    ParallelConfig,
    PromotionConfig,
    SchedulerConfig,
    TrainingConfig,
)


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
                for t in types_in(field.annotation)
                if isinstance(t, type) and issubclass(t, BaseModel)
            ),
            None,
        )
        if model is None:
            return []
    return list(model.model_fields)


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
