"""A model config against the tensors a weights file holds, before any model is built.

Loaders (model packages, HF import) read a safetensors header (names and shapes, no
data) and ask :func:`config_mismatch` first: a config that says 1000 layers beside
weights for 2 is refused in the time it takes to count names, without building the
model on the meta device. The full comparison (every name, shape and dtype) against a
meta-device model follows; :func:`config_keys_for` names the config keys that size a
tensor, for its message.
"""

from __future__ import annotations

import re
from collections import defaultdict

from training.config import ModelConfig
from training.models import model_class

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
