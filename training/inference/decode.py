"""Sampled generation with a KV cache: greedy, temperature, top-k and top-p (nucleus).

Prompts of different lengths share one batch without padding: the batch is
prefilled up to the shortest prompt, then advances one position at a time, feeding
each row its own prompt token while it has one and its sampled token after that
(as in Meta's Llama reference code). Every row stays at the same position, so no
attention mask is needed and the result equals running each prompt alone (up to
floating-point rounding).

Each prompt samples from its own random stream seeded with ``seed + its index``
(:class:`RowStream`: draw ``i`` of seed ``s`` is a hash of ``(s, i)``), so a prompt's text
depends on the seed and the prompt, not on the batch it ran in, and a batch draws for all
its rows in one pass (a ``torch.Generator`` per row took a kernel launch per row and step).
Every prompt starts after the end-of-document token, as every training document does.

``generate_ids`` also takes one ``SamplingConfig`` per row (its own temperature, top-k,
top-p, seed, token budget and EOD stop), reports each new token as it is sampled
(a :class:`SampledToken`, with its log-probability and the most likely alternatives when
the row's ``logprobs`` asks) and asks a ``stop`` callback whether a row should end early:
the serving engine (``deploy.engine``) decodes the concurrent requests of one batch
through it.

Log-probabilities are those of the model's own next-token distribution: ``log_softmax``
of the raw logits over the tokenizer's vocabulary, before temperature, top-k and top-p.
That is what OpenAI's API reports and vLLM's default (``logprobs_mode="raw_logprobs"``):
a token's log-probability does not depend on the sampling settings, is defined for greedy
decoding, and is finite for every alternative (a filtered distribution would give
``-inf`` to the alternatives top-k or top-p removed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from preprocessing.tokenizer import Tokenizer
from training.inference.runtime import decoding, model_device
from training.models.gpt import GPTModel

# Sampling limits a request may ask for (serving, the MLflow pyfunc).
MAX_SEED = 2**63 - 1
# Dividing the logits by a temperature below this, or keeping a nucleus below MIN_TOP_P
# (0 in float32), turns every probability into NaN: the whole batch would fail.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6
MAX_TOP_LOGPROBS = 20  # most likely alternatives a token may report (OpenAI's limit)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. ``temperature=0`` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = None  # keep the k most likely tokens; None: all
    top_p: float | None = 0.95  # keep the smallest set holding this much probability; None: all
    seed: int = 1234
    stop_at_eod: bool = True
    stop_ids: tuple[int, ...] = ()  # more tokens that end the text (finish "stop"), left out
    logprobs: int | None = None  # None: no log-probabilities; N: the token's and N alternatives

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SampledToken:
    """A new token as ``on_token`` reports it. ``logprob`` and ``top_logprobs`` (the most
    likely ``(id, logprob)`` pairs, most likely first) are filled only for a row whose
    ``SamplingConfig.logprobs`` is set; see the module docstring for their definition."""

    id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Generation:
    prompt: str
    text: str  # the continuation only
    token_ids: list[int]  # generated tokens, the final EOD left out
    prompt_tokens: int
    finish_reason: Literal["eod", "stop", "length"]

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
        }


@dataclass(frozen=True)
class GenerationResult:
    generations: list[Generation]
    sampled_tokens: int  # every token sampled, final EODs included
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.sampled_tokens / self.seconds if self.seconds > 0 else 0.0


def generate(
    model: GPTModel,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    batch_size: int = 8,
    autocast_dtype: torch.dtype | None = None,
) -> GenerationResult:
    """Continue each prompt; prompts are batched by length, results keep the input order."""
    start = time.perf_counter()
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    outputs: dict[int, tuple[list[int], str, int]] = {}
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        results = generate_ids(
            model,
            [encoded[i] for i in batch],
            sampling,
            eod_id=tokenizer.eod_id,
            vocab_size=tokenizer.vocab_size,
            seeds=[sampling.seed + i for i in batch],
            autocast_dtype=autocast_dtype,
        )
        outputs.update(zip(batch, results, strict=True))

    generations, sampled = [], 0
    for i, prompt in enumerate(prompts):
        ids, reason, prompt_tokens = outputs[i]
        sampled += len(ids) + (reason in ("eod", "stop"))
        text = continuation_text(tokenizer, encoded[i][-prompt_tokens:], ids)
        generations.append(Generation(prompt, text, ids, prompt_tokens, reason))
    return GenerationResult(generations, sampled, time.perf_counter() - start)


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A GPT prompt's tokens: EOD first, as every pretraining document follows one."""
    return [tokenizer.eod_id, *tokenizer.encode(text)]


