"""Hugging Face interop: model packages <-> ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` directories
(and T5 packages -> ``T5ForConditionalGeneration``, export only: :mod:`training.interop.hf_t5`).
:func:`training.interop.export.export_hf` writes a package with its family's converter.

Which HF architecture a model becomes follows from its architecture, not its ``style``:
RMSNorm + SwiGLU + RoPE is Llama (GQA, optional biases, tied or untied); LayerNorm +
GELU(tanh) + learned positions + biases + one KV group per head is GPT-2. MoE models
and other mixtures are refused. Tensor names (ours as in :mod:`training.models.gpt`):

=====================================  =============================================
ours (layer i)                         Llama (``model.layers.{i}.``) / GPT-2 (``transformer.h.{i}.``)
=====================================  =============================================
attention.qkv.norm                     input_layernorm / ln_1
attention.qkv.linear  (grouped q,k,v)  self_attn.{q,k,v}_proj / attn.c_attn (Conv1D, [q; k; v])
attention.proj                         self_attn.o_proj / attn.c_proj (Conv1D)
mlp.fc1.norm                           post_attention_layernorm / ln_2
mlp.fc1.linear  ([gate; up] / fc)      mlp.gate_proj + mlp.up_proj / mlp.c_fc (Conv1D)
mlp.fc2                                mlp.down_proj / mlp.c_proj (Conv1D)
=====================================  =============================================

GPT-2's Conv1D stores ``[in, out]``: the transpose of our ``nn.Linear`` weight. Every
mapping is a pure permutation of values, so a round trip is bit-exact.

Export (:mod:`training.interop.export`) writes ``config.json``, ``generation_config.json``, ``model.safetensors``, the
SentencePiece ``tokenizer.model``, and the same tokenizer as a fast ``tokenizer.json``
(:func:`fast_tokenizer_json`, so ``AutoTokenizer`` needs neither sentencepiece nor
protobuf; ``<|eod|>`` in front for GPT, after the text for T5) with its
``tokenizer_config.json`` (:func:`tokenizer_files`), into a temporary sibling directory
renamed into place. A package with a Hugging Face tokenizer exports its ``tokenizer.json``
byte for byte.
Import reads ``config.json`` (JSON) and safetensors (``model.safetensors``, a sharded
``model.safetensors.index.json``, or every ``*.safetensors``); PyTorch ``.bin`` files
only with ``allow_torch_bin=True`` and then through ``torch.load(weights_only=True)``.
Nothing is unpickled otherwise. The tokenizer is taken as it is: ``tokenizer.model``, else
``tokenizer.json``, else a GPT-2 ``vocab.json`` + ``merges.txt`` (:func:`hf_tokenizer_file`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from pydantic import ValidationError
from safetensors import safe_open
from sentencepiece import sentencepiece_model_pb2
from torch import Tensor

from megalith import safe_read
from megalith.config import ModelConfig, RopeScaling, format_validation_error
from megalith.errors import MegalithError
from preprocessing.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from training.checkpoint.safe_tensors import UnsafeTensorFileError, check_safetensors
from training.models.gpt import GPTModel
from training.models.package import (
    DTYPES,
    MAX_JSON_BYTES,
    model_tensors,
    save_model_package,
)

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_JSON = "tokenizer.json"
EOD_TOKEN, PAD_TOKEN = "<|eod|>", "<|pad|>"
# Buffers older HF checkpoints saved beside the weights; they carry no learned values.
IGNORED_HF_KEYS = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")
HF_BLOCK = re.compile(r"^(?:model\.layers|(?:transformer\.)?h)\.(\d+)\.")
# config.json's key for each ModelConfig key read from it, by model_type (for messages).
HF_KEYS = {
    "llama": {
        "num_layers": "num_hidden_layers",
        "num_query_groups": "num_key_value_heads",
        "ffn_hidden_size": "intermediate_size",
        "norm_eps": "rms_norm_eps",
        "rope_base": "rope_theta",
        "bias": "attention_bias",
        "tie_embeddings": "tie_word_embeddings",
        "dropout": "attention_dropout",
        "init_std": "initializer_range",
    },
    "gpt2": {
        "num_layers": "n_layer",
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "ffn_hidden_size": "n_inner",
        "max_position_embeddings": "n_positions",
        "norm_eps": "layer_norm_epsilon",
        "tie_embeddings": "tie_word_embeddings",
        "dropout": "resid_pdrop",
        "init_std": "initializer_range",
    },
}

Split = Callable[[Tensor], list[Tensor]]
Merge = Callable[[list[Tensor]], Tensor]
Entry = tuple[str, tuple[str, ...], Split, Merge]


class HFInteropError(MegalithError):
    """A model or directory that cannot be converted; the message names the file or key."""


# Architectures.


def hf_model_type(config: ModelConfig) -> str:
    """``"llama"`` or ``"gpt2"``: the HF architecture that computes exactly what ``config`` does."""
    if config.num_experts:
        raise HFInteropError("mixture-of-experts models cannot be exported to Llama or GPT-2")
    if config.nope_layers:
        raise HFInteropError(
            f"model.nope_layers {config.nope_layers}: Llama applies RoPE in every layer"
        )
    kinds = {
        "llama": {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding": "rope"},
        "gpt2": {
            "normalization": "layernorm",
            "activation": "gelu",
            "position_embedding": "learned",
            "bias": True,
            "num_query_groups": config.num_attention_heads,
        },
    }
    for kind, wanted in kinds.items():
        if all(getattr(config, key) == value for key, value in wanted.items()):
            return kind
    found = {key: getattr(config, key) for key in {**kinds["llama"], **kinds["gpt2"]}}
    raise HFInteropError(
        f"model {found} is neither Llama-style {kinds['llama']} nor GPT-2-style {kinds['gpt2']}"
    )


def hf_config(config: ModelConfig, dtype: str, special_ids: dict[str, int]) -> dict[str, Any]:
    """The HF ``config.json`` for ``config`` (``special_ids``: bos/eos/pad token ids)."""
    common = {
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
        **{f"{k}_token_id": v for k, v in special_ids.items()},
    }
    if hf_model_type(config) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": config.hidden_size,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size,
            "n_positions": config.max_position_embeddings,
            "n_ctx": config.max_position_embeddings,
            "activation_function": "gelu" if config.gelu_approximation == "none" else "gelu_new",
            "layer_norm_epsilon": config.norm_eps,
            **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), config.dropout),
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            **common,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_parameters": {"rope_theta": config.rope_base, **hf_rope_scaling(config)},
        "rope_scaling": hf_rope_scaling(config) if config.rope_scaling else None,
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "attention_dropout": config.dropout,
        **common,
    }


def hf_rope_scaling(config: ModelConfig) -> dict[str, Any]:
    """HF's ``rope_scaling`` for our config (rope_type default without scaling)."""
    if config.rope_scaling is None:
        return {"rope_type": "default"}
    return config.rope_scaling.model_dump()


