"""Hugging Face export of T5 model packages as ``T5ForConditionalGeneration``.

:func:`training.interop.export.export_hf` calls here for ``model.family: t5``. Tensor names
(ours as in :mod:`training.models.t5`; HF block ``{i}`` of ``encoder.`` or ``decoder.``):

=============================================  ===========================================
ours                                           Hugging Face T5
=============================================  ===========================================
embedding.word.weight                          shared.weight (HF ties both embed_tokens)
{encoder,decoder}.relative_bias.weight         *.block.0.layer.0.SelfAttention.
                                               relative_attention_bias.weight
*.layers.{i}.attention.qkv.norm.weight         *.block.{i}.layer.0.layer_norm.weight
*.layers.{i}.attention.qkv.linear.weight       *.block.{i}.layer.0.SelfAttention.{q,k,v}
*.layers.{i}.attention.proj.weight             *.block.{i}.layer.0.SelfAttention.o
decoder.layers.{i}.cross_attention.q.norm      decoder.block.{i}.layer.1.layer_norm
decoder.layers.{i}.cross_attention.q.linear    decoder.block.{i}.layer.1.EncDecAttention.q
decoder.layers.{i}.cross_attention.kv ([k;v])  decoder.block.{i}.layer.1.EncDecAttention.{k,v}
decoder.layers.{i}.cross_attention.proj        decoder.block.{i}.layer.1.EncDecAttention.o
*.layers.{i}.mlp.fc1.norm.weight               *.block.{i}.layer.{1|2}.layer_norm.weight
*.layers.{i}.mlp.fc1.linear ([gate; up])       *.block.{i}.layer.{1|2}.DenseReluDense.wi_0,
                                               wi_1 (gated-gelu) / wi (gelu_new)
*.layers.{i}.mlp.fc2.weight                    *.block.{i}.layer.{1|2}.DenseReluDense.wo
{encoder,decoder}.final_norm.weight            {encoder,decoder}.final_layer_norm.weight
output.weight                                  lm_head.weight
=============================================  ===========================================

T5 does not scale attention scores; Megalith's SDPA scales them by ``1/sqrt(head_dim)``,
so the exported query weights (self- and cross-attention) carry that factor. HF T5 has
only relative position buckets and no grouped KV heads: a RoPE T5, or one with
``num_query_groups < num_attention_heads``, is refused. The decoder starts from the
pad id (``decoder_start_token_id``), as the interface of :mod:`training.models.t5` says.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import sentencepiece as spm
from torch import Tensor

from megalith.config import ModelConfig
from training.interop.hf import EOD_TOKEN, PAD_TOKEN, HFInteropError


class HFT5ExportError(HFInteropError):
    """A T5 model Hugging Face's T5 cannot compute; the message names the key."""


def check_exportable(config: ModelConfig) -> None:
    """Refuse what ``T5ForConditionalGeneration`` cannot compute exactly."""
    if config.position_embedding != "relative":
        raise HFT5ExportError(
            f"model.position_embedding is {config.position_embedding!r}: Hugging Face T5 has "
            "only relative position buckets, so a RoPE T5 cannot be exported"
        )
    if config.num_query_groups != config.num_attention_heads:
        raise HFT5ExportError(
            f"model.num_query_groups {config.num_query_groups} < num_attention_heads "
            f"{config.num_attention_heads}: Hugging Face T5 has no grouped KV heads"
        )


def hf_t5_config(config: ModelConfig, dtype: str, special_ids: dict[str, int]) -> dict[str, Any]:
    """The HF ``config.json`` (T5 v1.1 layout) for ``config``."""
    check_exportable(config)
    gated = config.activation == "geglu"
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": config.vocab_size,
        "d_model": config.hidden_size,
        "d_kv": config.head_dim,
        "d_ff": config.ffn_hidden_size,
        "num_layers": config.num_layers,
        "num_decoder_layers": config.decoder_layers,
        "num_heads": config.num_attention_heads,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "dropout_rate": config.dropout,
        "layer_norm_epsilon": config.norm_eps,
        "initializer_factor": 1.0,
        "feed_forward_proj": "gated-gelu" if gated else "gelu_new",
        "is_encoder_decoder": True,
        "tie_word_embeddings": False,  # v1.1: an untied head and no decoder-output scaling
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        **{f"{name}_token_id": value for name, value in special_ids.items()},
    }


