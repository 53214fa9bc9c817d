"""The GPT and T5 models, their layer backends, FLOP counting and model packages."""

from __future__ import annotations

from torch import nn

from training.config import ModelConfig
from training.models.backend import BackendError, LayerBackend, TorchBackend, resolve_backend
from training.models.gpt import GPTModel, KVCache
from training.models.t5 import T5Model


def model_class(config: ModelConfig) -> type[GPTModel] | type[T5Model]:
    """The class of ``config.family``: :class:`GPTModel` (gpt) or :class:`T5Model` (t5)."""
    return T5Model if config.family == "t5" else GPTModel


def build_model(config: ModelConfig, backend: LayerBackend | None = None) -> nn.Module:
    """The model of ``config.family``. Everything that builds a model for a config goes
    through here."""
    return model_class(config)(config, backend)


__all__ = [
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