def rope_scaling_from_hf(rope: dict[str, Any], source: str) -> RopeScaling | None:
    """Our RopeScaling for the ``rope_scaling`` or ``rope_parameters`` entry that scales (None: none)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not rope or kind == "default":
        return None
    if kind != "llama3":
        raise HFInteropError(
            f"{source}: RoPE scaling rope_type {safe_read.brief(kind)} is not supported "
            "(only 'default' and 'llama3')"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    try:
        return RopeScaling(**{k: rope[k] for k in keys if k in rope})
    except ValidationError as exc:
        raise HFInteropError(format_validation_error(exc, f"{source}: rope_scaling")) from None


def model_config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for an HF Llama or GPT-2 ``config.json``; refuses what we
    cannot compute exactly (other model types, activations, RoPE scaling other than llama3)."""

    def get(key: str, default: Any = ...) -> Any:
        if key not in hf and default is ...:
            raise HFInteropError(f"{source}: missing key {key!r}")
        return hf.get(key, default)

    def need(key: str, allowed: tuple[Any, ...], default: Any) -> None:
        if get(key, default) not in allowed:
            raise HFInteropError(
                f"{source}: {key}={safe_read.brief(get(key, default))} is not supported "
                f"(only {list(allowed)})"
            )

    def size(key: str) -> int:  # a number used in arithmetic below, before validation
        return safe_read.field(hf, key, int, source, minimum=1)

    if not isinstance(hf, dict):
        raise HFInteropError(f"{source}: expected a JSON object")
    kind = hf.get("model_type")
    if kind == "llama":
        heads, hidden = size("num_attention_heads"), size("hidden_size")
        need("hidden_act", ("silu",), "silu")
        need("head_dim", (None, hidden // heads), None)
        need("mlp_bias", (get("attention_bias", False),), False)
        rope: dict[str, Any] = {}
        scaled: dict[str, Any] = {}  # the entry that names a rope_type other than default
        for key in ("rope_scaling", "rope_parameters"):
            value = get(key, None) or {}
            if not isinstance(value, dict):
                raise HFInteropError(
                    f"{source}: {key} must be an object, got {safe_read.brief(value)}"
                )
            rope.update(value)
            if value.get("rope_type", value.get("type", "default")) != "default":
                scaled = value
        values = {
            "style": "llama",
            "num_layers": get("num_hidden_layers"),
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": get("num_key_value_heads", None) or heads,
            "ffn_hidden_size": get("intermediate_size"),
            "max_position_embeddings": get("max_position_embeddings"),
            "norm_eps": get("rms_norm_eps", 1e-6),
            "rope_base": rope.get("rope_theta", get("rope_theta", 10000.0)),
            "rope_scaling": rope_scaling_from_hf(scaled, source),
            "bias": get("attention_bias", False),
            "tie_embeddings": get("tie_word_embeddings", False),
            "dropout": get("attention_dropout", 0.0),
        }
    elif kind == "gpt2":
        need("activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"), "gelu_new")
        need("scale_attn_weights", (True,), True)
        need("scale_attn_by_inverse_layer_idx", (False,), False)
        need("add_cross_attention", (False,), False)
        hidden = size("n_embd")
        values = {
            "style": "gpt2",
            "num_layers": get("n_layer"),
            "hidden_size": hidden,
            "num_attention_heads": get("n_head"),
            "ffn_hidden_size": get("n_inner", None) or 4 * hidden,
            "max_position_embeddings": get("n_positions"),
            "norm_eps": get("layer_norm_epsilon", 1e-5),
            "tie_embeddings": get("tie_word_embeddings", True),
            "dropout": get("resid_pdrop", 0.1),
            "gelu_approximation": "none" if get("activation_function", "") == "gelu" else "tanh",
        }
    else:
        raise HFInteropError(
            f"{source}: model_type {safe_read.brief(kind)} is not supported (only 'llama' and 'gpt2')"
        )
    values["vocab_size"] = size("vocab_size")  # compared with the tokenizer's pieces
    values["init_std"] = get("initializer_range", 0.02)
    try:
        return ModelConfig(**values)
    except ValidationError as exc:
        raise HFInteropError(format_validation_error(exc, source, HF_KEYS[kind])) from None


# Tensors.


def _qkv_split(config: ModelConfig) -> tuple[Split, Merge]:
    """Our grouped rows (per KV group: its query heads, then k, then v) <-> q, k, v."""
    groups, dim = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups

    def split(t: Tensor) -> list[Tensor]:
        rest = t.shape[1:]
        g = t.view(groups, per_group + 2, dim, *rest)
        parts = (g[:, :per_group], g[:, per_group], g[:, per_group + 1])
        return [part.reshape(-1, *rest) for part in parts]

    def merge(parts: list[Tensor]) -> Tensor:
        q, k, v = (p.reshape(groups, -1, dim, *p.shape[1:]) for p in parts)
        return torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])

    return split, merge


