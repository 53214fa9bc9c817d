"""The GPT and T5 models, their layer backends, FLOP counting and model packages."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megalith.config import ModelConfig
from megalith.errors import MegalithError
from training.models.backend import (
    BACKENDS,
    BackendError,
    LayerBackend,
    TorchBackend,
    backend_name,
    kernel_backend_name,
    resolve_backend,
    slow_backend_warning,
)
from training.models.gpt import GPTModel, KVCache
from training.models.meta import shapes_only
from training.models.t5 import T5Model
from training.models.te_backend import TransformerEngineBackend

BACKENDS["te"] = TransformerEngineBackend  # imports transformer_engine only when used

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


def meta_model(config: ModelConfig, backend: LayerBackend | None = None) -> nn.Module:
    """The model of ``config`` on the meta device: names, shapes and dtypes, nothing run
    to initialise it (:mod:`training.models.meta`)."""
    with shapes_only():
        return build_model(config, backend)


def model_from_tensors(
    config: ModelConfig, params: dict[str, Tensor], buffers: dict[str, Tensor]
) -> nn.Module:
    """A plain single-device model of ``config.family`` on CPU holding ``params`` and
    ``buffers`` (whole tensors, single-process names): what the parallel layouts gather
    for checkpoints and the model package. Built on the meta device, so nothing is
    initialised twice."""
    model = meta_model(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(params[name])
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    return model


__all__ = [
    "model_from_tensors",
    "MODEL_CLASSES",
    "BackendError",
    "GPTModel",
    "KVCache",
    "LayerBackend",
    "T5Model",
    "TorchBackend",
    "build_model",
    "model_class",
    "backend_name",
    "kernel_backend_name",
    "resolve_backend",
    "slow_backend_warning",
]
