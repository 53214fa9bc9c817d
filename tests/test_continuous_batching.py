"""Continuous batching over a paged KV cache (deploy.continuous): every request's tokens
equal what ``training.inference.decode.generate_ids`` gives its prompt alone, however
requests join, share prefixes, prefill in chunks or wait for blocks.

The model is test_evaluation's tiny GPT (random weights with peaked next-token
distributions, so greedy decoding has no near-ties) on the session's tokenizer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_evaluation import tiny_model
from test_serving import Collector
from test_t5_model import tiny_t5

from deploy.continuous import ContinuousEngine
from deploy.engine import EngineBusy, EngineClosed, Finished, PendingRequest
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from training.inference.block_pool import BlockPool, block_hashes
from training.inference.decode import SampledToken, SamplingConfig, generate_ids
from training.inference.decode_graphs import DecodeGraphs, row_buckets
from training.inference.loading import ModelInfo, ServedModel
from training.inference.paged_cache import PagedKVCache
from training.models.t5 import T5Model

TEXTS = [
    "Once upon a time",
    "The horse says",
    "Tara has a frog named Pebble and",
    "In the morning the children walked to the river to look for",
    "Five",
    "The capital of Valdoria is",
    "A cat",
    "Mia and Leo built a boat out of old boxes, and then they",
]
SYSTEM = "You are a helpful assistant who answers in short and simple sentences."


@pytest.fixture(scope="module")
def tokenizer(shards: Path) -> Tokenizer:
    return load_tokenizer(str(Path(shards) / "tokenizer.model"))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def served(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> ServedModel:
    """RoPE with GQA (llama) and learned positions (gpt2)."""
    model = tiny_model(tokenizer, style=request.param)
    config = model.config
    info = ModelInfo(
        request.param, request.param, None, None, "0" * 64, config.max_position_embeddings, 0.0
    )
    return ServedModel(model, tokenizer, info)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [tokenizer.eod_id, *tokenizer.encode(text)]


def alone(served: ServedModel, prompt: list[int], sampling: SamplingConfig) -> Finished:
    """The reference: ``prompt`` decoded on its own."""
    return alone_tokens(served, prompt, sampling)[0]


def alone_tokens(
    served: ServedModel, prompt: list[int], sampling: SamplingConfig
) -> tuple[Finished, list[SampledToken]]:
    """The reference, with the tokens its ``on_token`` saw."""
    tokenizer = served.tokenizer
    model: Any = served.model
    seen: list[SampledToken] = []
    new, reason, used = generate_ids(
        model, [prompt], sampling, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size,
        on_token=lambda _, token: seen.append(token),
    )[0]  # fmt: skip
    return Finished(new, reason, used), seen


class Tokens(Collector):
    """A Collector that keeps the whole SampledToken too."""

    def __init__(self) -> None:
        super().__init__()
        self.sampled: list[SampledToken] = []

    def on_token(self, token: SampledToken) -> None:
        super().on_token(token)
        self.sampled.append(token)


def request(prompt: list[int], sampling: SamplingConfig, sink: Collector) -> PendingRequest:
    return PendingRequest(prompt, sampling, time.monotonic() + 60, sink.on_token, sink.on_done)


def results(sinks: list[Collector]) -> list[Finished | BaseException | None]:
    for sink in sinks:
        assert sink.done.wait(60), "a request did not finish"
    return [sink.result for sink in sinks]


def greedy(max_new_tokens: int, **more: Any) -> SamplingConfig:
    return SamplingConfig(max_new_tokens, temperature=0.0, **more)


def stop_after(engine: ContinuousEngine) -> dict[str, Any]:
    engine.retire()
    assert engine.join(60)
    return engine.kv_stats()


@pytest.mark.parametrize("padded", [False, True], ids=["steps", "padded-steps"])
def test_many_concurrent_requests_equal_each_alone(served: ServedModel, padded: bool) -> None:
    """Prompts of different lengths and budgets, greedy and sampled rows with their own
    seeds, some asking for log-probabilities, more requests than may run at once: they
    join as others leave. Tokens, finish reasons and log-probabilities are as alone.
    ``padded``: decode steps padded as CUDA graphs run them (rows to a bucket, keys to a
    multiple of 8), without a graph on CPU."""
    tokenizer = served.tokenizer
    prompts = [ids(tokenizer, text) for text in TEXTS]
    settings = [
        greedy(4 + 3 * i, logprobs=i % 4 or None) if i % 3 else
        SamplingConfig(12 - i, temperature=1.1, top_k=20, top_p=0.9, seed=7 * i, logprobs=2)
        for i in range(len(prompts))
    ]  # fmt: skip
    engine = ContinuousEngine(served, block_size=4, max_running=5, prefill_chunk=16)
    if padded:
        engine.graphs = DecodeGraphs(engine.model, engine.cache, 5, key_bucket=8, capture=False)
    sinks = [Tokens() for _ in prompts]
    for prompt, sampling, sink in zip(prompts, settings, sinks, strict=True):
        engine.submit(request(prompt, sampling, sink))
    engine.start()
    got = results(list(sinks))
    for prompt, sampling, sink, result in zip(prompts, settings, sinks, got, strict=True):
        expected, seen = alone_tokens(served, prompt, sampling)
        assert result == expected
        assert [t.id for t in sink.sampled] == [t.id for t in seen] == expected.token_ids
        for token, reference in zip(sink.sampled, seen, strict=True):
            if reference.logprob is None:
                assert (token.logprob, token.top_logprobs) == (None, ())
                continue
            assert token.logprob == pytest.approx(reference.logprob, abs=1e-4)
            assert [i for i, _ in token.top_logprobs] == [i for i, _ in reference.top_logprobs]
    stats = stop_after(engine)
    assert stats["engine_largest_batch"] == 5 and stats["engine_requests"] == len(prompts)
    if padded:  # rows 1..5 ran in the buckets 1, 2, 4 and 5; five at once in bucket 5
        rows_used = {rows for rows, _ in engine.graphs._buckets}
        assert 5 in rows_used and rows_used <= {1, 2, 4, 5}, rows_used
        assert {keys % 8 for _, keys in engine.graphs._buckets} == {0}
    assert (stats["blocks_used"], stats["running"], stats["queued"]) == (0, 0, 0)
    with pytest.raises(EngineClosed):
        engine.submit(request(prompts[0], greedy(2), Collector()))


def test_requests_joining_mid_decode_and_long_prompts_in_chunks(served: ServedModel) -> None:
    """Requests submitted while another decodes join it at the next step; a long prompt
    is read 4 tokens a step while the running row keeps decoding."""
    tokenizer = served.tokenizer
    first = ids(tokenizer, TEXTS[0])
    long_prompt = ids(tokenizer, " ".join(TEXTS[2:5]))
    assert len(long_prompt) > 24
    later = [long_prompt, ids(tokenizer, TEXTS[5]), ids(tokenizer, TEXTS[6])]
    engine = ContinuousEngine(served, block_size=4, prefill_chunk=4)
    events: list[tuple[int, int]] = []  # (request, token) in the order they were sampled
    sinks = [Collector() for _ in range(4)]

    def record(index: int) -> Any:
        def on_token(token: SampledToken) -> None:
            sinks[index].on_token(token)
            events.append((index, token.id))
            if index == 0 and len(sinks[0].tokens) == 2:  # mid-decode: the others arrive
                for i, prompt in enumerate(later, start=1):
                    joining = request(prompt, greedy(8, stop_at_eod=False), sinks[i])
                    joining.on_token = record(i)
                    engine.submit(joining)

        return on_token

    head = request(first, greedy(30, stop_at_eod=False), sinks[0])
    head.on_token = record(0)
    engine.submit(head)
    engine.start()
    got = results(sinks)
    assert got[0] == alone(served, first, greedy(30, stop_at_eod=False))
    assert got[1:] == [alone(served, p, greedy(8, stop_at_eod=False)) for p in later]
    # The long prompt took ceil(len / 4) steps; the first request decoded through them.
    first_of_long = events.index((1, sinks[1].tokens[0]))
    during = [i for i, _ in events[:first_of_long]].count(0) - 2
    assert during >= len(long_prompt) // 4 - 1
    assert stop_after(engine)["blocks_used"] == 0


def test_a_shared_system_prompt_is_read_from_the_prefix_cache(served: ServedModel) -> None:
    tokenizer = served.tokenizer
    system = ids(tokenizer, SYSTEM)
    prompts = [system + tokenizer.encode(" " + text) for text in TEXTS[:4]]
    engine = ContinuousEngine(served, block_size=4, prefill_chunk=8).start()
    sink = Collector()
    engine.submit(request(prompts[0], greedy(6), sink))  # alone first: its blocks get cached
    assert results([sink]) == [alone(served, prompts[0], greedy(6))]
    stats = engine.kv_stats()
    assert (stats["prefix_hits"], stats["blocks_used"]) == (0, 0)
    assert stats["blocks_cached"] == len(prompts[0]) // 4
    sinks = [Collector() for _ in prompts[1:]]
    for prompt, each in zip(prompts[1:], sinks, strict=True):
        engine.submit(request(prompt, greedy(6), each))
    assert results(sinks) == [alone(served, p, greedy(6)) for p in prompts[1:]]
    stats = stop_after(engine)
    shared_blocks = len(system) // 4  # the system prompt's full blocks
    assert stats["prefix_hits"] >= 3 * shared_blocks * 4
    assert stats["prefix_queries"] == sum(len(p) for p in prompts)
    assert stats["blocks_used"] == 0 and stats["blocks_cached"] > 0


def test_admission_waits_for_blocks_and_a_full_queue_is_busy(served: ServedModel) -> None:
    tokenizer = served.tokenizer
    context = served.info.max_positions
    # Room for one sequence of the whole context: each request here needs most of it.
    engine = ContinuousEngine(served, block_size=8, num_blocks=context // 8, max_queue=3)
    prompts = [ids(tokenizer, text) for text in TEXTS[:3]]
    sampling = greedy(40, stop_at_eod=False)
    sinks = [Collector() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):
        engine.submit(request(prompt, sampling, sink))
    with pytest.raises(EngineBusy):
        engine.submit(request(prompts[0], sampling, Collector()))
    engine.start()
    assert results(sinks) == [alone(served, p, sampling) for p in prompts]
    stats = stop_after(engine)
    assert stats["engine_largest_batch"] == 1  # each waited for the blocks of the one before
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        ContinuousEngine(served, block_size=8, num_blocks=context // 8 - 1)


def test_cancelled_and_timed_out_requests_free_their_blocks(served: ServedModel) -> None:
    tokenizer = served.tokenizer
    sampling = greedy(20, stop_at_eod=False)
    names = ["timed", "cancelled", "late", "whole", "empty"]
    sinks = {name: Collector() for name in names}
    requests = {
        name: request(ids(tokenizer, text), sampling, sinks[name])
        for name, text in zip(names, TEXTS, strict=False)
    }
    requests["late"].deadline = time.monotonic() - 1  # expired while it waited
    requests["empty"].prompt_ids = []

    def after_three(name: str, stop: Any) -> Any:
        def on_token(token: SampledToken) -> None:
            sinks[name].on_token(token)
            if len(sinks[name].tokens) == 3:
                stop()

        return on_token

    timed, cancelled = requests["timed"], requests["cancelled"]
    timed.on_token = after_three("timed", lambda: setattr(timed, "deadline", 0))
    cancelled.on_token = after_three("cancelled", cancelled.cancelled.set)
    engine = ContinuousEngine(served, block_size=4)
    for name in names:
        engine.submit(requests[name])
    engine.start()
    got = dict(zip(names, results(list(sinks.values())), strict=True))
    assert isinstance(got.pop("empty"), ValueError)
    outcomes = {name: (r.finish_reason, len(r.token_ids)) for name, r in got.items()}  # type: ignore[union-attr]
    assert outcomes == {
        "timed": ("timeout", 3),
        "cancelled": ("cancelled", 3),
        "late": ("timeout", 0),
        "whole": ("length", 20),
    }
    stats = stop_after(engine)
    assert (stats["blocks_used"], stats["blocks_free"]) == (0, engine.pool.num_blocks)


def test_a_t5_is_refused(served: ServedModel) -> None:
    t5 = T5Model(tiny_t5(vocab_size=served.model.config.vocab_size))
    with pytest.raises(ValueError, match="GPT models"):
        ContinuousEngine(ServedModel(t5, served.tokenizer, served.info))


def test_a_failing_callback_does_not_stop_the_other_rows(served: ServedModel) -> None:
    prompt = ids(served.tokenizer, TEXTS[1])
    engine = ContinuousEngine(served, block_size=4)
    failing, fine = Collector(), Collector()
    broken = request(prompt, greedy(5), failing)

    def client_gone(token: SampledToken) -> None:
        raise RuntimeError("client gone")

    broken.on_token = client_gone
    engine.submit(broken)
    engine.submit(request(prompt, greedy(5), fine))
    engine.start()
    expected = alone(served, prompt, greedy(5))
    assert results([failing, fine]) == [expected, expected]
    assert fine.tokens == expected.token_ids
    assert stop_after(engine)["blocks_used"] == 0


def test_a_padded_decode_step_gives_the_plain_steps_logits_and_cache(
    served: ServedModel,
) -> None:
    """The step a CUDA graph replays, run without one: three rows padded to the bucket of
    four, keys padded to 16. Logits equal the plain step's; the blocks the rows own hold
    the same keys and values (padding writes only the scratch block)."""
    model: Any = served.model
    prompts = [ids(served.tokenizer, text) for text in TEXTS[1:4]]
    sizes = [math.ceil(len(p) / 4) for p in prompts]
    blocks = list(range(sum(sizes)))[::-1]  # not in order
    tables = [[blocks.pop() for _ in range(size)] for size in sizes]
    caches = [PagedKVCache.for_model(model, sum(sizes), 4) for _ in range(2)]
    for cache in caches:  # the prompts but their last token, as prefill leaves them
        starts, counts = [0, 0, 0], [len(p) - 1 for p in prompts]
        step = cache.step(tables, starts, counts)
        width = max(counts)
        rows = [p[:-1] + [p[-2]] * (width - len(p) + 1) for p in prompts]
        model.forward_rows(torch.tensor(rows), step.positions, step, step.attn_mask, step.last)
    last, starts = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]
    step = caches[0].step(tables, starts, [1, 1, 1])
    plain = model.forward_rows(
        torch.tensor(last)[:, None], step.positions, step, step.attn_mask, step.last
    )
    graphs = DecodeGraphs(model, caches[1], 6, key_bucket=16, capture=False)
    assert graphs.bucket_of(3, max(starts) + 1) == (4, 16 * math.ceil(max(starts) / 16))
    padded = graphs.forward(last, tables, starts)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    owned = sum(sizes) * 4  # the scratch block's slots come after
    for stored in ("keys", "values"):
        plain_kv, padded_kv = (getattr(c, stored)[:, :owned] for c in caches)
        torch.testing.assert_close(padded_kv, plain_kv, rtol=1e-5, atol=1e-5)
    assert row_buckets(5) == [1, 2, 4, 5] and row_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="1 to 6"):
        graphs.bucket_of(7, 10)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, caches[1], 6)
    with pytest.raises(ValueError, match="key_bucket 6 is not whole blocks of 4"):
        DecodeGraphs(model, caches[1], 6, key_bucket=6, capture=False)


def test_the_block_pool_keeps_freed_prefix_blocks_until_evicted_least_recent_first() -> None:
    pool = BlockPool(4)
    first, second = block_hashes([1, 2, 3, 4, 5, 6], 2)[:2], block_hashes([9, 9, 8, 8], 2)
    assert first[0] != second[0] and block_hashes([1, 2, 7], 2)[0] == first[0]  # chained
    a = pool.allocate(2)
    b = pool.allocate(2)
    for blocks, hashes in ((a, first), (b, second)):
        for block, digest in zip(blocks, hashes, strict=True):
            pool.publish(block, digest)
    pool.release(a)  # freed first: evicted first
    pool.release(b)
    assert (pool.used, pool.cached, pool.available()) == (0, 4, 4)
    assert pool.cached_prefix(first) == a
    assert pool.cached_prefix(block_hashes([7, 7, 3, 4], 2)) == []  # [3, 4] after other tokens
    pool.share(pool.cached_prefix(second))  # reused: out of the eviction order
    assert (pool.used, pool.available()) == (2, 2)
    assert sorted(pool.allocate(2)) == sorted(a)  # evicts a's blocks, forgetting their hashes
    assert pool.cached_prefix(first) == [] and pool.cached_prefix(second) == b
    with pytest.raises(ValueError, match="available"):
        pool.allocate(1)
