"""Seq2seq generation for T5 models (``model.family: t5``): encode once, decode step by step.

A prompt is what the encoder reads: its tokens, then the end-of-document id (EOS), as
the span-corruption samples end (:mod:`training.data.t5_dataset`); prompts of a batch
are padded on the right with the pad id and masked. The decoder starts from the pad id
(T5's decoder start token) and appends one token per step, reading its earlier keys
and values from a KV cache (:meth:`T5Model.new_kv_cache`), so each step costs one
token's decoder forward; the cross-attention reads the encoder output computed once.

Sampling reuses :mod:`training.inference.decode` (greedy, temperature, top-k, top-p, one
random stream per prompt seeded with ``seed + its index``): results are the same
objects (:class:`GenerationResult`), and a prompt's output does not depend on its batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from preprocessing.tokenizer import Tokenizer
from training.inference.decode import (
    BatchRows,
    Generation,
    GenerationResult,
    SampledToken,
    SamplingConfig,
    _apply_stop,
    mask_vocab,
)
from training.inference.runtime import decoding, model_device
from training.models.t5 import T5Model


def generate_seq2seq(
    model: T5Model,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    sampling: SamplingConfig | None = None,
    *,
    batch_size: int = 8,
    autocast_dtype: torch.dtype | None = None,
) -> GenerationResult:
    """The decoder's output for each prompt (the encoder input), in the input order;
    ``sampling`` defaults to :class:`SamplingConfig`'s defaults."""
    sampling = sampling or SamplingConfig()
    if tokenizer.pad_id is None:
        raise ValueError("T5 generation needs the tokenizer's <|pad|> id (the decoder start)")
    start = time.perf_counter()
    encoded = [encoder_ids(tokenizer, p) for p in prompts]
    generations, sampled = [], 0
    for first in range(0, len(prompts), batch_size):
        rows = range(first, min(first + batch_size, len(prompts)))
        results = generate_seq2seq_ids(
            model,
            [encoded[i] for i in rows],
            sampling,
            pad_id=tokenizer.pad_id,
            eod_id=tokenizer.eod_id,
            vocab_size=tokenizer.vocab_size,
            seeds=[sampling.seed + i for i in rows],
            autocast_dtype=autocast_dtype,
        )
        for i, (ids, reason) in zip(rows, results, strict=True):
            sampled += len(ids) + (reason in ("eod", "stop"))
            text = tokenizer.decode(ids)
            generations.append(Generation(prompts[i], text, ids, len(encoded[i]), reason))
    return GenerationResult(generations, sampled, time.perf_counter() - start)


def encoder_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A T5 prompt's encoder input: its tokens, then EOS, as span-corruption samples end."""
    return with_eos(tokenizer, tokenizer.encode(text))


def with_eos(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """Encoder input ``ids`` ended with EOS, as T5 samples end (a chat's templated prompt
    too, as :mod:`training.data.t5_chat_dataset` trains it)."""
    return [*ids, tokenizer.eod_id]


def answer_text(tokenizer: Tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """A T5's answer: the decoder's tokens alone (the prompt was the encoder's input)."""
    return tokenizer.decode(list(new_ids))


def generate_seq2seq_batch(
    model: T5Model,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Sequence[SamplingConfig],
    **options: Any,
) -> list[tuple[list[int], str, int]]:
    """:func:`generate_seq2seq_ids` with the tokenizer's pad (decoder start), EOD and
    vocabulary, as :func:`~training.inference.decode.generate_batch` answers: ``(new ids,
    finish reason, prompt tokens)`` per prompt."""
    results = generate_seq2seq_ids(
        model, prompts, sampling, pad_id=tokenizer.pad_id, eod_id=tokenizer.eod_id,
        vocab_size=tokenizer.vocab_size, **options,
    )  # fmt: skip
    return [(ids, reason, len(p)) for (ids, reason), p in zip(results, prompts, strict=True)]


@torch.no_grad()
def generate_seq2seq_ids(
    model: T5Model,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Sequence[SamplingConfig],
    *,
    pad_id: int,
    eod_id: int,
    vocab_size: int | None = None,
    seeds: Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
    on_token: Callable[[int, SampledToken], None] | None = None,
    stop: Callable[[int], str | None] | None = None,
) -> list[tuple[list[int], str]]:
    """``(new ids, finish reason)`` for each encoder prompt of one batch.

    ``sampling`` is one config for every row or one per row. The final EOD is left out
    of the ids, and ends the row when its ``stop_at_eod``; a token of its ``stop_ids``
    ends it too (finish reason ``stop``), also left out. ``on_token(row, token)`` and
    ``stop(row)`` work as in :func:`training.inference.decode.generate_ids`.
    """
    if not prompts or not all(prompts):
        raise ValueError("every prompt needs at least one token")
    device = model_device(model)
    rows = len(prompts)
    batch = BatchRows(sampling, rows, seeds)
    steps = max(config.max_new_tokens for config in batch.configs)
    encoder_tokens, encoder_mask = _padded(prompts, pad_id, device)
    finish = batch.finish
    if steps > 0:
        cache = model.new_kv_cache(rows, steps, dtype=autocast_dtype)
        step = torch.full((rows, 1), pad_id, dtype=torch.long, device=device)
        with decoding(device, autocast_dtype):
            encoded = model.encode(encoder_tokens, encoder_mask)
    for position in range(steps):
        _apply_stop(stop, finish)
        if all(finish):
            break
        with decoding(device, autocast_dtype):
            logits = model.decode(step, encoded, encoder_mask, kv_cache=cache, start_pos=position)
        active = [row for row in range(rows) if not finish[row]]
        sampled = batch.step(mask_vocab(logits[:, -1], vocab_size), active, eod_id, on_token)
        step = sampled[:, None]
    return list(zip(batch.new, finish, strict=True))


def _padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``tokens [B, S]`` right-padded with ``pad_id``, and the bool mask of real tokens."""
    length = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = True
    return tokens.to(device), mask.to(device)


__all__ = ["generate_seq2seq", "generate_seq2seq_ids"]
