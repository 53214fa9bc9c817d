"""A model config against the tensors a weights file holds, before any model is built.

Loaders read a safetensors header (names and shapes, no data) or hold whole tensors
whose sizes the file bounded, and call :func:`checked_meta_model` before they build or
allocate anything from the config: first :func:`config_mismatch` (block counts and the
embedding, in the time it takes to count names: a config of 1000 layers beside weights
for 2 never builds 1000 layers), then every name and shape against the model built on
the meta device (no memory). Messages name the tensor and the config keys that size it.
"""

from __future__ import annotations

import re
from collections import defaultdict

from torch import nn

from megalith.config import ModelConfig
from megalith.errors import MegalithError
from training.models import meta_model, model_class

_BLOCK = re.compile(r"^(?P<stack>(?:[\w.]+\.)?layers)\.(?P<index>\d+)\.")

# Fragments of a tensor name -> the config keys that size it; the first match wins.
_KEYS_BY_NAME = (
    ("embedding.word", ("vocab_size", "hidden_size")),
    ("embedding.position", ("max_position_embeddings", "hidden_size")),
    ("norm.", ("hidden_size",)),
    ("relative_bias", ("relative_attention_num_buckets", "num_attention_heads")),
    ("router", ("num_experts", "hidden_size")),
    ("experts", ("num_experts", "moe_ffn_hidden_size", "hidden_size")),
    ("qkv", ("hidden_size", "num_attention_heads", "num_query_groups")),
    ("attention", ("hidden_size", "num_attention_heads")),
    ("fc1", ("ffn_hidden_size", "hidden_size")),
    ("fc2", ("ffn_hidden_size", "hidden_size")),
    ("output", ("vocab_size", "hidden_size")),
)


class WeightsMismatchError(MegalithError):
    """Weights whose tensor names or shapes are not those of the model a config describes."""


def checked_meta_model(config: ModelConfig, shapes: dict[str, list[int]], source: str) -> nn.Module:
    """``config``'s model on the meta device, once ``shapes`` (``{name: shape}`` of the
    weights, tied aliases left out) are exactly its tensors; else
    :class:`WeightsMismatchError` naming ``source``, the tensor and the config keys."""
    problem = config_mismatch(config, shapes)
    if problem:
        raise WeightsMismatchError(
            f"{source}: the config does not describe these weights: {problem}"
        )
    model = meta_model(config)
    expected = {
        name: list(tensor.shape)
        for name, tensor in model.state_dict().items()
        if name not in model.tied_weights
    }
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise WeightsMismatchError(
            f"{source}: tensor names do not match the model the config describes: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for name, shape in expected.items():
        if list(shapes[name]) != shape:
            keys = config_keys_for(name)
            raise WeightsMismatchError(
                f"{source}: tensor {name} is {list(shapes[name])}, the config needs {shape}"
                + (f" (check {keys})" if keys else "")
            )
    return model


def config_mismatch(config: ModelConfig, shapes: dict[str, list[int]]) -> str | None:
    """Why the tensors ``shapes`` (state-dict names, ours) cannot be ``config``'s model,
    naming the config key; None when the block counts and the embedding agree."""
    indices: dict[str, set[int]] = defaultdict(set)
    for name in shapes:
        match = _BLOCK.match(name)
        if match:
            indices[match["stack"]].add(int(match["index"]))
    for stack, (key, count) in model_class(config).layer_stacks(config).items():
        found = indices.get(stack, set())
        if found != set(range(count)):
            held = f"blocks {_span(found)}" if found else "no blocks"
            return f"model.{key} is {count}, the weights hold {held} under {stack}.*"
    embedding = shapes.get("embedding.word.weight")
    if embedding is not None:
        for key, size in zip(("vocab_size", "hidden_size"), embedding, strict=False):
            if size != getattr(config, key):
                return (
                    f"model.{key} is {getattr(config, key)}, the weights' "
                    f"embedding.word.weight is {embedding}"
                )
    return None


def config_keys_for(tensor_name: str) -> str:
    """The config keys that size ``tensor_name``, as ``model.a, model.b`` (empty if unknown)."""
    for fragment, keys in _KEYS_BY_NAME:
        if fragment in tensor_name:
            return ", ".join(f"model.{key}" for key in keys)
    return ""


def _span(indices: set[int]) -> str:
    low, high = min(indices), max(indices)
    return f"{low}..{high}" if len(indices) == high - low + 1 else f"{sorted(indices)[:5]} ..."
