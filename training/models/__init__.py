"""The GPT model, its layer backends, FLOP counting and model packages."""

from training.models.backend import BackendError, LayerBackend, TorchBackend, resolve_backend
from training.models.gpt import GPTModel, KVCache

__all__ = [
    "BackendError",
    "GPTModel",
    "KVCache",
    "LayerBackend",
    "TorchBackend",
    "resolve_backend",
]
