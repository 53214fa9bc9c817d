"""What every config section shares: the bounds on sizes, the error, the strict base model."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)

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
            if not any(t in (bool, Any) for t in types_in(annotation)):
                raise ValueError("expected a number or text, not a boolean")
        return value


def types_in(annotation: Any):
    """``annotation`` and every type inside it (``X | None``, ``dict[K, V]``, ...)."""
    yield annotation
    for argument in get_args(annotation):
        yield from types_in(argument)
