"""``megalith export megatron``: a model package as a Megatron-LM GPT checkpoint.

Writes ``OUT/latest_checkpointed_iteration.txt`` ("release") and ``OUT/release/`` in
Megatron-LM's ``torch_dist`` format (PyTorch DCP ``.metadata`` + ``.distcp``, layers
stacked along dim 0 under ``decoder.layers.*`` as megatron-core's sharded state dict names
them, ``common.pt`` with ``args``, ``metadata.json``) or its legacy ``torch`` format
(``release/mp_rank_00/model_optim_rng.pt``, TP=1 and PP=1). torch_dist is resharded by
Megatron on load, so any TP/PP size can read it; the legacy format only at TP=1, PP=1.

Names follow :mod:`training.interop.megatron`'s table in reverse. torch_dist keys are the
same for both layer specs (norms as ``linear_qkv.layer_norm_weight``, which the local spec
maps to its ``input_layernorm``); the legacy format's depend on ``--transformer-impl``:
local (``input_layernorm``/``pre_mlp_layernorm``, what runs without Transformer Engine) or
transformer_engine (Megatron-LM's default: norms fused into ``linear_qkv``/``linear_fc1``). ``args`` carries
the flags that rebuild the architecture (``--use-checkpoint-args``).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megalith.config import ModelConfig
from training.interop.megatron import (
    COMMON_FILE,
    GLOBAL_NAMES,
    LAYER_NAMES,
    RANK_FILE,
    TRACKER_FILE,
    MegatronImportError,
)
from training.models import GPTModel, model_class
from training.models.package import load_model_package

Impl = Literal["local", "transformer_engine"]
Format = Literal["torch_dist", "torch"]
RELEASE = "release"
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# Our name (within a layer) -> megatron-core's, per layer spec; norms differ only.
_FUSED_NORMS = {
    "attention.qkv.norm": "self_attention.linear_qkv.layer_norm_",
    "mlp.fc1.norm": "mlp.linear_fc1.layer_norm_",
}
_LOCAL_NORMS = {"attention.qkv.norm": "input_layernorm.", "mlp.fc1.norm": "pre_mlp_layernorm."}
# Linears whose (inert, None) _extra_state megatron-core's state dict holds.
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")
_MLP_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")


class _PackedBytesPlanner(dcp.DefaultSavePlanner):
    """Writes BytesIO values as they are (megatron-core's MCoreSavePlanner does the same);
    DCP's default would pickle the BytesIO object itself."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


class MegatronExportError(MegatronImportError):
    """A model package Megatron-LM's GPT cannot represent; says why."""


def _layer_name(ours: str, impl: Impl) -> str:
    """Megatron-core's name (within a layer) for ours (within a layer)."""
    for prefix, theirs in (_FUSED_NORMS if impl == "transformer_engine" else _LOCAL_NORMS).items():
        if ours.startswith(prefix + "."):
            return theirs + ours.removeprefix(prefix + ".")
    reverse = {v: k for k, v in LAYER_NAMES.items() if "layernorm" not in k and "norm_" not in k}
    return reverse[ours]


def check_exportable(config: ModelConfig) -> None:
    """Refuse what megatron-core's GPTModel does not compute as our model does."""
    if model_class(config) is not GPTModel:  # the names below are GPTModel's
        raise MegatronExportError(f"model.family {config.family}: only gpt models export")
    if config.num_experts:
        raise MegatronExportError("MoE models are not exported to Megatron (yet)")
    if config.activation == "gelu" and config.gelu_approximation == "tanh" and not config.bias:
        raise MegatronExportError(
            "tanh GELU without biases: megatron-core uses tanh only in its fused bias-GELU, "
            "which needs --add-bias-linear"
        )


def megatron_args(config: ModelConfig, impl: Impl, dtype: torch.dtype) -> argparse.Namespace:
    """The Megatron-LM flags of this architecture, as its argument parser names them."""
    gelu_erf = config.activation == "gelu" and config.gelu_approximation == "none"
    scaling = config.rope_scaling
    return argparse.Namespace(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.ffn_hidden_size,
        padded_vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        seq_length=config.max_position_embeddings,
        normalization="RMSNorm" if config.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=config.norm_eps,
        swiglu=config.activation == "swiglu",
        bias_gelu_fusion=config.activation == "gelu" and not gelu_erf and config.bias,
        position_embedding_type="rope"
        if config.position_embedding == "rope"
        else "learned_absolute",
        rotary_base=config.rope_base,
        rotary_percent=1.0,
        use_rope_scaling=scaling is not None,
        no_rope_freq=[int(i in config.nope_layers) for i in range(config.num_layers)]
        if config.nope_layers
        else None,
        rope_scaling_factor=scaling.factor if scaling else 8.0,
        add_bias_linear=config.bias,
        add_qkv_bias=config.bias,
        untie_embeddings_and_output_weights=not config.tie_embeddings,
        init_method_std=config.init_std,
        hidden_dropout=config.dropout,
        attention_dropout=config.dropout,
        fp32_residual_connection=config.fp32_residual,
        params_dtype=dtype,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        transformer_impl=impl,
    )


def megatron_state(model: torch.nn.Module, config: ModelConfig, impl: Impl) -> dict[str, Tensor]:
    """megatron-core's TP=1 state dict names for our tensors (tied output left out)."""
    reverse_global = {v: k for k, v in GLOBAL_NAMES.items()}
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in model.tied_weights:
            continue
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            out[f"decoder.layers.{index}.{_layer_name(rest, impl)}"] = tensor
        elif name in reverse_global:
            out[reverse_global[name]] = tensor
        else:
            raise MegatronExportError(f"{name} has no megatron-core counterpart")
    return out


def _extra_state_names(config: ModelConfig, impl: Impl) -> list[str]:
    """The linears' _extra_state entries megatron-core's state dict holds (values None)."""
    names = [f"decoder.layers.{i}.{n}._extra_state" for i in range(config.num_layers)
             for n in _LINEARS + _MLP_LINEARS]  # fmt: skip
    return names + ["output_layer._extra_state"]


def _common(config: ModelConfig, impl: Impl, dtype: torch.dtype) -> dict:
    return {
        "args": megatron_args(config, impl, dtype),
        "checkpoint_version": 3.0,
        "iteration": 0,
        "num_floating_point_operations_so_far": 0,
    }


def _write_torch_dist(directory: Path, state: dict[str, Tensor], config: ModelConfig,
                      impl: Impl, dtype: torch.dtype) -> None:  # fmt: skip
    """Layers stacked along dim 0 (megatron-core's sharded keys), DCP on one process."""
    layers = config.num_layers
    stacked: dict[str, object] = {}
    for name, tensor in state.items():
        if name.startswith("decoder.layers.0."):
            rest = name.removeprefix("decoder.layers.0.")
            parts = [state[f"decoder.layers.{i}.{rest}"] for i in range(layers)]
            stacked[f"decoder.layers.{rest}"] = torch.stack(parts).contiguous()
        elif not name.startswith("decoder.layers."):
            stacked[name] = tensor.contiguous()
    none = io.BytesIO()
    torch.save([None], none)  # megatron-core saves a ShardedObject as torch.save([data])
    for name in _extra_state_names(config, impl):  # key/shard_<offset>_<shape>
        if name.startswith("decoder.layers."):
            index, rest = name.removeprefix("decoder.layers.").split(".", 1)
            stacked[f"decoder.layers.{rest}/shard_{index}_{layers}"] = io.BytesIO(none.getvalue())
    writer = dcp.FileSystemWriter(str(directory))
    dcp.save(stacked, storage_writer=writer, planner=_PackedBytesPlanner(), no_dist=True)
    torch.save(_common(config, impl, dtype), directory / COMMON_FILE)
    (directory / "metadata.json").write_text(json.dumps(METADATA_JSON))


def export_megatron(
    package: str | Path,
    out_dir: str | Path,
    *,
    ckpt_format: Format = "torch_dist",
    transformer_impl: Impl = "transformer_engine",
    overwrite: bool = False,
) -> Path:
    """Write ``package`` as a Megatron-LM checkpoint directory at ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise MegatronExportError(f"{out_dir} exists and is not empty (--overwrite replaces it)")
    model, config, _ = load_model_package(package)
    check_exportable(config)
    dtype = model.embedding.word.weight.dtype
    # megatron-core's sharded state dict (torch_dist) names the local spec's norms as the
    # Transformer Engine spec's (its sharded_state_dict_keys_map), so both specs load it.
    names = "transformer_engine" if ckpt_format == "torch_dist" else transformer_impl
    state = megatron_state(model, config, names)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    release = tmp / RELEASE
    if ckpt_format == "torch_dist":
        release.mkdir(parents=True)
        _write_torch_dist(release, state, config, transformer_impl, dtype)
    else:
        (release / "mp_rank_00").mkdir(parents=True)
        model_state = {**state, **dict.fromkeys(_extra_state_names(config, transformer_impl))}
        torch.save(
            {**_common(config, transformer_impl, dtype), "model": model_state},
            release / "mp_rank_00" / RANK_FILE,
        )
    (tmp / TRACKER_FILE).write_text(RELEASE)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
