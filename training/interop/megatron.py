"""Import a Megatron-LM GPT checkpoint (``torch_dist`` or legacy ``torch``) as a model package.

``--ckpt-format torch_dist`` (Megatron-LM's default): ``iter_N/.metadata`` (PyTorch DCP
metadata, read by :mod:`training.interop.dcp` without unpickling anything but DCP's
dataclasses), ``__R_K.distcp`` (the tensors, global: every TP shard and PP stage in place,
layers stacked along dim 0) and ``common.pt`` (``args``; read like a rank file below).

Layout Megatron-LM writes with ``--ckpt-format torch``::

    CKPT_DIR/latest_checkpointed_iteration.txt      "100" or "release"
    CKPT_DIR/iter_0000100/mp_rank_00/model_optim_rng.pt          TP rank 0 (no PP)
    CKPT_DIR/iter_0000100/mp_rank_01_002/model_optim_rng.pt      TP rank 1, PP stage 2

Each ``.pt`` is a ``torch.save`` pickle of ``{"model": state dict, "args": Namespace,
"checkpoint_version", "iteration", "optimizer", "rng_state", ...}``. Unpickling it
with plain ``torch.load`` runs whatever code the file names: the class of bug behind
CVE-2025-23264/23265 and CVE-2026-24150/24152. Here it is read only by
``torch.load(weights_only=True)``, whose unpickler constructs nothing but tensors,
plain containers and an explicit allow-list:

- ``argparse.Namespace`` (the ``args``) and what real runs put in it:
  ``types.SimpleNamespace``, ``signal.Signals`` (``exit_signal``), ``pathlib.PosixPath``,
  the real classes (each only holds a value; Megatron-Core's safe_globals.py lists them);
- names under ``megatron.``, ``numpy.`` and ``_io.BytesIO`` (Megatron's enums in
  ``args``, numpy's RNG state, Transformer Engine's ``_extra_state``) are bound to
  :class:`Opaque`, an inert stand-in that records its arguments; no Megatron or numpy
  code runs, and those values are never used;
- any other global makes the import fail before unpickling, naming every such global
  (found by ``torch.serialization.get_unsafe_globals_in_checkpoint``, which reads the
  pickle's opcodes without executing them).

Only ``model`` tensors and a few ``args`` fields are used. Megatron-core names map to
ours as below; tensor-parallel shards are concatenated (column-parallel along rows,
row-parallel along columns, SwiGLU's fc1 as ``[gate_0..gate_t; up_0..up_t]``), and
pipeline stages renumber their local layers after the earlier stages' (so uneven splits
need no arithmetic). Megatron's QKV rows use the grouped layout
ours does (per KV group: its query heads, then k, then v), so QKV is copied as is.

==============================================  ====================================
Megatron-core (``decoder.layers.N.``)          ours (``layers.N.``)
==============================================  ====================================
embedding.word_embeddings.weight                embedding.word.weight
embedding.position_embeddings.weight            embedding.position.weight
self_attention.linear_qkv.layer_norm_weight     attention.qkv.norm.weight
  (local spec: input_layernorm.weight)
self_attention.linear_qkv.{weight,bias}         attention.qkv.linear.{weight,bias}
self_attention.linear_proj.{weight,bias}        attention.proj.{weight,bias}
mlp.linear_fc1.layer_norm_weight                mlp.fc1.norm.weight
  (local spec: pre_mlp_layernorm.weight)
mlp.linear_fc1.{weight,bias}                    mlp.fc1.linear.{weight,bias}
mlp.linear_fc2.{weight,bias}                    mlp.fc2.{weight,bias}
decoder.final_layernorm.weight                  final_norm.weight
output_layer.weight                             output.weight (absent when tied)
==============================================  ====================================

(``*_layernorm.bias`` / ``layer_norm_bias`` follow their weights for LayerNorm models.)

GELU follows megatron-core (not ``--openai-gelu``, which only its legacy models read): tanh
when ``--bias-gelu-fusion`` is on with biases, exact erf otherwise. ``--use-rope-scaling``
becomes Llama 3 RoPE scaling (``model.rope_scaling``).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import signal
import types
import zipfile
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError
from torch import Tensor

from megalith.config import ModelConfig, RopeScaling, format_validation_error
from megalith.errors import MegalithError
from preprocessing.tokenizer import TokenizerError, load_tokenizer
from training.interop.dcp import DcpError, read_tensors
from training.models.package import DTYPES, save_model_package
from training.models.weights_check import checked_meta_model

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
COMMON_FILE = "common.pt"  # torch_dist: the non-sharded state (args, iteration, ...)
# Inert classes a real run's ``args`` carry, constructed as themselves (Megatron-Core's own
# safe_globals.py lists them too): a signal number, a path, a bag of attributes.
SAFE_CLASSES: dict[str, type] = {
    "argparse.Namespace": argparse.Namespace,
    "types.SimpleNamespace": types.SimpleNamespace,
    "signal.Signals": signal.Signals,
    "pathlib.PosixPath": pathlib.PosixPath,
    "pathlib._local.PosixPath": pathlib.PosixPath,  # its module since Python 3.13
}
# Globals bound to the inert Opaque stand-in (prefixes of "module.qualname").
OPAQUE_PREFIXES = ("megatron.", "numpy.", "_io.BytesIO")
GeluChoice = Literal["tanh", "erf"]


class MegatronImportError(MegalithError):
    """A Megatron-LM checkpoint that cannot be imported safely; names the file and reason."""


class Opaque:
    """Inert stand-in for an allow-listed global that must not run: records its arguments."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