@torch.no_grad()
def generate_ids(
    model: GPTModel,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Sequence[SamplingConfig],
    *,
    eod_id: int,
    vocab_size: int | None = None,
    seeds: Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
    on_token: Callable[[int, SampledToken], None] | None = None,
    stop: Callable[[int], str | None] | None = None,
) -> list[tuple[list[int], str, int]]:
    """Token-level generation for one batch: ``(new ids, finish reason, prompt tokens used)``.

    ``sampling`` is one config for every row or one per row. Prompts longer than the
    model allows (with their ``max_new_tokens`` after them) lose their oldest tokens.
    ``vocab_size`` masks the padded vocabulary's unused ids. ``on_token(row, token)`` sees
    every new token as it is sampled (not the final EOD); before each step
    ``stop(row)`` may end an unfinished row with the reason it returns.
    """
    device = model_device(model)
    batch = BatchRows(sampling, len(prompts), seeds)
    max_new = [c.max_new_tokens for c in batch.configs]
    limit = model.config.max_position_embeddings
    prompts = [fit_prompt(p, limit, m) for p, m in zip(prompts, max_new, strict=True)]
    lengths = [len(p) for p in prompts]
    total = max(length + m for length, m in zip(lengths, max_new, strict=True))
    tokens, in_prompt = _prompt_grid(prompts, total, eod_id, device)
    rows, finish = len(prompts), batch.finish

    # Under autocast keys and values are computed in its dtype: store them so.
    cache = model.new_kv_cache(rows, total, dtype=autocast_dtype)
    position = min(lengths)
    with decoding(device, autocast_dtype):
        logits = model(tokens[:, :position], kv_cache=cache, start_pos=0)[:, -1]
    while True:
        _apply_stop(stop, finish)
        if position >= total or all(finish):
            break
        active = [r for r in range(rows) if not finish[r] and position >= lengths[r]]
        sampled = batch.step(mask_vocab(logits, vocab_size), active, eod_id, on_token)
        tokens[:, position] = torch.where(in_prompt[:, position], tokens[:, position], sampled)
        position += 1
        if position < total and not all(finish):
            with decoding(device, autocast_dtype):
                step = tokens[:, position - 1 : position]
                logits = model(step, kv_cache=cache, start_pos=position - 1)[:, -1]
    return [(batch.new[r], finish[r], lengths[r]) for r in range(rows)]


class BatchRows:
    """The rows of one generation batch: each one's settings and random stream (seeded
    with ``seeds[row]``, by default its ``seed + row``), its new tokens and how it ended."""

    def __init__(
        self,
        sampling: SamplingConfig | Sequence[SamplingConfig],
        rows: int,
        seeds: Sequence[int] | None,
    ) -> None:
        configs = [sampling] * rows if isinstance(sampling, SamplingConfig) else list(sampling)
        if len(configs) != rows:
            raise ValueError(f"{len(configs)} sampling configs for {rows} prompts")
        if seeds is None:
            seeds = [config.seed + row for row, config in enumerate(configs)]
        self.configs = configs
        self.streams = [RowStream(seed) for seed in seeds]
        self.new: list[list[int]] = [[] for _ in range(rows)]
        self.finish = ["length" if c.max_new_tokens == 0 else "" for c in configs]

    def step(
        self,
        logits: Tensor,
        active: list[int],
        eod_id: int,
        on_token: Callable[[int, SampledToken], None] | None,
    ) -> Tensor:
        """Sample the next token of every ``active`` row from ``logits [B, V]`` and record
        it; returns the ``[B]`` sampled ids (the argmax for inactive rows)."""
        sampled, tokens = sample_tokens(logits, self.configs, self.streams, active)
        for row, token in zip(active, tokens, strict=True):
            self.take(row, token, eod_id, on_token)
        return sampled

    def take(
        self,
        row: int,
        token: SampledToken,
        eod_id: int,
        on_token: Callable[[int, SampledToken], None] | None,
    ) -> None:
        """Record a sampled token: EOD or a stop token ends the row (and is left out)."""
        config = self.configs[row]
        if config.stop_at_eod and token.id == eod_id:
            self.finish[row] = "eod"
        elif token.id in config.stop_ids:
            self.finish[row] = "stop"
        else:
            self.new[row].append(token.id)
            if on_token is not None:
                on_token(row, token)
            if len(self.new[row]) == config.max_new_tokens:
                self.finish[row] = "length"