def _same(t: Tensor) -> list[Tensor]:
    return [t]


def _first(parts: list[Tensor]) -> Tensor:
    return parts[0]


def _conv1d(weight: bool) -> tuple[Split, Merge]:
    """GPT-2's Conv1D holds ``weight.T``; biases are unchanged."""
    if not weight:
        return _same, _first
    return (lambda t: [t.t()]), (lambda parts: parts[0].t())


def tensor_map(config: ModelConfig) -> list[Entry]:
    """``(our name, HF names, split ours -> HF, merge HF -> ours)`` for every saved tensor
    (tied aliases left out, as in :func:`~training.models.package.model_tensors`)."""
    kind = hf_model_type(config)
    qkv_split, qkv_merge = _qkv_split(config)
    entries: list[Entry] = []

    def add(ours: str, hf: str | tuple[str, ...], split: Split = _same, merge: Merge = _first):
        entries.append((ours, (hf,) if isinstance(hf, str) else hf, split, merge))

    if kind == "llama":
        add("embedding.word.weight", "model.embed_tokens.weight")
        for i in range(config.num_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            add(ours + "attention.qkv.norm.weight", hf + "input_layernorm.weight")
            add(ours + "mlp.fc1.norm.weight", hf + "post_attention_layernorm.weight")
            for p in ("weight", "bias") if config.bias else ("weight",):
                names = tuple(f"{hf}self_attn.{x}_proj.{p}" for x in "qkv")
                add(f"{ours}attention.qkv.linear.{p}", names, qkv_split, qkv_merge)
                add(f"{ours}attention.proj.{p}", f"{hf}self_attn.o_proj.{p}")
                add(
                    f"{ours}mlp.fc1.linear.{p}",
                    (f"{hf}mlp.gate_proj.{p}", f"{hf}mlp.up_proj.{p}"),
                    lambda t: list(t.chunk(2)),
                    torch.cat,
                )
                add(f"{ours}mlp.fc2.{p}", f"{hf}mlp.down_proj.{p}")
        add("final_norm.weight", "model.norm.weight")
        if not config.tie_embeddings:
            add("output.weight", "lm_head.weight")
        return entries

    add("embedding.word.weight", "transformer.wte.weight")
    add("embedding.position.weight", "transformer.wpe.weight")
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for p in ("weight", "bias"):
            t_split, t_merge = _conv1d(p == "weight")
            add(f"{ours}attention.qkv.norm.{p}", f"{hf}ln_1.{p}")
            add(
                f"{ours}attention.qkv.linear.{p}",
                f"{hf}attn.c_attn.{p}",
                lambda t, s=t_split: s(torch.cat(qkv_split(t))),
                lambda parts, m=t_merge: qkv_merge(list(m(parts).chunk(3))),
            )
            add(f"{ours}attention.proj.{p}", f"{hf}attn.c_proj.{p}", t_split, t_merge)
            add(f"{ours}mlp.fc1.norm.{p}", f"{hf}ln_2.{p}")
            add(f"{ours}mlp.fc1.linear.{p}", f"{hf}mlp.c_fc.{p}", t_split, t_merge)
            add(f"{ours}mlp.fc2.{p}", f"{hf}mlp.c_proj.{p}", t_split, t_merge)
    for p in ("weight", "bias"):
        add(f"final_norm.{p}", f"transformer.ln_f.{p}")
    if not config.tie_embeddings:
        add("output.weight", "lm_head.weight")
    return entries


def to_hf_tensors(config: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict (tied aliases left out) -> HF names, every tensor contiguous."""
    out: dict[str, Tensor] = {}
    for ours, hf_names, split, _ in tensor_map(config):
        if ours not in tensors:
            raise HFInteropError(f"tensor {ours} is missing from the model")
        for name, value in zip(hf_names, split(tensors[ours]), strict=True):
            out[name] = value.contiguous()
    return out


def from_hf_tensors(config: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF tensors -> our names (tied aliases left out)."""
    return {
        ours: merge([tensors[name] for name in hf_names]).contiguous()
        for ours, hf_names, _, merge in tensor_map(config)
    }


# Tokenizer.


def tokenizer_files(tokenizer_model: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """``tokenizer_config.json`` for the ``tokenizer.json`` that :func:`fast_tokenizer_json`
    writes from our SentencePiece model (loaded as it is: ``LlamaTokenizer`` would replace
    its normalizer, and a leading space would then encode differently), and the
    special token ids for ``config.json``.

    ``<|eod|>`` (our document separator) is both ``bos_token`` and ``eos_token``, added in
    front of every encoding as Megalith's evaluation does (``[eod, *encode(text)]``) and the
    token generation stops at; ``<|pad|>`` is the pad token when the model has one, ``<unk>``
    the unknown token. Without ``<|eod|>``, SentencePiece's own ``<s>``/``</s>`` are used.
    A Hugging Face tokenizer (:func:`hf_tokenizer_files`) keeps its own tokens.
    """
    try:
        loaded = load_tokenizer(str(tokenizer_model))
    except TokenizerError as exc:
        raise HFInteropError(str(exc)) from None
    if loaded.kind == "hf":
        return hf_tokenizer_files(loaded)
    try:
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    except (OSError, RuntimeError) as exc:
        raise HFInteropError(f"{tokenizer_model}: not a SentencePiece model: {exc}") from None
    pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    bos = EOD_TOKEN if EOD_TOKEN in pieces else sp.id_to_piece(max(sp.bos_id(), 0))
    eos = EOD_TOKEN if EOD_TOKEN in pieces else sp.id_to_piece(max(sp.eos_id(), 0))
    tokens = {"bos_token": bos, "eos_token": eos, "unk_token": sp.id_to_piece(sp.unk_id())}
    if PAD_TOKEN in pieces:
        tokens["pad_token"] = PAD_TOKEN
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": None,
    }
    ids = {name.removesuffix("_token"): pieces[piece] for name, piece in tokens.items()}
    ids.pop("unk")
    return config, ids


def hf_tokenizer_files(tokenizer: Tokenizer) -> tuple[dict[str, Any], dict[str, int]]:
    """``tokenizer_config.json`` and the special ids for a Hugging Face ``tokenizer.json``
    exported as it is: its bos (or the EOD when it has none), the EOD as eos, its pad."""
    ids = {"bos": tokenizer.eod_id if tokenizer.bos_id is None else tokenizer.bos_id}
    ids["eos"] = tokenizer.eod_id
    if tokenizer.pad_id is not None:
        ids["pad"] = tokenizer.pad_id
    tokens = {f"{name}_token": tokenizer.id_to_piece(i) for name, i in ids.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        "clean_up_tokenization_spaces": False,
        "model_max_length": None,
    }
    return config, ids


def fast_tokenizer_json(tokenizer_model: Path, template: str) -> dict[str, Any]:
    """Our SentencePiece model as a Hugging Face ``tokenizers`` JSON that encodes and
    decodes exactly as SentencePiece does: identity normalization, a "▁" always prepended
    (SentencePiece's dummy prefix, even before a leading space) and spaces as "▁", the BPE
    merges (or unigram scores) of its pieces, byte fallback, and the special tokens that
    ``template`` places around a text (``$A``), as ``TemplateProcessing`` writes it:
    ``"<|eod|> $A"`` for GPT (:func:`tokenizer_files`), ``"$A <|eod|>"`` for T5's
    encoder input; a pair repeats it for ``$B``. One difference: a user-defined piece
    (``<|eod|>``) written inside a text splits it before normalization, so the text after
    it gets a "▁" of its own (SentencePiece's plain encode of such text differs there)."""
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(tokenizer_model.read_bytes())
    except Exception as exc:  # protobuf's DecodeError and friends
        raise HFInteropError(f"{tokenizer_model}: not a SentencePiece model: {exc}") from None
    kinds = sentencepiece_model_pb2.ModelProto.SentencePiece
    pieces = [(piece.piece, piece.score, piece.type) for piece in proto.pieces]
    ids = {piece: index for index, (piece, _, _) in enumerate(pieces)}
    whole = (kinds.UNKNOWN, kinds.CONTROL, kinds.USER_DEFINED)
    added = [
        {
            "id": index,
            "content": piece,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind != kinds.USER_DEFINED or piece in (EOD_TOKEN, PAD_TOKEN),
        }
        for index, (piece, _, kind) in enumerate(pieces)
        if kind in whole
    ]
    byte_fallback = proto.trainer_spec.byte_fallback
    if proto.trainer_spec.model_type == proto.trainer_spec.BPE:
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": byte_fallback,
            "ignore_merges": False,
            "vocab": ids,
            "merges": _bpe_merges(pieces, ids),
        }
    elif proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM:
        model = {
            "type": "Unigram",
            "unk_id": proto.trainer_spec.unk_id,
            "vocab": [[piece, score] for piece, score, _ in pieces],
            "byte_fallback": byte_fallback,
        }
    else:
        raise HFInteropError(f"{tokenizer_model}: only BPE and unigram models are exported")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": _template_processing(template, ids, tokenizer_model),
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": model,
    }