# --------------------------------------------------------------------------- files


def iteration_dir(ckpt_dir: Path) -> Path:
    """The iteration directory: CKPT_DIR/iter_N from the tracker file, or CKPT_DIR itself."""
    if not ckpt_dir.is_dir():
        raise MegatronImportError(f"{ckpt_dir} is not a directory")
    tracker = ckpt_dir / TRACKER_FILE
    if tracker.is_file():
        if tracker.stat().st_size > 64:
            raise MegatronImportError(f"{tracker}: too large for an iteration number")
        text = tracker.read_text(encoding="utf-8", errors="replace").strip()
        if text == "release":
            name = "release"
        elif text.isdigit():
            name = f"iter_{int(text):07d}"
        else:
            raise MegatronImportError(f"{tracker}: expected an iteration number, got {text!r}")
        path = ckpt_dir / name
        if not path.is_dir() or path.is_symlink():
            raise MegatronImportError(f"{path} (named by {tracker}) is not a directory")
        return path
    return ckpt_dir


def is_torch_dist(iter_dir: Path) -> bool:
    """Whether ``iter_dir`` holds a torch_dist (PyTorch DCP) checkpoint."""
    return (iter_dir / ".metadata").is_file() and (iter_dir / COMMON_FILE).is_file()


def rank_files(iter_dir: Path) -> list[list[Path]]:
    """``files[pp][tp]``: each rank's ``model_optim_rng.pt``, checked to form a full grid."""
    grid: dict[tuple[int, int], Path] = {}
    for sub in iter_dir.iterdir():
        match = RANK_DIR.fullmatch(sub.name)
        if not match:
            continue
        file = sub / RANK_FILE
        if sub.is_symlink() or file.is_symlink() or not file.is_file():
            raise MegatronImportError(f"{file}: missing or not a plain file")
        grid[(int(match[2] or 0), int(match[1]))] = file
    if not grid:
        raise MegatronImportError(
            f"{iter_dir}: neither mp_rank_XX/{RANK_FILE} (--ckpt-format torch) nor .metadata and "
            f"{COMMON_FILE} (torch_dist): not a Megatron-LM checkpoint"
        )
    pp, tp = max(k[0] for k in grid) + 1, max(k[1] for k in grid) + 1
    missing = [f"tp{t}/pp{p}" for p in range(pp) for t in range(tp) if (p, t) not in grid]
    if missing:
        raise MegatronImportError(f"{iter_dir}: rank files missing for {missing}")
    return [[grid[(p, t)] for t in range(tp)] for p in range(pp)]