def t5_tokenizer_files(tokenizer_model: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """``tokenizer_config.json`` for the export's ``tokenizer.json`` (its ``<extra_id_N>``
    sentinels are already pieces, so ``extra_ids`` is 0), and the pad/eos/decoder-start
    ids. ``<|eod|>`` ends a sequence, ``<|pad|>`` pads and starts the decoder. The class is
    ``PreTrainedTokenizerFast``: transformers 5's ``T5Tokenizer`` rebuilds a unigram model
    from the vocabulary and cannot load a BPE ``tokenizer.json``."""
    if tokenizer_model.suffix == ".json":
        raise HFT5ExportError(
            f"{tokenizer_model}: the T5 export needs a SentencePiece tokenizer.model; "
            "T5 packages with a Hugging Face tokenizer.json are not exported yet"
        )
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    missing = [piece for piece in (EOD_TOKEN, PAD_TOKEN) if piece not in pieces]
    if missing:
        raise HFT5ExportError(
            f"{tokenizer_model} lacks {missing}: the T5 export needs <|pad|> (pad and decoder "
            "start) and <|eod|> (end of sequence)"
        )
    sentinel = re.compile(r"<extra_id_(\d+)>")
    numbered = {int(m.group(1)): p for p in pieces if (m := sentinel.fullmatch(p))}
    sentinels = [numbered[n] for n in sorted(numbered)]
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "extra_ids": 0,
        "additional_special_tokens": sentinels,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
    }
    pad = pieces[PAD_TOKEN]
    ids = {"pad": pad, "eos": pieces[EOD_TOKEN], "decoder_start": pad}
    return tok_config, ids


def to_hf_t5_tensors(config: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our T5 state dict -> ``T5ForConditionalGeneration`` names, query weights scaled."""
    check_exportable(config)
    q_scale = 1.0 / math.sqrt(config.head_dim)
    width = config.num_attention_heads * config.head_dim
    out: dict[str, Tensor] = {
        "shared.weight": tensors["embedding.word.weight"],
        "lm_head.weight": tensors["output.weight"],
    }
    for side, layers in (("encoder", config.num_layers), ("decoder", config.decoder_layers)):
        hf_bias = f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        out[hf_bias] = tensors[f"{side}.relative_bias.weight"]
        out[f"{side}.final_layer_norm.weight"] = tensors[f"{side}.final_norm.weight"]
        for i in range(layers):
            ours, hf = f"{side}.layers.{i}.", f"{side}.block.{i}.layer."
            qkv = tensors[ours + "attention.qkv.linear.weight"].view(
                -1, 3, config.head_dim, config.hidden_size
            )
            q, k, v = (qkv[:, j].reshape(width, config.hidden_size) for j in range(3))
            attention = hf + "0.SelfAttention."
            out.update({attention + "q.weight": q * q_scale, attention + "k.weight": k})
            out[attention + "v.weight"] = v
            out[attention + "o.weight"] = tensors[ours + "attention.proj.weight"]
            out[hf + "0.layer_norm.weight"] = tensors[ours + "attention.qkv.norm.weight"]
            mlp = 1
            if side == "decoder":
                mlp = 2
                cross, enc_dec = ours + "cross_attention.", hf + "1.EncDecAttention."
                out[hf + "1.layer_norm.weight"] = tensors[cross + "q.norm.weight"]
                out[enc_dec + "q.weight"] = tensors[cross + "q.linear.weight"] * q_scale
                k, v = tensors[cross + "kv.weight"].chunk(2)
                out.update({enc_dec + "k.weight": k, enc_dec + "v.weight": v})
                out[enc_dec + "o.weight"] = tensors[cross + "proj.weight"]
            out[f"{hf}{mlp}.layer_norm.weight"] = tensors[ours + "mlp.fc1.norm.weight"]
            dense, fc1 = f"{hf}{mlp}.DenseReluDense.", tensors[ours + "mlp.fc1.linear.weight"]
            if config.activation == "geglu":
                gate, up = fc1.chunk(2)
                out.update({dense + "wi_0.weight": gate, dense + "wi_1.weight": up})
            else:
                out[dense + "wi.weight"] = fc1
            out[dense + "wo.weight"] = tensors[ours + "mlp.fc2.weight"]
    return {name: tensor.contiguous() for name, tensor in out.items()}


__all__ = [
    "HFT5ExportError",
    "check_exportable",
    "hf_t5_config",
    "t5_tokenizer_files",
    "to_hf_t5_tensors",
]
