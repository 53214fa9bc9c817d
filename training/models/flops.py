"""Parameter and FLOP counts from a config, and AdamW parameter groups.

``flops_per_token`` is the PaLM (appendix B) form, 6·N + 12·L·H·S, forward plus
backward, with the attention term for full (not causally halved) score matrices.
With mixture-of-experts blocks N counts the *active* weights a token meets: the
router and its ``moe_top_k`` experts, not all of them (``total_params`` counts all).
``encoder_decoder_flops`` is the same count for a T5 sample (``model.family: t5``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from megalith.config import ModelConfig


def matmul_params(config: ModelConfig, *, include_output_head: bool = False) -> int:
    """N: weights of the transformer blocks' matrix products (biases, norms and the
    embeddings excluded; the output head only with ``include_output_head``)."""
    hidden = config.hidden_size
    n = config.num_layers * _attention_params(config)
    for layer in range(config.num_layers):
        if config.is_moe_layer(layer):
            experts = config.moe_top_k * _mlp_params(config, config.moe_ffn_hidden_size)
            n += hidden * config.num_experts + experts  # router + the active experts
        else:
            n += _mlp_params(config, config.ffn_hidden_size)
    if include_output_head:
        n += _vocab_size(config) * hidden
    return n


def _attention_params(config: ModelConfig) -> int:
    """qkv (grouped) and proj weights of one self-attention."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = hidden * (config.num_attention_heads + 2 * config.num_query_groups) * head_dim
    return qkv + config.num_attention_heads * head_dim * hidden


def _mlp_params(config: ModelConfig, ffn: int) -> int:
    """fc1 (``[gate; up]`` when gated: SwiGLU, GeGLU) and fc2 weights of one MLP of width ``ffn``."""
    gated = config.activation in ("swiglu", "geglu")
    return config.hidden_size * ffn * (3 if gated else 2)


def flops_per_token(config: ModelConfig, seq_len: int, *, include_output_head: bool = False) -> int:
    """Training FLOPs per token: 6·N + 12·L·H·S (N from :func:`matmul_params`)."""
    n = matmul_params(config, include_output_head=include_output_head)
    return 6 * n + 12 * config.num_layers * config.hidden_size * seq_len


def encoder_decoder_flops(config: ModelConfig, encoder_length: int, decoder_length: int) -> int:
    """Training FLOPs (forward + backward) of one T5 sample of ``S`` encoder and ``T`` decoder
    tokens: 6 per weight a token meets, plus 12·H per (query, key) pair of each layer's
    attention (full score matrices, as :func:`flops_per_token`).

    Encoder tokens meet the encoder blocks and every decoder layer's cross-attention
    ``k``/``v``; decoder tokens meet the decoder blocks (self-attention over ``T`` keys,
    cross-attention ``q``/``proj`` and scores over ``S`` keys, MLP) and the output head.
    The embedding lookups and relative-position biases are left out.
    """
    hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
    block = _attention_params(config) + _mlp_params(config, config.ffn_hidden_size)
    encoder_layers, decoder_layers = config.num_layers, config.decoder_layers
    s, t = encoder_length, decoder_length
    encoder = s * (6 * encoder_layers * block + 12 * encoder_layers * hidden * s)
    cross_kv = s * 6 * decoder_layers * 2 * hidden * width
    decoder_weights = decoder_layers * (block + 2 * hidden * width)  # + cross q, proj
    decoder = t * (6 * decoder_weights + 12 * decoder_layers * hidden * (t + s))
    head = t * 6 * _vocab_size(config) * hidden
    return encoder + cross_kv + decoder + head


def total_params(config: ModelConfig) -> int:
    """Every parameter of the model, a tied embedding counted once."""
    hidden, vocab = config.hidden_size, _vocab_size(config)
    norm = hidden * (2 if config.normalization == "layernorm" and config.bias else 1)
    per_layer = 2 * norm
    chunks = 2 if config.activation == "swiglu" else 1
    if config.bias:
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * config.head_dim
        per_layer += qkv_out + hidden + chunks * config.ffn_hidden_size + hidden
    n = matmul_params(config) + config.num_layers * per_layer + norm + vocab * hidden
    for layer in range(config.num_layers):
        if config.is_moe_layer(layer):  # every expert, not the active ones; biases per expert
            ffn, experts = config.moe_ffn_hidden_size, config.num_experts
            n += (experts - config.moe_top_k) * _mlp_params(config, ffn)
            if config.bias:
                n += experts * (chunks * ffn + hidden) - (chunks * config.ffn_hidden_size + hidden)
    if config.position_embedding == "learned":
        n += config.max_position_embeddings * hidden
    if not config.tie_embeddings:
        n += vocab * hidden
    return n


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices, none on norms, biases (any 1-D parameter, and
    stacked expert biases) and embeddings (``embedding.*``, which includes a tied output head)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # a tied weight is listed once
        if not param.requires_grad:
            continue
        if param.dim() < 2 or name.endswith("bias") or name.startswith("embedding."):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _vocab_size(config: ModelConfig) -> int:
    if config.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count embedding parameters")
    return config.vocab_size