def load_torch_file(path: Path, *, model: bool = True) -> dict[str, Any]:
    """A ``torch.save`` file of Megatron-LM's (a rank's ``model_optim_rng.pt``, torch_dist's
    ``common.pt``) through ``torch.load(weights_only=True)`` and the allow-list; with
    ``model``, checks it holds a ``model`` state dict of tensors."""
    if path.is_symlink() or not zipfile.is_zipfile(path):
        raise MegatronImportError(
            f"{path}: not a torch.save zip archive (the pre-1.6 format is not read)"
        )
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as exc:  # a malformed archive or pickle stream
        raise MegatronImportError(f"{path}: cannot inspect its pickle: {exc}") from None
    refused = sorted(
        n for n in names if n not in SAFE_CLASSES and not n.startswith(OPAQUE_PREFIXES)
    )
    if refused:
        raise MegatronImportError(
            f"{path}: names globals outside the allow-list, so it is not loaded: {refused}. "
            f"Only tensors, plain containers, {sorted(set(SAFE_CLASSES))} and (as inert "
            f"placeholders) {list(OPAQUE_PREFIXES)} are accepted"
        )
    allowed = [(SAFE_CLASSES[n], n) for n in names if n in SAFE_CLASSES]
    allowed += [(Opaque, n) for n in names if n.startswith(OPAQUE_PREFIXES)]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # weights_only refuses anything else
        raise MegatronImportError(
            f"{path}: cannot be loaded with weights_only=True: {exc}"
        ) from None
    if not isinstance(state, dict):
        raise MegatronImportError(f"{path}: holds a {type(state).__name__}, not a dict")
    if model:
        _check_model_state(path, state)
    return state


def _check_model_state(path: Path, state: dict[str, Any]) -> None:
    if not isinstance(state.get("model"), dict):
        hint = " (virtual pipeline stages model0, model1, ... are not supported)"
        raise MegatronImportError(
            f"{path}: expected a dict with a 'model' state dict, found {sorted(state)[:8]}"
            + (hint if "model0" in state else "")
        )
    for name, value in state["model"].items():
        if name.endswith("._extra_state"):
            continue
        if not isinstance(value, Tensor):
            raise MegatronImportError(
                f"{path}: model entry {name} is a {type(value).__name__}, not a tensor"
            )


# --------------------------------------------------------------------------- config