def _template_processing(template: str, ids: dict[str, int], source: Path) -> dict[str, Any]:
    """``TemplateProcessing`` of ``template`` (special pieces and one ``$A``, space-separated):
    the single template, and the pair template (it again with ``$B``, type id 1)."""
    parts = template.split()
    specials = [part for part in parts if part != "$A"]
    if parts.count("$A") != 1 or any(piece not in ids for piece in specials):
        raise HFInteropError(
            f"{source}: template {template!r} needs one $A and pieces of the model around it"
        )

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        return [
            {"Sequence": {"id": name, "type_id": type_id}}
            if part == "$A"
            else {"SpecialToken": {"id": part, "type_id": type_id}}
            for part in parts
        ]

    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": {
            piece: {"id": piece, "ids": [ids[piece]], "tokens": [piece]} for piece in specials
        },
    }


def _bpe_merges(pieces: list[tuple[str, float, int]], ids: dict[str, int]) -> list[list[str]]:
    """Every split of a normal piece into two pieces, in the order SentencePiece merges:
    by the merged piece's score, then by the parts' ids."""
    normal = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    ranked = []
    for piece, score, kind in pieces:
        if kind != normal:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[piece], ids[left], ids[right], [left, right]))
    return [merge for *_, merge in sorted(ranked)]