def _apply_stop(stop: Callable[[int], str | None] | None, finish: list[str]) -> None:
    if stop is None:
        return
    for row, reason in enumerate(finish):
        if not reason:
            finish[row] = stop(row) or ""


def sample_tokens(
    logits: Tensor,
    configs: Sequence[SamplingConfig],
    streams: Sequence[RowStream],
    rows: Sequence[int],
) -> tuple[Tensor, list[SampledToken]]:
    """:func:`sample_rows`, plus each of ``rows``' token as a :class:`SampledToken` (with
    log-probabilities where its config asks): ``([B] ids, one token per row of rows)``."""
    sampled = sample_rows(logits, configs, streams, rows)
    scoring = [r for r in rows if configs[r].logprobs is not None]
    scored = dict(zip(scoring, scored_tokens(logits, sampled, scoring, configs), strict=True))
    ids = sampled[list(rows)].tolist()
    return sampled, [scored.get(r) or SampledToken(t) for r, t in zip(rows, ids, strict=True)]


def scored_tokens(
    logits: Tensor, sampled: Tensor, rows: Sequence[int], configs: Sequence[SamplingConfig]
) -> list[SampledToken]:
    """The sampled token of each of ``rows`` with its log-probability under ``logits [B, V]``
    (raw: before temperature and filtering) and its config's ``logprobs`` alternatives."""
    if not rows:
        return []
    index = torch.tensor(list(rows), device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    ids = sampled[index]
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    most = max(configs[r].logprobs or 0 for r in rows)
    top_values, top_ids = logprobs.topk(most, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    tokens = []
    for i, (row, token) in enumerate(zip(rows, ids.tolist(), strict=True)):
        n = configs[row].logprobs or 0
        top = tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        tokens.append(SampledToken(token, chosen[i], top))
    return tokens


def sample_rows(
    logits: Tensor,
    configs: Sequence[SamplingConfig],
    streams: Sequence[RowStream],
    rows: Sequence[int],
) -> Tensor:
    """The next token of each row of ``logits [B, V]`` under that row's own config.

    Rows sharing a temperature, top-k and top-p are filtered and drawn together; each of
    ``rows`` draws from its own stream, every other row gets the argmax.
    """
    choice = logits.argmax(dim=-1)
    groups: dict[tuple[float, int | None, float | None], list[int]] = {}
    for row in rows:
        config = configs[row]
        if not config.greedy:
            groups.setdefault((config.temperature, config.top_k, config.top_p), []).append(row)
    for members in groups.values():
        index = torch.tensor(members, device=logits.device)
        own = [streams[r] for r in members]
        choice[index] = next_tokens(logits[index], configs[members[0]], own)
    return choice


def next_tokens(
    logits: Tensor,
    sampling: SamplingConfig,
    streams: Sequence[RowStream],
    rows: Sequence[int] | None = None,
) -> Tensor:
    """The next token of each row of ``logits [B, V]``: argmax when greedy, else sampled.

    Only ``rows`` (default: all) draw from their stream; other rows get the argmax.
    Sampling is the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per token picks
    token ``i`` with probability ``p_i``, in one pass over the batch.
    """
    choice = logits.argmax(dim=-1)
    if sampling.greedy:
        return choice
    rows = list(range(logits.size(0)) if rows is None else rows)
    if not rows:
        return choice
    index = torch.tensor(rows, device=logits.device)
    scaled = logits[index].float() / sampling.temperature
    probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
    noise = exponential_noise([streams[r] for r in rows], logits.size(-1), logits.device)
    choice[index] = (probs / noise).argmax(dim=-1)
    return choice


class RowStream:
    """One row's random numbers. Draw ``i`` of seed ``s`` is a hash of ``(s, i)`` alone (a
    counter-based generator, as Philox is), so a row draws the same numbers whichever batch
    it is in (the same random bits on CPU and CUDA), and a batch draws all its rows' in one
    pass."""

    def __init__(self, seed: int) -> None:
        self.seed = (seed + 2**63) % 2**64 - 2**63  # any int, as the int64 it wraps to
        self.draws = 0


# splitmix64 (Steele, Lea and Flood 2014; Vigna's constants), as signed int64: torch has no
# uint64 arithmetic, and int64 products wrap modulo 2**64 as the unsigned ones do.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Tensor) -> Tensor:
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    return z ^ _shift_right(z, 31)


def stream_bits(streams: Sequence[RowStream], width: int, device: torch.device) -> Tensor:
    """``[len(streams), width]`` random 24-bit integers: row ``b`` is ``streams[b]``'s next
    draw (which advances it). Integer arithmetic only: the same bits on every device."""
    seeds = torch.tensor([s.seed for s in streams], dtype=torch.int64, device=device)
    draws = torch.tensor([s.draws for s in streams], dtype=torch.int64, device=device)
    for stream in streams:
        stream.draws += 1
    key = _mix(_mix(seeds) + draws)
    columns = torch.arange(width, dtype=torch.int64, device=device)
    return _shift_right(_mix(key[:, None] + columns * _GOLDEN), 40)  # the top 24 bits


def exponential_noise(streams: Sequence[RowStream], width: int, device: torch.device) -> Tensor:
    """``[len(streams), width]`` independent Exp(1) samples from :func:`stream_bits`
    (``log`` may round differently on another device)."""
    return exponential_of_bits(stream_bits(streams, width, device))


def exponential_of_bits(bits: Tensor) -> Tensor:
    """Exp(1) samples (float32, finite and > 0) of uniform 24-bit integers. The uniform
    ``(bits + 0.5) / 2**24`` is formed in float64: in float32 the largest would round up to
    1, whose sample 0 would make the race's ``p / E`` NaN for the tokens with ``p = 0``."""
    uniform = (bits.double() + 0.5) * 2.0**-24  # in (0, 1), exactly
    return (-torch.log(uniform)).float()


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to ``-inf`` every logit outside the top ``top_k`` and outside the nucleus of
    mass ``top_p`` (the most likely tokens whose probabilities reach ``top_p``)."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, indices = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A token is outside the nucleus once the more likely tokens already reach top_p;
        # the most likely token has mass_before 0 and always stays.
        outside_sorted = mass_before >= top_p
        outside = torch.zeros_like(outside_sorted).scatter(-1, indices, outside_sorted)
        logits = logits.masked_fill(outside, float("-inf"))
    return logits


def generate_batch(
    model: GPTModel,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig | Sequence[SamplingConfig],
    **options: Any,
) -> list[tuple[list[int], str, int]]:
    """:func:`generate_ids` with the tokenizer's EOD and vocabulary: ``(new ids, finish
    reason, prompt tokens used)`` per prompt; ``options``: seeds, autocast_dtype,
    on_token, stop."""
    return generate_ids(
        model, prompts, sampling, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size,
        **options,
    )  # fmt: skip


def continuation_text(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int]
) -> str:
    """The text the new tokens add to the prompt, with its leading space (which decoding
    the new tokens alone would drop)."""
    prompt_text = tokenizer.decode(prompt_ids)
    full = tokenizer.decode([*prompt_ids, *new_ids])
    return full[len(prompt_text) :] if full.startswith(prompt_text) else tokenizer.decode(new_ids)


def _prompt_grid(
    prompts: Sequence[Sequence[int]], total: int, fill: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``tokens [B, total]`` holding each prompt from position 0, and where they are."""
    tokens = torch.full((len(prompts), total), fill, dtype=torch.long)
    in_prompt = torch.zeros((len(prompts), total), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
        in_prompt[row, : len(prompt)] = True
    return tokens.to(device), in_prompt.to(device)


def fit_prompt(prompt: Sequence[int], max_positions: int, max_new_tokens: int) -> list[int]:
    room = max_positions - max_new_tokens
    if room < 1:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's "
            f"{max_positions} positions"
        )
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    return list(prompt[-room:])


def mask_vocab(logits: Tensor, vocab_size: int | None) -> Tensor:
    if vocab_size is None or vocab_size >= logits.size(-1):
        return logits
    return torch.cat(
        [
            logits[:, :vocab_size],
            logits.new_full((logits.size(0), logits.size(-1) - vocab_size), float("-inf")),
        ],
        dim=-1,
    )