def model_config_from_args(
    args: Any, source: Path, *, gelu: GeluChoice | None = None
) -> ModelConfig:
    """Our ModelConfig from Megatron-LM's ``args``; refuses what we do not compute exactly,
    naming Megatron-LM's flags. ``gelu`` overrides the GELU that the args imply."""
    if not isinstance(args, argparse.Namespace):
        raise MegatronImportError(f"{source}: 'args' is not an argparse.Namespace")
    a = vars(args)

    def get(key: str, default: Any = ...) -> Any:
        if key not in a and default is ...:
            raise MegatronImportError(f"{source}: args.{key} is missing")
        return a.get(key, default)

    def need(key: str, wanted: Any, default: Any) -> None:
        if get(key, default) != wanted:
            flag = "--" + key.replace("_", "-")
            raise MegatronImportError(
                f"{source}: {flag} {get(key, default)!r} (args.{key}) is not supported "
                f"(only {wanted!r})"
            )

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    for key, wanted, default in (
        ("qk_layernorm", False, False),
        ("rotary_interleaved", False, False),
        ("rotary_percent", 1.0, 1.0),
        ("num_experts", None, None),
        ("apply_layernorm_1p", False, False),
        ("squared_relu", False, False),
        ("quick_geglu", False, False),
        ("add_qkv_bias", get("add_bias_linear", True), get("add_bias_linear", True)),
        ("kv_channels", hidden // heads, hidden // heads),
        ("virtual_pipeline_model_parallel_size", None, None),
        ("num_layers_per_virtual_pipeline_stage", None, None),
        ("mtp_num_layers", None, None),
        ("multi_latent_attention", False, False),
        ("heterogeneous_layers_config_path", None, None),
    ):
        need(key, wanted, default)
    swiglu = get("swiglu", False)
    position = get("position_embedding_type", "learned_absolute")
    if position not in ("rope", "learned_absolute"):
        raise MegatronImportError(
            f"{source}: --position-embedding-type {position!r} is not supported"
        )
    normalization = get("normalization", "LayerNorm")
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise MegatronImportError(f"{source}: --normalization {normalization!r} not supported")
    groups = get("num_query_groups", None) if get("group_query_attention", False) else None
    values = {
        "style": "llama" if swiglu else "gpt2",
        "num_layers": get("num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups or heads,
        "ffn_hidden_size": get("ffn_hidden_size"),
        "vocab_size": get("padded_vocab_size"),
        "max_position_embeddings": get("max_position_embeddings"),
        "normalization": normalization.lower(),
        "activation": "swiglu" if swiglu else "gelu",
        "position_embedding": "rope" if position == "rope" else "learned",
        "bias": get("add_bias_linear", True),
        "tie_embeddings": not get("untie_embeddings_and_output_weights", False),
        "rope_base": float(get("rotary_base", 10000)),
        "rope_scaling": rope_scaling_from_args(a, source) if position == "rope" else None,
        "nope_layers": nope_layers_from_args(a, source),
        "norm_eps": get("norm_epsilon", 1e-5),
        "init_std": get("init_method_std", 0.02),
        "dropout": get("hidden_dropout", 0.0),
        "fp32_residual": get("fp32_residual_connection", False),
        "backend": "torch",
    }
    if not swiglu:
        values["gelu_approximation"] = (
            "none" if gelu_from_args(a, source, gelu) == "erf" else "tanh"
        )
    try:
        return ModelConfig(**values)
    except ValidationError as exc:
        raise MegatronImportError(format_validation_error(exc, f"{source}: args")) from None


def gelu_from_args(a: dict[str, Any], source: Path, override: GeluChoice | None) -> GeluChoice:
    """Megatron-Core's GELU: its fused bias-GELU (the tanh approximation) when
    ``--bias-gelu-fusion`` (the default) is on and the linears have biases, exact erf GELU
    otherwise. ``--openai-gelu`` only affects Megatron-LM's legacy models, not mcore's."""
    if override is not None:
        return override
    if "bias_gelu_fusion" not in a:
        raise MegatronImportError(
            f"{source}: args carry no bias_gelu_fusion (a converted checkpoint?), so whether the "
            "model used tanh or erf GELU is unknown: pass --gelu tanh (Megatron-Core's fused "
            "bias-GELU, the default of a run with biases) or --gelu erf"
        )
    fused = a["bias_gelu_fusion"] and a.get("add_bias_linear", True)
    return "tanh" if fused else "erf"


def nope_layers_from_args(a: dict[str, Any], source: Path) -> list[int]:
    """``--no-rope-freq``: N (every N-th layer, the last of each N, skips RoPE) or megatron-
    core's per-layer 0/1 list, as our 0-based layer indices."""
    value, layers = a.get("no_rope_freq"), a.get("num_layers")
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        pattern = ([0] * (value - 1) + [1]) * (layers // value)
    elif isinstance(value, list) and all(v in (0, 1) for v in value):
        pattern = value
    else:
        raise MegatronImportError(f"{source}: --no-rope-freq {value!r} is not understood")
    if len(pattern) != layers:
        raise MegatronImportError(
            f"{source}: --no-rope-freq {value!r} does not cover the {layers} layers"
        )
    return [i for i, skip in enumerate(pattern) if skip]


def rope_scaling_from_args(a: dict[str, Any], source: Path) -> RopeScaling | None:
    """``--use-rope-scaling``: Llama 3 scaling as Megatron-Core's RotaryEmbedding applies it.
    Megatron-LM's gpt_builder does not pass ``--rope-scaling-factor`` to GPTModel (whose
    default factor is 8), so any other value is ambiguous and refused."""
    if not a.get("use_rope_scaling", False):
        return None
    factor = float(a.get("rope_scaling_factor", 8.0))
    if factor != 8.0:
        raise MegatronImportError(
            f"{source}: --rope-scaling-factor {factor}: Megatron-LM's gpt_builder ignores it "
            "(GPTModel applies 8.0), so which factor the model used is unknown"
        )
    return RopeScaling(factor=8.0)


# --------------------------------------------------------------------------- tensors

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Megatron-core name (within a layer) -> ours (within a layer), for both layer specs.
LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "attention.qkv.norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "attention.qkv.norm.bias",
    "input_layernorm.weight": "attention.qkv.norm.weight",
    "input_layernorm.bias": "attention.qkv.norm.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.linear.weight",
    "self_attention.linear_qkv.bias": "attention.qkv.linear.bias",
    "self_attention.linear_proj.weight": "attention.proj.weight",
    "self_attention.linear_proj.bias": "attention.proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "mlp.fc1.norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "mlp.fc1.norm.bias",
    "pre_mlp_layernorm.weight": "mlp.fc1.norm.weight",
    "pre_mlp_layernorm.bias": "mlp.fc1.norm.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.linear.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.linear.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}
GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "embedding.word.weight",
    "embedding.position_embeddings.weight": "embedding.position.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output.weight",
}
# How TP shards of our tensor combine: dim 0 (column-parallel / vocab), dim 1 (row-parallel).
_ROWS = ("embedding.word.weight", "output.weight", "qkv.linear.", "fc1.linear.")
_COLUMNS = ("attention.proj.weight", "mlp.fc2.weight")


def our_name(name: str, layer_offset: int) -> str | None:
    """Our name for a Megatron-core name in a stage whose first layer is ``layer_offset``."""
    if name.endswith("._extra_state") or name.endswith("rotary_pos_emb.inv_freq"):
        return None
    match = _LAYER.fullmatch(name)
    if match and match[2] in LAYER_NAMES:
        return f"layers.{int(match[1]) + layer_offset}.{LAYER_NAMES[match[2]]}"
    return GLOBAL_NAMES.get(name, "")


def merge_tp(name: str, shards: list[Tensor], gated: bool) -> Tensor:
    """Our whole tensor from its tensor-parallel shards (Megatron's rank order)."""
    if len(shards) == 1:
        return shards[0]
    if gated and "fc1.linear." in name:  # each rank holds [gate_r; up_r]
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if any(key in name for key in _ROWS):
        return torch.cat(shards, dim=0)
    if any(name.endswith(key) for key in _COLUMNS):
        return torch.cat(shards, dim=1)
    return shards[0]  # replicated: norms, row-parallel biases, position embeddings


def _layer_count(names: set[str]) -> int:
    return len({m[1] for m in map(_LAYER.fullmatch, names) if m})


def _check_layers(config: ModelConfig, found: int, source: Path) -> None:
    if found != config.num_layers:
        raise MegatronImportError(
            f"{source}: the checkpoint holds {found} transformer layers, args.num_layers is "
            f"{config.num_layers}"
        )


def legacy_tensors(
    files: list[list[Path]], gelu: GeluChoice | None = None
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A ``--ckpt-format torch`` checkpoint's config and our tensors (tied aliases left out).
    Each stage's layers follow those of the stages before it, so uneven splits
    (``--decoder-first/last-pipeline-num-layers``) need no arithmetic."""
    first = load_torch_file(files[0][0])
    config = model_config_from_args(first.get("args"), files[0][0], gelu=gelu)
    gated = config.activation == "swiglu"
    out: dict[str, Tensor] = {}
    offset = 0
    for row in files:
        states = [first if path == files[0][0] else load_torch_file(path) for path in row]
        names = set(states[0]["model"])
        for path, state in zip(row[1:], states[1:], strict=True):
            if set(state["model"]) != names:
                raise MegatronImportError(f"{path}: tensor names differ from {row[0]}'s")
        for name in sorted(names):
            ours = _mapped(name, offset, row[0], out)
            if ours:
                out[ours] = merge_tp(ours, [s["model"][name] for s in states], gated)
        offset += _layer_count(names)
    _check_layers(config, offset, files[0][0])
    if config.tie_embeddings:  # the last stage's copy of the shared embedding
        out.pop("output.weight", None)
    return config, out


def _mapped(name: str, offset: int, source: Path, out: dict[str, Tensor]) -> str | None:
    ours = our_name(name, offset)
    if ours == "":
        raise MegatronImportError(f"{source}: unexpected tensor {name}")
    if ours in out:
        raise MegatronImportError(f"{source}: {name} duplicates {ours}")
    return ours


def dist_tensors(
    iter_dir: Path, gelu: GeluChoice | None = None
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A torch_dist checkpoint's config (``common.pt``'s args) and our tensors. Its tensors
    are global (every TP shard and PP stage in place); layers are stacked along dim 0."""
    common = iter_dir / COMMON_FILE
    config = model_config_from_args(
        load_torch_file(common, model=False).get("args"), common, gelu=gelu
    )
    try:
        stored = read_tensors(iter_dir)
    except DcpError as exc:
        raise MegatronImportError(str(exc)) from None
    out: dict[str, Tensor] = {}
    layers = 0
    for key, tensor in sorted(stored.items()):
        if key.startswith("decoder.layers."):
            layers = max(layers, tensor.size(0)) if tensor.dim() else layers
            pieces = {f"decoder.layers.{i}.{key[15:]}": t for i, t in enumerate(tensor.unbind(0))}
        else:
            pieces = {key: tensor}
        for name, piece in pieces.items():
            ours = _mapped(name, 0, iter_dir, out)
            if ours:
                out[ours] = piece
    _check_layers(config, layers, iter_dir)
    if config.tie_embeddings:
        out.pop("output.weight", None)
    return config, out


def import_megatron(
    ckpt_dir: str | Path,
    out_package: str | Path,
    *,
    tokenizer: str | Path,
    dtype: str | None = None,
    gelu: GeluChoice | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a Megatron-LM GPT checkpoint (``--ckpt-format torch`` or ``torch_dist``) into
    a model package at ``out_package``. ``gelu`` overrides the GELU the args imply."""
    ckpt_dir = Path(ckpt_dir)
    tokenizer = Path(tokenizer)
    iter_dir = iteration_dir(ckpt_dir)
    files = None if is_torch_dist(iter_dir) else rank_files(iter_dir)
    if not tokenizer.is_file():
        raise MegatronImportError(f"tokenizer {tokenizer} is not a file")
    try:  # a .model, a tokenizer.json, or a GPT2BPETokenizer run's gpt2-vocab.json + merges
        pieces = load_tokenizer(str(tokenizer)).vocab_size
    except TokenizerError as exc:
        raise MegatronImportError(str(exc)) from None
    if files is None:
        config, tensors = dist_tensors(iter_dir, gelu)
    else:
        config, tensors = legacy_tensors(files, gelu)
    if pieces > config.vocab_size:
        raise MegatronImportError(
            f"{tokenizer} has {pieces} pieces, more than the model's vocab {config.vocab_size}"
        )
    model = checked_meta_model(
        config, {name: list(tensor.shape) for name, tensor in tensors.items()}, str(iter_dir)
    )
    dtype = dtype or next(
        (n for n, d in DTYPES.items() if d == tensors["embedding.word.weight"].dtype), "float32"
    )
    if dtype not in DTYPES:
        raise MegatronImportError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
    model = model.to(DTYPES[dtype]).to_empty(device="cpu")
    model.tie_weights()
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    for alias, origin in model.tied_weights.items():
        state[alias] = state[origin]
    model.load_state_dict(state, strict=True)
    return save_model_package(model, config, tokenizer, out_package, overwrite=overwrite)