# Import.


def import_hf(
    hf_dir: str | Path,
    out_package: str | Path,
    *,
    allow_torch_bin: bool = False,
    tokenizer: str | Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert the HF Llama or GPT-2 directory ``hf_dir`` into a model package.

    ``tokenizer``: a tokenizer file to use instead of the one in ``hf_dir``
    (:func:`hf_tokenizer_file`); ``dtype``: float32, bfloat16 or float16 (default: the
    dtype of the HF embedding).
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HFInteropError(f"{hf_dir} is not a directory")
    config = model_config_from_hf(_read_json(hf_dir / "config.json"), str(hf_dir / "config.json"))
    tokenizer = Path(tokenizer) if tokenizer else hf_tokenizer_file(hf_dir)
    if not tokenizer.is_file():
        raise HFInteropError(f"{tokenizer} not found")
    try:  # bounded, a regular file; a piece that is not UTF-8 is refused too
        pieces = load_tokenizer(str(tokenizer)).vocab_size
    except TokenizerError as exc:
        raise HFInteropError(str(exc)) from None
    if pieces > config.vocab_size:
        raise HFInteropError(
            f"{tokenizer} has {pieces} pieces, more than the model's vocab_size {config.vocab_size}"
        )
    if dtype is not None and dtype not in DTYPES:
        raise HFInteropError(f"dtype {dtype!r} is not one of {list(DTYPES)}")

    files = _weight_files(hf_dir, allow_torch_bin)
    shapes, loaded = _file_shapes(files)
    _check_sizes(config, shapes, hf_dir / "config.json")
    with torch.device("meta"):
        model = GPTModel(config)
    expected = to_hf_tensors(config, model_tensors(model))
    hf_tensors = _read_hf_tensors(hf_dir, config, expected, shapes, loaded)
    if dtype is None:
        dtype = _dtype_name(hf_tensors[tensor_map(config)[0][1][0]].dtype, hf_dir)
    ours = from_hf_tensors(config, {k: v.to(DTYPES[dtype]) for k, v in hf_tensors.items()})
    model = model.to(DTYPES[dtype]).to_empty(device="cpu")
    model.tie_weights()
    for alias, source in model.tied_weights.items():
        ours[alias] = ours[source]
    model.load_state_dict(ours, strict=True)
    return save_model_package(model, config, tokenizer, out_package, overwrite=overwrite)


def hf_tokenizer_file(hf_dir: Path) -> Path:
    """The tokenizer of an HF directory: ``tokenizer.model`` (SentencePiece), else
    ``tokenizer.json``, else ``vocab.json`` (with ``merges.txt``: GPT-2's byte-level BPE)."""
    for name in (TOKENIZER_MODEL, TOKENIZER_JSON, "vocab.json"):
        if (hf_dir / name).is_file():
            return hf_dir / name
    raise HFInteropError(
        f"{hf_dir}: no tokenizer.model, tokenizer.json or vocab.json + merges.txt; pass "
        "--tokenizer FILE"
    )


def _file_shapes(
    files: list[Path],
) -> tuple[dict[Path, dict[str, list[int]]], dict[Path, dict[str, Tensor]]]:
    """Each file's ``{tensor: shape}`` (safetensors: from the bounded header check, before
    the library allocates anything), and the tensors of ``.bin`` files, which come whole."""
    shapes: dict[Path, dict[str, list[int]]] = {}
    loaded: dict[Path, dict[str, Tensor]] = {}
    for path in files:
        if path.suffix == ".safetensors":
            try:
                shapes[path] = {k: shape for k, (shape, _) in check_safetensors(path).items()}
            except UnsafeTensorFileError as exc:
                raise HFInteropError(str(exc)) from None
        else:
            loaded[path] = _torch_load(path)
            shapes[path] = {k: list(v.shape) for k, v in loaded[path].items()}
    return shapes, loaded


def _check_sizes(
    config: ModelConfig, shapes: dict[Path, dict[str, list[int]]], source: Path
) -> None:
    """The block count and embedding of config.json against the tensor names and shapes,
    before the model is built: a config of 1000 layers beside weights for 2 stops here."""
    keys = HF_KEYS[hf_model_type(config)]
    layers_key, hidden_key = keys["num_layers"], keys.get("hidden_size", "hidden_size")
    blocks = {
        int(match[1])
        for names in shapes.values()
        for name in names
        if (match := HF_BLOCK.match(name))
    }
    if blocks != set(range(config.num_layers)):
        raise HFInteropError(
            f"{source}: {layers_key} is {config.num_layers}, the weights hold "
            f"{len(blocks)} numbered blocks"
        )
    for names in shapes.values():
        embedding = names.get("model.embed_tokens.weight") or names.get(
            "transformer.wte.weight", names.get("wte.weight")
        )
        if embedding is not None and embedding != [config.vocab_size, config.hidden_size]:
            raise HFInteropError(
                f"{source}: vocab_size {config.vocab_size} and {hidden_key} "
                f"{config.hidden_size} disagree with the embedding's shape {embedding}"
            )


def _read_hf_tensors(
    hf_dir: Path,
    config: ModelConfig,
    expected: dict[str, Tensor],
    file_shapes: dict[Path, dict[str, list[int]]],
    loaded: dict[Path, dict[str, Tensor]],
) -> dict[str, Tensor]:
    files = list(file_shapes)
    found: dict[str, tuple[Path, list[int]]] = {}
    tensors: dict[str, Tensor] = {}
    for path, shapes in file_shapes.items():
        for key, shape in shapes.items():
            name = _hf_name(config, key)
            if IGNORED_HF_KEYS.match(name) or (config.tie_embeddings and name == "lm_head.weight"):
                continue
            if name in found:
                raise HFInteropError(f"{path}: tensor {key} is also in {found[name][0]}")
            if name not in expected:
                raise HFInteropError(
                    f"{path}: unexpected tensor {key} for a {config.num_layers}-layer "
                    f"{hf_model_type(config)} model"
                )
            if shape != list(expected[name].shape):
                raise HFInteropError(
                    f"{path}: tensor {key} has shape {shape}, config.json implies "
                    f"{list(expected[name].shape)}"
                )
            found[name] = (path, shape)
            if path in loaded:
                tensors[name] = loaded[path][key]
    missing = sorted(set(expected) - set(found))
    if missing:
        raise HFInteropError(
            f"{hf_dir}: tensors missing from {[p.name for p in files]}: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    name = _hf_name(config, key)
                    if found.get(name, (None,))[0] == path:
                        tensors[name] = f.get_tensor(key)
    return tensors


def _hf_name(config: ModelConfig, key: str) -> str:
    """Original GPT-2 checkpoints name tensors without the ``transformer.`` prefix."""
    if config.style == "gpt2" and not key.startswith(("transformer.", "lm_head.")):
        return "transformer." + key
    return key


def _weight_files(hf_dir: Path, allow_torch_bin: bool) -> list[Path]:
    for index, single, suffix in (
        (HF_INDEX, HF_WEIGHTS, ".safetensors"),
        (BIN_INDEX, BIN_WEIGHTS, ".bin"),
    ):
        if (hf_dir / index).is_file():
            index_json = _read_json(hf_dir / index)
            weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
            if not isinstance(weight_map, dict):
                raise HFInteropError(f"{hf_dir / index}: expected a 'weight_map' object")
            source = f"{hf_dir / index}: weight_map"
            try:
                names = sorted({safe_read.confined_name(n, source) for n in weight_map.values()})
            except safe_read.UnsafeFileError as exc:
                raise HFInteropError(str(exc)) from None
        elif (hf_dir / single).is_file():
            names = [single]
        else:
            names = sorted(p.name for p in hf_dir.glob(f"*{suffix}"))
        if not names:
            continue
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise HFInteropError(
                    f"{hf_dir}: weight file {safe_read.brief(name)} is not a plain file name"
                )
            if not (hf_dir / name).is_file():
                raise HFInteropError(f"{hf_dir / name}: missing (named by {index})")
            if not name.endswith(suffix):
                raise HFInteropError(f"{hf_dir / name}: expected a {suffix} file")
        if suffix == ".bin" and not allow_torch_bin:
            raise HFInteropError(
                f"{hf_dir} holds PyTorch pickle weights ({', '.join(names)}) and no safetensors; "
                "they are read only with --allow-torch-bin (then through torch.load with "
                "weights_only=True)"
            )
        return [hf_dir / name for name in names]
    raise HFInteropError(f"{hf_dir}: no {HF_WEIGHTS}, {HF_INDEX} or *.safetensors files")


def _torch_load(path: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses anything but tensors and plain containers
        raise HFInteropError(f"{path}: cannot be loaded with weights_only=True: {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise HFInteropError(f"{path}: expected a dict of tensors (a state dict)")
    return state


def _dtype_name(dtype: torch.dtype, source: Path) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise HFInteropError(f"{source}: weights are {dtype}; pass --dtype float32|bfloat16|float16")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFInteropError(f"{path} not found")
    try:  # a sharded index of a large model is a few MB
        return safe_read.read_json(path, MAX_JSON_BYTES * 16, allow_symlink=False, expect=dict)
    except safe_read.UnsafeFileError as exc:
        raise HFInteropError(str(exc)) from None
