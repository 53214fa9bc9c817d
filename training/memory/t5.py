"""Activation memory of one T5 (encoder-decoder) pipeline rank, for :mod:`training.memory.estimate`.

A T5 sample is ``S`` encoder and ``T`` decoder tokens (``data.span_corruption``, T5-base:
512 and 114). Per micro-batch of ``b`` samples a rank holds, for its layers (the
encoder's then the decoder's, split as :mod:`training.parallel.pipeline_t5` does):

- each encoder layer: GPT's block tensors (:func:`training.memory.activations.saved_bytes_per_token`,
  gated for geglu) for ``b·S`` tokens;
- each decoder layer: the same for ``b·T`` tokens, plus its cross-attention's: per
  decoder token the query norm's input (the residual stream), the query projection's input, Q,
  the SDPA output and its log-sum-exp (``selective``: Q, SDPA output, the projection's
  output; ``full``: nothing more than the block input); per encoder token the key/value
  projection's input (the encoder output cast to 16-bit) and K and V (``selective``: K
  and V; ``full``: nothing);
- once per stack present: the fp32 float attention masks the stages build from the
  encoder mask (:meth:`T5Model.encoder_attention_mask`): the encoder's ``[b, n, S, S]``
  (relative bias with padding; ``[b, 1, S, S]`` with RoPE), the decoder's causal
  ``[1, n, T, T]`` (relative only) and the cross-attention's ``[b, 1, T, S]``; heads
  divided by TP; and on a rank with decoder layers the encoder output it attends to,
  ``b·S·H`` fp32 (divided by TP under sequence parallelism).

The first stage holds ``in_flight`` micro-batches of all of it (as for GPT); with
recomputation one layer's full set (the larger kind) is live again during its backward.
Like GPT's rows these are estimates of an eager step, to check on a GPU.
"""

from __future__ import annotations

from megalith.config import DataConfig, MegalithConfig
from training.memory.activations import compute_dtype, residual_bytes, saved_bytes_per_token
from training.objectives.t5 import sample_lengths
from training.parallel.groups import ParallelSizes
from training.parallel.pipeline_layout import layer_counts, pipelined_layers, stage_layers


def stage_layer_kinds(config: MegalithConfig, sizes: ParallelSizes, stage: int) -> tuple[int, int]:
    """``(encoder layers, decoder layers)`` pipeline rank ``stage`` holds (every chunk)."""
    model = config.model
    counts = layer_counts(
        pipelined_layers(model), sizes.pp, sizes.vpp, config.parallel.pipeline_layers
    )
    ranges = stage_layers(counts)
    held = [i for chunk in range(sizes.vpp) for i in ranges[stage + chunk * sizes.pp]]
    encoder = sum(1 for i in held if i < model.num_layers)
    return encoder, len(held) - encoder


def cross_attention_bytes(
    config: MegalithConfig, sizes: ParallelSizes, recompute: str, element: int
) -> tuple[float, float]:
    """Bytes a decoder layer's cross-attention keeps ``(per decoder token, per encoder
    token)``; ``element`` is the compute dtype's size."""
    model = config.model
    h, a = model.hidden_size, model.num_attention_heads
    kv = h * model.num_query_groups / a
    tp, sp = sizes.tp, sizes.tp if config.parallel.sequence_parallel else 1
    e, r, lse = element, residual_bytes(config), 4 * a
    mask = h if model.dropout > 0 else 0
    if recompute == "full":
        return 0.0, 0.0
    if recompute == "selective":
        return (e * h + e * h + lse) / tp + e * h / sp, 2 * e * kv / tp
    per_decoder = (e * h + e * h + lse) / tp + (r * h + e * h + mask) / sp
    return per_decoder, e * h / sp + 2 * e * kv / tp


def mask_bytes(config: MegalithConfig, sizes: ParallelSizes, mbs: int, encoder: bool) -> int:
    """fp32 attention masks of one micro-batch for the encoder stack (``encoder``) or the
    decoder stack (self and cross)."""
    source, target = sample_lengths(config.data)
    relative = config.model.position_embedding == "relative"
    heads = config.model.num_attention_heads // sizes.tp if relative else 1
    rows = 1 / sizes.cp  # a context-parallel rank's queries, against every key
    if encoder:
        return int(4 * mbs * heads * source * rows * source)
    causal = 4 * heads * target * rows * target if relative or sizes.cp > 1 else 0
    return int(causal + 4 * mbs * target * rows * source)


def stage_activations(
    config: MegalithConfig,
    sizes: ParallelSizes,
    stage: int,
    mbs: int,
    recompute: str,
    in_flight: float,
) -> tuple[int, int]:
    """``(activation bytes, the larger layer's bytes per micro-batch)`` of pipeline rank
    ``stage``; ``in_flight`` micro-batches of everything a micro-batch leaves. Under
    context parallelism a rank holds ``1/CP`` of each sequence's tokens."""
    source, target = (length / sizes.cp for length in sample_lengths(config.data))
    element = 4 if compute_dtype(config) == "fp32" else 2
    encoders, decoders = stage_layer_kinds(config, sizes, stage)

    def layers(mode: str) -> tuple[float, float]:
        block = saved_bytes_per_token(config, sizes, mode)
        per_target, per_source = cross_attention_bytes(config, sizes, mode, element)
        return block * source * mbs, (block + per_target) * target * mbs + per_source * source * mbs

    encoder_layer, decoder_layer = layers(recompute)
    per_micro_batch = encoders * encoder_layer + decoders * decoder_layer
    if encoders:
        per_micro_batch += mask_bytes(config, sizes, mbs, encoder=True)
    if decoders:
        sp = sizes.tp if config.parallel.sequence_parallel else 1
        per_micro_batch += mask_bytes(config, sizes, mbs, encoder=False)
        per_micro_batch += 4 * mbs * source * config.model.hidden_size / sp
    activations = per_micro_batch * in_flight
    if recompute != "none":  # one layer rebuilt in full during its backward
        full_encoder, full_decoder = layers("none")
        activations += max(full_encoder if encoders else 0, full_decoder if decoders else 0)
    largest = max(encoder_layer if encoders else 0, decoder_layer if decoders else 0)
    return int(activations), int(largest)


def loss_tokens(config: MegalithConfig, sizes: ParallelSizes, mbs: int) -> int:
    """Tokens the output head scores per micro-batch: the decoder's (this rank's part
    under context parallelism)."""
    return mbs * sample_lengths(config.data)[1] // sizes.cp


def sample_shape(data: DataConfig) -> str:
    """A sample's tokens: ``S enc + T dec``."""
    source, target = sample_lengths(data)
    return f"{source} enc + {target} dec"
