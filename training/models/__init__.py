"""The GPT and T5 models, their layer backends, FLOP counting and model packages."""

from __future__ import annotations

from torch import nn

from megalith.config import ModelConfig
from megalith.errors import MegalithError
from training.models.backend import BackendError, LayerBackend, TorchBackend, resolve_backend
from training.models.gpt import GPTModel, KVCache
from training.models.t5 import T5Model

# The model class of each model.family. The rest of a family (data, loss, pipeline split,
# ...) is its spec in training.families, which sits above the modules that build a model
# from a config alone (checkpoints, parallel wrappers, packages): they look it up here.
MODEL_CLASSES: dict[str, type[GPTModel] | type[T5Model]] = {"gpt": GPTModel, "t5": T5Model}


def model_class(config: ModelConfig) -> type[GPTModel] | type[T5Model]:
    """The class of ``config.family``: :class:`GPTModel` (gpt) or :class:`T5Model` (t5)."""
    try:
        return MODEL_CLASSES[config.family]
    except KeyError:
        raise MegalithError(
            f"model.family {config.family!r} is not a known model family "
            f"(known: {', '.join(MODEL_CLASSES)})"
        ) from None


def build_model(config: ModelConfig, backend: LayerBackend | None = None) -> nn.Module:
    """The model of ``config.family``. Everything that builds a model for a config goes
    through here."""
    return model_class(config)(config, backend)


__all__ = [
    "MODEL_CLASSES",
    "BackendError",
    "GPTModel",
    "KVCache",
    "LayerBackend",
    "T5Model",
    "TorchBackend",
    "build_model",
    "model_class",
    "resolve_backend",
]
