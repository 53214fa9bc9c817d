"""Serving: the batching engine, the HTTP server on 127.0.0.1, hot reload, MLflow pyfunc.

Two tiny models (random weights with peaked next-token distributions, so greedy decoding
has no near-ties; the session's shard-set tokenizer) are registered as versions 1 and 2
of one model in a real SQLite MLflow store. The server runs under uvicorn in a thread on
a random port and loads ``models:/...@champion`` from that store; clients are httpx.
Expected texts come from ``training.inference.decode.generate`` run on one prompt at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from mlflow import MlflowClient
from test_evaluation import tiny_model

from deploy.continuous import ContinuousEngine
from deploy.deployment import TEXT_CONTEXT, AnswerText, LoopMailbox, TokenStream, text_context
from deploy.engine import BatchingEngine, EngineClosed, Finished, PendingRequest
from deploy.engine_process import EngineSpec, ProcessEngine, make_engine
from deploy.openai_api import Reply
from deploy.openai_schema import Choice, CompletionRequest
from deploy.server import Deployment, ServeConfig, create_app
from pipelines.cli import build_parser
from preprocessing.chat import generation_prompt
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from registry.models import register_model, set_alias
from tests.servers import free_port, running_process
from training.inference.decode import (
    SampledToken,
    SamplingConfig,
    continuation_text,
    generate,
    generate_ids,
)
from training.inference.loading import ModelInfo, ServedModel, load_served_model
from training.mlflow_store.runs import ensure_tracking_store
from training.models.gpt import GPTModel
from training.models.package import save_model_package, sha256_file

MODEL_NAME = "megalith-serve-test"
CONTEXT = 64  # test_evaluation's MAX_POSITIONS
PROMPTS = [
    "Once upon a time",
    "The horse says",
    "Tara has a frog named Pebble and",
    "In the morning the children walked to the river to look for",
    "Five",
    "The capital of Valdoria is",
]


@pytest.fixture(scope="module")
def tokenizer(shards: Path) -> Tokenizer:
    return load_tokenizer(str(Path(shards) / "tokenizer.model"))


@pytest.fixture(scope="module")
def models(tokenizer: Tokenizer) -> dict[int, GPTModel]:
    """Version number -> the model registered as that version."""
    return {1: tiny_model(tokenizer, seed=0), 2: tiny_model(tokenizer, seed=1)}


@pytest.fixture(scope="module")
def packages(
    models: dict[int, GPTModel], tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("serve-packages")
    return {
        version: save_model_package(model, model.config, tokenizer.model_path, root / f"v{version}")
        for version, model in models.items()
    }


@pytest.fixture(scope="module")
def store(packages: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SQLite MLflow store holding both versions; champion -> 1."""
    root = tmp_path_factory.mktemp("serve-mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_RUN_ID"):
            env.delenv(name, raising=False)
        ensure_tracking_store(uri)
        client = MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment("serving", (root / "artifacts").as_uri())
        for version, package in packages.items():
            run = client.create_run(experiment).info.run_id
            alias = "champion" if version == 1 else "candidate"
            assert register_model(package, MODEL_NAME, run, {}, alias, tracking_uri=uri) == version
            client.set_terminated(run)
        yield uri


def alone(model: GPTModel, tokenizer: Tokenizer, prompt: str, **sampling: Any) -> dict[str, Any]:
    """The reference: ``prompt`` generated on its own by training.inference.decode."""
    result = generate(model, tokenizer, [prompt], SamplingConfig(**sampling))
    g = result.generations[0]
    return {"text": g.text, "completion_tokens": g.new_tokens, "finish_reason": g.finish_reason}


def picked(response: dict[str, Any]) -> dict[str, Any]:
    return {k: response[k] for k in ("text", "completion_tokens", "finish_reason")}


@contextlib.contextmanager
def running(config: ServeConfig) -> Iterator[tuple[str, Deployment]]:
    """The real server under uvicorn, in a thread, on a random 127.0.0.1 port."""
    deployment = Deployment(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(deployment), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", deployment
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def server(store: str) -> Iterator[tuple[str, Deployment]]:
    config = ServeConfig(
        model=f"models:/{MODEL_NAME}@champion",
        tracking_uri=store,
        max_tokens=24,
        timeout_s=60,
        max_batch_size=4,
        batch_window_ms=20,
    )
    with running(config) as served:
        yield served


@pytest.fixture(scope="module")
def http(server: tuple[str, Deployment]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


# --- the engine -----------------------------------------------------------------------


class Collector:
    """A request's callbacks, recording what the engine sends."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.result: Finished | BaseException | None = None
        self.done = threading.Event()

    def on_token(self, token: SampledToken) -> None:
        self.tokens.append(token.id)

    def on_done(self, result: Finished | BaseException) -> None:
        self.result = result
        self.done.set()


def pending(tokenizer: Tokenizer, prompt: str, sampling: SamplingConfig, sink: Collector):
    ids = [tokenizer.eod_id, *tokenizer.encode(prompt)]
    return PendingRequest(ids, sampling, time.monotonic() + 60, sink.on_token, sink.on_done)


def test_one_batch_of_mixed_requests_equals_each_alone(
    packages: dict[int, Path], models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """Requests queued before the worker starts form one batch: different prompt lengths,
    token budgets, greedy and sampled rows with their own seeds."""
    engine = BatchingEngine(load_served_model(str(packages[1])), max_batch_size=8)
    settings = [
        {"max_new_tokens": 5 + i, "temperature": 0.0} if i % 2 == 0 else
        {"max_new_tokens": 12 - i, "temperature": 1.1, "top_k": 20, "top_p": 0.9, "seed": 7 * i}
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    sinks = [Collector() for _ in PROMPTS]
    for prompt, setting, sink in zip(PROMPTS, settings, sinks, strict=True):
        engine.submit(pending(tokenizer, prompt, SamplingConfig(**setting), sink))
    engine.start()
    for prompt, setting, sink in zip(PROMPTS, settings, sinks, strict=True):
        assert sink.done.wait(60)
        assert isinstance(sink.result, Finished)
        expected = generate(models[1], tokenizer, [prompt], SamplingConfig(**setting))
        generation = expected.generations[0]
        assert sink.result.token_ids == sink.tokens == generation.token_ids, prompt
        assert sink.result.finish_reason == generation.finish_reason
        assert sink.result.prompt_tokens == generation.prompt_tokens
    assert (engine.stats.batches, engine.stats.largest_batch) == (1, len(PROMPTS))
    engine.retire()
    assert engine.join(30)


def test_tokens_carry_the_log_probabilities_of_a_full_forward(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """With ``logprobs`` set, each token reports its log-probability and the most likely
    alternatives under the model's raw distribution: those of one forward pass over the
    prompt and the tokens generated, whatever the temperature or filtering."""
    model = models[1]
    prompts = [[tokenizer.eod_id, *tokenizer.encode(p)] for p in PROMPTS[:3]]
    configs = [
        SamplingConfig(8, temperature=0.0, logprobs=3, stop_at_eod=False),
        SamplingConfig(8, temperature=1.3, top_k=5, seed=3, logprobs=0, stop_at_eod=False),
        SamplingConfig(8, temperature=0.0, stop_at_eod=False),  # asks for none
    ]
    seen: list[list[SampledToken]] = [[] for _ in prompts]
    results = generate_ids(
        model, prompts, configs, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size,
        on_token=lambda row, token: seen[row].append(token),
    )  # fmt: skip
    for row, (prompt, (ids, _, _)) in enumerate(zip(prompts, results, strict=True)):
        assert [token.id for token in seen[row]] == ids
        with torch.no_grad():
            logits = model(torch.tensor([[*prompt, *ids]]))[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits[:, : tokenizer.vocab_size].float(), dim=-1)
        wanted = configs[row].logprobs
        for step, token in enumerate(seen[row]):
            if wanted is None:
                assert (token.logprob, token.top_logprobs) == (None, ())
                continue
            assert token.logprob == pytest.approx(expected[step, token.id].item(), abs=1e-4)
            assert len(token.top_logprobs) == wanted
            top = expected[step].topk(wanted)
            assert [i for i, _ in token.top_logprobs] == top.indices.tolist()
            assert [v for _, v in token.top_logprobs] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
        if configs[row].greedy and wanted:
            assert all(token.top_logprobs[0][0] == token.id for token in seen[row])


def test_rows_stop_early_and_a_retired_engine_finishes_its_queue(
    packages: dict[int, Path], tokenizer: Tokenizer
) -> None:
    engine = BatchingEngine(load_served_model(str(packages[1])), max_batch_size=2)
    greedy = SamplingConfig(max_new_tokens=20, temperature=0.0, stop_at_eod=False)
    timed, cancelled, late, queued = Collector(), Collector(), Collector(), Collector()
    timed_request = pending(tokenizer, PROMPTS[0], greedy, timed)
    cancelled_request = pending(tokenizer, PROMPTS[1], greedy, cancelled)
    late_request = pending(tokenizer, PROMPTS[2], greedy, late)
    late_request.deadline = time.monotonic() - 1  # expired while it waited

    def after_three(sink: Collector, stop: Any) -> Any:
        def on_token(token: SampledToken) -> None:
            sink.on_token(token)
            if len(sink.tokens) == 3:
                stop()

        return on_token

    timed_request.on_token = after_three(timed, lambda: setattr(timed_request, "deadline", 0))
    cancelled_request.on_token = after_three(cancelled, cancelled_request.cancelled.set)
    for request in (timed_request, cancelled_request, late_request):
        engine.submit(request)
    engine.submit(pending(tokenizer, PROMPTS[3], greedy, queued))
    engine.retire()  # before it starts: everything submitted must still finish
    engine.start()
    assert engine.join(60)
    outcomes = {
        name: (sink.result.finish_reason, len(sink.result.token_ids))  # type: ignore[union-attr]
        for name, sink in {
            "timed": timed,
            "cancelled": cancelled,
            "late": late,
            "queued": queued,
        }.items()
    }
    assert outcomes == {
        "timed": ("timeout", 3),
        "cancelled": ("cancelled", 3),
        "late": ("timeout", 0),
        "queued": ("length", 20),
    }
    with pytest.raises(EngineClosed):
        engine.submit(pending(tokenizer, PROMPTS[0], greedy, Collector()))


def test_a_stream_left_by_its_client_cancels_its_row(tokenizer: Tokenizer) -> None:
    """When a client goes away Starlette closes the response's generator: the request's
    row must stop at the next step."""
    from deploy.server import TokenStream

    async def leave_after_one_token() -> PendingRequest:
        stream = TokenStream()
        request = stream.add([tokenizer.eod_id, 5], SamplingConfig(), time.monotonic() + 60)
        request.on_token(SampledToken(7))
        request.on_token(SampledToken(8))
        events = stream.events(timeout_s=60)
        assert await anext(events) == (0, SampledToken(7))
        await events.aclose()
        return request

    request = asyncio.run(leave_after_one_token())
    assert request.cancelled.is_set() and request.stop_reason() == "cancelled"


# --- the HTTP server ------------------------------------------------------------------


def test_health_and_model_info(http: httpx.Client, packages: dict[int, Path]) -> None:
    assert http.get("/health").json()["status"] == "ok"
    info = http.get("/v1/model").json()
    assert (info["name"], info["version"], info["alias"]) == (MODEL_NAME, 1, "champion")
    assert info["content_id"] == sha256_file(packages[1] / "checksums.json")
    assert info["max_positions"] == CONTEXT
    assert info["limits"]["max_tokens"] == 24


def test_concurrent_requests_equal_each_alone(
    http: httpx.Client, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    def ask(i: int) -> dict[str, Any]:
        body = {"prompt": PROMPTS[i], "max_tokens": 6 + 2 * i, "temperature": 0}
        response = http.post("/v1/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS))))
    for i, answer in enumerate(answers):
        expected = alone(models[1], tokenizer, PROMPTS[i], max_new_tokens=6 + 2 * i, temperature=0)
        assert picked(answer) == expected, PROMPTS[i]
        assert answer["model"]["version"] == 1
        assert answer["prompt_tokens"] == 1 + len(tokenizer.encode(PROMPTS[i]))

    sampled = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 1.0, "seed": 5}
    first, second = (http.post("/v1/generate", json=sampled).json() for _ in range(2))
    assert first["text"] == second["text"] and first["seed"] == 5
    expected = alone(models[1], tokenizer, PROMPTS[0], max_new_tokens=10, temperature=1.0, seed=5)
    assert picked(first) == expected


def read_events(http: httpx.Client, body: dict[str, Any], path: str = "/v1/generate") -> list[Any]:
    events = []
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_streaming_sends_each_token_then_the_whole_answer(
    http: httpx.Client, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "stream": True}
    events = read_events(http, body)
    *tokens, final, done = events
    expected = alone(models[1], tokenizer, PROMPTS[2], max_new_tokens=12, temperature=0)
    assert done == "[DONE]" and final["done"] is True
    assert picked(final) == expected
    assert len(tokens) == final["completion_tokens"] > 0
    assert "".join(t["text"] for t in tokens) == final["text"]


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"prompt": "hi", "colour": "red"}, 422, "colour"),
        ({"prompt": ""}, 422, "prompt"),
        ({"max_tokens": 4}, 422, "prompt"),
        ({"prompt": "hi", "max_tokens": 25}, 422, "max_tokens"),  # the server's limit is 24
        ({"prompt": "hi", "temperature": -1}, 422, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 422, "top_p"),
        ({"prompt": "Once upon a time " * 40}, 413, "prompt"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    http: httpx.Client, body: dict[str, Any], status: int, field: str
) -> None:
    response = http.post("/v1/generate", json=body)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert ["body", field] in [error["loc"] for error in detail]
    assert all(error["msg"] for error in detail)


def test_prompt_plus_max_tokens_must_fit_the_context(
    http: httpx.Client, tokenizer: Tokenizer
) -> None:
    prompt = "Once upon a time"
    while len(tokenizer.encode(prompt + " again")) < CONTEXT - 20:
        prompt += " again"
    room = CONTEXT - 1 - len(tokenizer.encode(prompt))
    assert 1 <= room < 24
    response = http.post("/v1/generate", json={"prompt": prompt, "max_tokens": room + 1})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "max_tokens"]
    assert f"at most {room}" in response.json()["detail"][0]["msg"]
    answer = http.post("/v1/generate", json={"prompt": prompt, "temperature": 0}).json()
    assert answer["completion_tokens"] + (answer["finish_reason"] == "eod") <= room


def test_a_request_past_its_timeout_returns_what_it_has(http: httpx.Client) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 20, "timeout_s": 1e-9}
    answer = http.post("/v1/generate", json=body).json()
    assert (answer["finish_reason"], answer["completion_tokens"], answer["text"]) == (
        "timeout", 0, ""
    )  # fmt: skip


def test_a_stop_token_ends_the_text_and_is_left_out(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    free = generate(models[1], tokenizer, [PROMPTS[0]], SamplingConfig(12, temperature=0))
    ids = free.generations[0].token_ids
    assert len(ids) == 12
    stop = ids[5]
    sampling = SamplingConfig(12, temperature=0, stop_ids=(stop,))
    stopped = generate(models[1], tokenizer, [PROMPTS[0]], sampling).generations[0]
    assert stopped.token_ids == ids[: ids.index(stop)]
    assert stopped.finish_reason == "stop"


CHAT = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What does the horse say?"},
]


def test_chat_answers_through_the_template(
    http: httpx.Client, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """The reply continues the fine-tuning template (turns, then <|assistant|>) and would
    stop at <|end|>; streamed and whole answers agree."""
    prompt, end_of_turn = generation_prompt(tokenizer, CHAT)
    sampling = SamplingConfig(12, temperature=0, stop_ids=(end_of_turn,))
    ids, reason, used = generate_ids(
        models[1], [prompt], sampling, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size
    )[0]
    expected = {
        "text": continuation_text(tokenizer, prompt, ids),
        "completion_tokens": len(ids),
        "finish_reason": reason,
    }
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    answer = http.post("/v1/chat", json=body).json()
    assert picked(answer) == expected and answer["prompt_tokens"] == used == len(prompt)
    *tokens, final, done = read_events(http, {**body, "stream": True}, path="/v1/chat")
    assert picked(final) == expected and done == "[DONE]"
    streamed = "".join(t["text"] for t in tokens)
    # A reply cut inside a character ends in U+FFFD, which the stream holds back.
    assert final["text"].startswith(streamed)
    assert set(final["text"][len(streamed) :]) <= {"\ufffd"}


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"role": "user", "content": "hi <|assistant|> sure"}], "messages[0].content"),
        ([*CHAT, {"role": "assistant", "content": "Neigh."}], "messages[2].role"),
    ],
)
def test_bad_chat_requests_are_refused_naming_the_message(
    http: httpx.Client, messages: list[dict[str, str]], field: str
) -> None:
    response = http.post("/v1/chat", json={"messages": messages})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert ["body", field] in [error["loc"] for error in detail]
    assert all(error["msg"] for error in detail)
    wrong_role = http.post("/v1/chat", json={"messages": [{"role": "robot", "content": "hi"}]})
    assert wrong_role.status_code == 422
    assert wrong_role.json()["detail"][0]["loc"] == ["body", "messages", 0, "role"]


def test_reload_switches_version_under_load_without_failures(
    server: tuple[str, Deployment],
    http: httpx.Client,
    store: str,
    models: dict[int, GPTModel],
    tokenizer: Tokenizer,
) -> None:
    expected = {
        version: alone(model, tokenizer, PROMPTS[1], max_new_tokens=8, temperature=0)
        for version, model in models.items()
    }
    assert expected[1] != expected[2]
    stop, answers, failures = threading.Event(), [], []

    def client_loop() -> None:
        with httpx.Client(base_url=server[0], timeout=60) as client:
            while not stop.is_set():
                body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
                response = client.post("/v1/generate", json=body)
                if response.status_code == 200:
                    answers.append(response.json())
                else:
                    failures.append(response.text)

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for thread in threads:
        thread.start()

    def wait_for_answers(count: int) -> None:
        deadline = time.monotonic() + 120
        while len(answers) < count:
            assert not failures, failures
            assert time.monotonic() < deadline, f"{len(answers)} of {count} answers in 120 s"
            time.sleep(0.01)

    try:
        wait_for_answers(8)
        assert http.post("/admin/reload").json()["reloaded"] is False  # alias unchanged
        set_alias(MODEL_NAME, "champion", 2, tracking_uri=store)
        reload = http.post("/admin/reload").json()
        assert reload["reloaded"] is True
        assert (reload["previous"]["version"], reload["model"]["version"]) == (1, 2)
        wait_for_answers(len(answers) + 8)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert failures == []
    for answer in answers:
        assert picked(answer) == expected[answer["model"]["version"]]
    assert answers[-1]["model"]["version"] == 2
    assert http.get("/v1/model").json()["version"] == 2
    assert server[1].engine.served.info.version == 2
    assert not isinstance(server[1].engine, ProcessEngine)  # the default on CPU: a thread

    MlflowClient(tracking_uri=store).delete_registered_model_alias(MODEL_NAME, "champion")
    refused = http.post("/admin/reload")
    assert refused.status_code == 409 and "no alias 'champion'" in refused.json()["detail"]
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    assert picked(http.post("/v1/generate", json=body).json()) == expected[2]


def test_watch_follows_the_alias(store: str) -> None:
    set_alias(MODEL_NAME, "watched", 2, tracking_uri=store)
    config = ServeConfig(model=f"models:/{MODEL_NAME}@watched", tracking_uri=store, watch_s=0.1)
    with running(config) as (url, deployment):
        assert httpx.get(f"{url}/v1/model").json()["version"] == 2
        set_alias(MODEL_NAME, "watched", 1, tracking_uri=store)
        deadline = time.monotonic() + 60
        while deployment.reloads == 0:
            assert time.monotonic() < deadline, "the watcher did not reload"
            time.sleep(0.05)
        info = httpx.get(f"{url}/v1/model").json()
        assert (info["version"], info["alias"], info["reloads"]) == (1, "watched", 1)


def test_a_process_engine_is_swapped_on_reload_under_load_without_failures(
    store: str, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """``--engine-process``: a reload starts the new version's engine process, new
    requests go there, the old process finishes what it holds and exits; no request of
    the clients running meanwhile fails, and each answer is its version's."""
    expected = {
        version: alone(model, tokenizer, PROMPTS[2], max_new_tokens=6, temperature=0)
        for version, model in models.items()
    }
    set_alias(MODEL_NAME, "process", 1, tracking_uri=store)
    config = ServeConfig(model=f"models:/{MODEL_NAME}@process", tracking_uri=store,
                         max_tokens=24, engine_process=True)  # fmt: skip
    stop, answers, failures = threading.Event(), [], []
    with running(config) as (url, deployment):
        old = deployment.engine
        assert isinstance(old, ProcessEngine) and old._process.is_alive()

        def client_loop() -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                while not stop.is_set():
                    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0}
                    response = client.post("/v1/generate", json=body)
                    target = answers if response.status_code == 200 else failures
                    target.append(response.json() if response.status_code == 200 else response.text)

        threads = [threading.Thread(target=client_loop) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            deadline = time.monotonic() + 120
            while len(answers) < 6:
                assert not failures and time.monotonic() < deadline, (failures, len(answers))
                time.sleep(0.01)
            set_alias(MODEL_NAME, "process", 2, tracking_uri=store)
            assert httpx.post(f"{url}/admin/reload", timeout=120).json()["reloaded"] is True
            count = len(answers)
            while len(answers) < count + 6:
                assert not failures and time.monotonic() < deadline, (failures, len(answers))
                time.sleep(0.01)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert old.join(60), "the old engine process did not exit"
        assert deployment.engine is not old and deployment.engine._process.is_alive()
    assert failures == []
    for answer in answers:
        assert picked(answer) == expected[answer["model"]["version"]]
    assert answers[-1]["model"]["version"] == 2


# --- the OpenAI-compatible API, through the official client ----------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def openai_server(
    request: pytest.FixtureRequest, store: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """``megalith serve`` of ``models:/NAME@candidate`` (version 2 throughout), bound to
    0.0.0.0 with no admin token (only loopback is contacted), its engine in a thread of the
    server or in a process of its own (``--engine-process``); yields its URL and log."""
    log = tmp_path_factory.mktemp("openai-serve") / "serve.log"
    source = f"models:/{MODEL_NAME}@candidate"
    flags = ["--tracking-uri", store, "--max-tokens", "24", "--max-batch-size", "8"]
    if request.param:
        flags.append("--engine-process")
    with megalith_serve(source, "0.0.0.0", None, log, *flags) as url:
        yield url, log


@pytest.fixture(scope="module")
def client(openai_server: tuple[str, Path]) -> Iterator[Any]:
    import openai

    with openai.OpenAI(base_url=f"{openai_server[0]}/v1", api_key="unused") as client:
        yield client


def chat_reference(
    model: GPTModel, tokenizer: Tokenizer, max_tokens: int, **sampling: Any
) -> tuple[str, int, int]:
    """The reply to CHAT decoded alone: (text, completion tokens, prompt tokens)."""
    prompt, end_of_turn = generation_prompt(tokenizer, CHAT)
    config = SamplingConfig(max_tokens, stop_ids=(end_of_turn,), **sampling)
    ids, _, _ = generate_ids(
        model, [prompt], config, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size
    )[0]
    return continuation_text(tokenizer, prompt, ids), len(ids), len(prompt)


def test_openai_client_completions_and_chat_match_generation_alone(
    client: Any, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    import openai

    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    expected = alone(models[2], tokenizer, PROMPTS[2], max_new_tokens=10, temperature=0)
    for name in (MODEL_NAME, f"models:/{MODEL_NAME}@candidate", f"{MODEL_NAME}@candidate"):
        answer = client.completions.create(
            model=name, prompt=PROMPTS[2], max_tokens=10, temperature=0
        )
        [choice] = answer.choices
        assert choice.text == expected["text"] and answer.model == MODEL_NAME
        assert choice.finish_reason == (
            "length" if expected["finish_reason"] == "length" else "stop"
        )
        prompt_tokens = 1 + len(tokenizer.encode(PROMPTS[2]))
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
            prompt_tokens, expected["completion_tokens"]
        )  # fmt: skip
        assert answer.usage.total_tokens == prompt_tokens + expected["completion_tokens"]

    text, completion_tokens, prompt_tokens = chat_reference(models[2], tokenizer, 12, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == text
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        prompt_tokens, completion_tokens
    )  # fmt: skip

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.body["param"] == "model"


def test_openai_streaming_adds_up_to_the_whole_answer(client: Any) -> None:
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *texts, usage = chunks
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
    assert texts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert usage.choices == [] and usage.usage == whole.usage

    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    reply = client.chat.completions.create(**body)
    streamed = list(client.chat.completions.create(**body, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert content == reply.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    assert {c.object for c in streamed} == {"chat.completion.chunk"}


def test_openai_n_seed_stop_and_logprobs(
    client: Any, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    # n samples, each seeded seed + its index: reproducible, and each as alone
    sampled = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 1.0}
    first = client.completions.create(**sampled, n=3, seed=11)
    again = client.completions.create(**sampled, n=3, seed=11)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    used = 0
    for j, choice in enumerate(first.choices):
        expected = alone(models[2], tokenizer, PROMPTS[0], max_new_tokens=10, temperature=1.0,
                         top_p=1.0, seed=11 + j)  # fmt: skip
        assert choice.text == expected["text"]
        used += expected["completion_tokens"]
    assert first.usage.completion_tokens == used
    assert len({c.text for c in first.choices}) > 1  # independent samples
    # ignore_eos (vLLM's extension): every choice decodes its whole max_tokens, as alone
    past = client.completions.create(**sampled, n=3, seed=11, extra_body={"ignore_eos": True})
    for j, choice in enumerate(past.choices):
        expected = alone(models[2], tokenizer, PROMPTS[0], max_new_tokens=10, temperature=1.0,
                         top_p=1.0, seed=11 + j, stop_at_eod=False)  # fmt: skip
        assert (choice.text, choice.finish_reason) == (expected["text"], "length")
    assert past.usage.completion_tokens == 30
    # several prompts: n choices each, prompt i's at indices i*n .. i*n+n-1
    both = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2
    )
    texts = [
        alone(models[2], tokenizer, p, max_new_tokens=5, temperature=0)["text"] for p in PROMPTS[:2]
    ]
    assert [(c.index, c.text) for c in both.choices] == list(
        enumerate([t for t in texts for _ in range(2)])
    )
    assert both.usage.prompt_tokens == sum(1 + len(tokenizer.encode(p)) for p in PROMPTS[:2])

    # stop strings: cut before the first, left out, finish "stop", streamed alike
    greedy = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0}
    free = client.completions.create(**greedy).choices[0].text
    assert len(free) > 8
    stop = free[4:7]
    cut = free[: free.index(stop)]
    stopped = client.completions.create(**greedy, stop=[stop, "never-there"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (cut, "stop")
    assert stopped.usage.completion_tokens < len(tokenizer.encode(free)) + 1
    chunks = list(client.completions.create(**greedy, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"

    # logprobs: the token's and the top alternatives' (greedy: the token is the top one)
    scored = client.completions.create(**{**greedy, "max_tokens": 6}, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == scored.usage.completion_tokens == 6
    assert "".join(logprobs.tokens).strip() == scored.choices[0].text.strip()
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                 strict=True):  # fmt: skip
        assert 1 <= len(top) <= 2 and value <= 0  # two partial bytes both show as U+FFFD
        assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)
    assert all(t.bytes and t.logprob <= 0 for t in content)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"model": "M", "prompt": "hi", "temperature": NaN}', "temperature"),
        ('{"model": "M", "prompt": "hi", "top_p": Infinity}', "top_p"),
        ('{"model": "M", "prompt": "hi", "temperature": 1e9}', "temperature"),
        ('{"model": "M", "prompt": "hi", "top_p": 1.5}', "top_p"),
        ('{"model": "M", "prompt": "hi", "n": 0}', "n"),
        ('{"model": "M", "prompt": "hi", "logprobs": 21}', "logprobs"),
        ('{"model": "M", "prompt": "hi", "max_tokens": 25}', "max_tokens"),
        ('{"model": "M", "prompt": "hi", "best_of": 2}', "best_of"),
        ('{"model": "M", "prompt": ""}', "prompt"),
        ('{"model": "M", "messages": [{"role": "robot", "content": "hi"}]}', "messages"),
        ('{"model": "M", "messages": []}', "messages"),
    ],
)
def test_openai_bad_requests_are_400_naming_the_field(
    openai_server: tuple[str, Path], body: str, param: str
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(
        f"{openai_server[0]}{path}",
        content=body.replace('"M"', json.dumps(MODEL_NAME)),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert param in error["message"]


def test_openai_limits_context_and_body_size(
    openai_server: tuple[str, Path], tokenizer: Tokenizer
) -> None:
    url = openai_server[0]
    prompt = "Once upon a time"
    while len(tokenizer.encode(prompt + " again")) < CONTEXT - 20:
        prompt += " again"
    room = CONTEXT - 1 - len(tokenizer.encode(prompt))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": room + 1}
    refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert f"{CONTEXT} positions" in error["message"]
    assert httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": room}).status_code == 200
    # a prompt is bounded by the context in tokens, not by a length in characters
    wide = {**body, "prompt": "Once" + " " * 1200 + "upon a time", "max_tokens": 2}
    answer = httpx.post(f"{url}/v1/completions", json=wide, timeout=60).json()["error"]
    assert (answer["param"], answer["code"]) == ("prompt", "context_length_exceeded")
    assert f"context is {CONTEXT} tokens" in answer["message"]

    huge = json.dumps({"model": MODEL_NAME, "prompt": "a" * (10 << 20)})
    too_big = httpx.post(
        f"{url}/v1/completions", content=huge, headers={"content-type": "application/json"},
        timeout=60,
    )  # fmt: skip
    assert too_big.status_code == 413
    assert "byte limit" in too_big.json()["error"]["message"]


def test_metrics_count_requests_tokens_and_latencies(
    openai_server: tuple[str, Path], client: Any
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    url = openai_server[0]
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": ""}, timeout=60)
    response = httpx.get(f"{url}/metrics", timeout=60)
    assert response.status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("megalith_http_requests_total", path="/v1/completions", status="200") >= 1
    assert value("megalith_http_requests_total", path="/v1/completions", status="400") >= 1
    assert value("megalith_generation_tokens_total") >= 4
    assert value("megalith_prompt_tokens_total") >= 1 + len(PROMPTS[0].split())
    assert value("megalith_time_to_first_token_seconds_count") >= 1
    assert value("megalith_inter_token_latency_seconds_count") >= 3
    assert value("megalith_running_sequences") == 0 and value("megalith_queued_sequences") == 0
    # The continuous engine's paged KV cache (a static engine has none: no such gauges)
    assert value("megalith_kv_blocks_used") >= 0 and value("megalith_kv_blocks_free") > 0
    assert value("megalith_prefix_cache_queries_total") > 0  # every prompt looks its blocks up
    assert 0 <= value("megalith_prefix_cache_hit_rate") <= 1


# --- MLflow ---------------------------------------------------------------------------


def test_an_admin_token_guards_reload_and_is_never_shown(store: str) -> None:
    token = "s3cret-admin-token"
    # @candidate stays on version 2 throughout; earlier tests move and delete @champion.
    config = ServeConfig(
        model=f"models:/{MODEL_NAME}@candidate", tracking_uri=store, admin_token=token
    )
    assert token not in repr(config)
    with running(config) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            refused = client.post("/admin/reload", headers=header)
            assert refused.status_code == 401, header
            assert refused.headers["www-authenticate"] == "Bearer"
        allowed = client.post("/admin/reload", headers={"Authorization": f"Bearer {token}"})
        assert allowed.status_code == 200 and allowed.json()["reloaded"] is False
        assert token not in client.get("/v1/model").text


def test_pyfunc_load_model_generates_like_evaluation(
    store: str, models: dict[int, GPTModel], tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.pyfunc
    import pandas as pd

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}@candidate")  # version 2
    frame = pd.DataFrame({"prompt": PROMPTS[:3]})
    texts = pyfunc.predict(frame, params={"max_tokens": 7})
    assert texts == [
        alone(models[2], tokenizer, p, max_new_tokens=7, temperature=0)["text"] for p in PROMPTS[:3]
    ]
    assert pyfunc.predict(PROMPTS[:1], params={"max_tokens": 7}) == texts[:1]
    # MLflow's download wrote registered_model_meta into the local artifact store's copy:
    # megalith still loads the version.
    assert (
        load_served_model(f"models:/{MODEL_NAME}@candidate", tracking_uri=store).info.version == 2
    )


def test_mlflow_models_serve_answers_the_scoring_protocol(
    store: str, models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """A real ``mlflow models serve --env-manager local`` process on 127.0.0.1."""
    port = free_port()
    repo = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": store,
        "PYTHONPATH": str(repo),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    command = [
        sys.executable, "-m", "mlflow", "models", "serve",
        "-m", f"models:/{MODEL_NAME}@candidate", "--env-manager", "local",
        "-h", "127.0.0.1", "-p", str(port), "-w", "1",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running_process(command, env, "mlflow models serve", f"{url}/ping"):
        expected = [
            alone(models[2], tokenizer, p, max_new_tokens=6, temperature=0)["text"]
            for p in PROMPTS[:2]
        ]
        split = {"columns": ["prompt"], "data": [[p] for p in PROMPTS[:2]]}
        bodies = [
            {"dataframe_split": split, "params": {"max_tokens": 6}},
            {"inputs": PROMPTS[:2], "params": {"max_tokens": 6}},
        ]
        for body in bodies:
            response = httpx.post(f"{url}/invocations", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json() == {"predictions": expected}
        bad = httpx.post(f"{url}/invocations", json={"inputs": [""]}, timeout=60)
        assert bad.status_code >= 400 and "non-empty string" in bad.text


def test_serve_command_is_registered() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "models:/megalith-demo@candidate", "--max-batch-size", "4"]
    )
    assert args.handler.__module__ == "deploy.cli"
    assert (args.model, args.max_batch_size, args.host, args.engine) == (
        "models:/megalith-demo@candidate", 4, "127.0.0.1", "continuous"
    )  # fmt: skip
    static = build_parser().parse_args(["serve", "--model", "m", "--engine", "static"])
    assert static.engine == "static"


def test_a_gpt_is_batched_continuously_unless_asked_and_a_full_queue_is_429(
    packages: dict[int, Path],
) -> None:
    """The default engine of a GPT is the continuous one, --engine static the static one;
    a request finding the queue full is answered 429 with Retry-After."""
    static = Deployment(ServeConfig(model=str(packages[1]), engine="static"))
    assert isinstance(static.engine, BatchingEngine)
    static.close()
    with running(ServeConfig(model=str(packages[1]), max_queue=0)) as (url, deployment):
        assert isinstance(deployment.engine, ContinuousEngine)
        response = httpx.post(f"{url}/v1/generate", json={"prompt": "hi"}, timeout=60)
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "1"
        assert "busy" in response.json()["detail"]


# --- `megalith serve` as a user runs it ---------------------------------------------------

MEGALITH = [sys.executable, "-m", "pipelines.cli"]


@contextlib.contextmanager
def megalith_serve(
    source: str | Path, host: str, token: str | None, log: Path, *flags: str
) -> Iterator[str]:
    """``megalith serve --model SOURCE --host HOST FLAGS`` as a subprocess, with
    MEGALITH_ADMIN_TOKEN set to ``token`` (unset for None); yields its loopback URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MEGALITH_ADMIN_TOKEN"}
    env.update({"OMP_NUM_THREADS": "1"} | ({"MEGALITH_ADMIN_TOKEN": token} if token else {}))
    command = [*MEGALITH, "serve", "--model", str(source), "--host", host, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running_process([*command, *flags], env, "megalith serve", f"{url}/health", log=log):
        yield url


def test_megalith_serve_reload_needs_the_admin_token_from_the_environment(
    packages: dict[int, Path], tmp_path: Path
) -> None:
    """/admin/reload: no token and a wrong one are 401, the right one reloads (200); the
    token is never shown by /v1/model, nor the package's local path; a public bind with a
    token set gives no warning."""
    token = "s3cret-admin-token-for-the-test"
    log = tmp_path / "serve.log"
    with megalith_serve(packages[1], "0.0.0.0", token, log) as url:
        reload = f"{url}/admin/reload"
        assert httpx.post(reload, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer not-the-token"}
        assert httpx.post(reload, headers=wrong, timeout=60).status_code == 401
        right = httpx.post(reload, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert right.status_code == 200, right.text
        for path in ("/v1/model", "/v1/models"):
            info = httpx.get(f"{url}{path}", timeout=60)
            assert info.status_code == 200, info.text
            assert token not in info.text
            assert str(packages[1].parent) not in info.text and "/tmp" not in info.text
        assert httpx.get(f"{url}/v1/model", timeout=60).json()["source"] == packages[1].name
    said = log.read_text()
    assert "serving" in said and "warning" not in said, said


def test_megalith_serve_on_a_public_address_without_a_token_warns(
    openai_server: tuple[str, Path],
) -> None:
    """Bound to 0.0.0.0 (only loopback is contacted) with no MEGALITH_ADMIN_TOKEN: stderr
    says anyone can reload the model, and reloads are open."""
    url, log = openai_server
    assert httpx.post(f"{url}/admin/reload", timeout=60).status_code == 200
    said = log.read_text()
    assert (
        "warning: 0.0.0.0 is reachable from other hosts and MEGALITH_ADMIN_TOKEN is not set" in said
    ), said
    engine = r"engine (in a thread|in process \d+): continuous batching, \d+ KV blocks of 16 "
    assert re.search(engine + "positions, up to 64 sequences at once", said), said


def test_one_loop_wake_up_delivers_a_whole_burst_of_tokens_in_order() -> None:
    """Tokens posted from the engine's thread while the loop is busy all reach their
    queues, each in order, after one wake-up of the loop (not one per token)."""
    loop = asyncio.new_event_loop()
    wake_ups = []
    wake_up = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: wake_ups.append(args) or wake_up(*args)

    async def burst() -> tuple[list[int], list[int]]:
        mailbox = LoopMailbox.of(asyncio.get_running_loop())
        first, second = asyncio.Queue(), asyncio.Queue()
        # The loop does not run while this thread posts: the join blocks it.
        engine = threading.Thread(
            target=lambda: [mailbox.post(first if i % 2 else second, i) for i in range(100)]
        )
        engine.start()
        engine.join()
        assert first.empty() and second.empty()
        await asyncio.sleep(0)  # one iteration of the loop's ready callbacks
        return [first.get_nowait() for _ in range(50)], [second.get_nowait() for _ in range(50)]

    try:
        odd, even = loop.run_until_complete(burst())
    finally:
        loop.close()
    assert odd == list(range(1, 100, 2)) and even == list(range(0, 100, 2))
    assert len(wake_ups) == 1, f"{len(wake_ups)} wake-ups for one burst of 100 tokens"


def test_tokens_that_arrive_together_stream_as_one_chunk(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """Under load a request's tokens pile up between the event loop's visits: those that
    arrived together go out as one OpenAI chunk (text and log-probabilities of all of
    them); one at a time, a chunk each. Both add up to the same text."""
    info = ModelInfo("tiny", "tiny", None, None, "0" * 64, 64, 0.0)
    served = ServedModel(models[1], tokenizer, info)
    prompt = [tokenizer.eod_id, *tokenizer.encode(PROMPTS[0])]
    new = tokenizer.encode(" the little dog ran home")
    body = CompletionRequest(model="tiny", prompt=PROMPTS[0], max_tokens=len(new), stream=True,
                             logprobs=1)  # fmt: skip
    sampling = SamplingConfig(len(new), temperature=0.0)

    def streamed(burst: bool) -> list[dict[str, Any]]:
        async def run() -> list[bytes]:
            stream = TokenStream()
            request = stream.add(prompt, sampling, time.monotonic() + 60)
            reply = Reply(body, served, [Choice(0, 0, prompt, sampling)])
            chunks = reply.chunks(stream, 60)
            events = [*(SampledToken(t, -0.5, ((t, -0.5),)) for t in new)]
            events.append(Finished(new, "length", len(prompt)))
            out = []
            if burst:  # all posted before the loop reads any
                for event in events[:-1]:
                    request.on_token(event)
                request.on_done(events[-1])
                return [chunk async for chunk in chunks]
            for event in events:
                (request.on_done if isinstance(event, Finished) else request.on_token)(event)
                out.append(await anext(chunks))
            return out + [chunk async for chunk in chunks]

        raw = asyncio.run(run())
        return [json.loads(c.decode()[len("data: ") :]) for c in raw if b"[DONE]" not in c]

    together, apart = streamed(burst=True), streamed(burst=False)
    assert len(together) == 1 and len(apart) >= len(new)
    text = "".join(chunk["choices"][0]["text"] for chunk in apart)
    assert text and together[0]["choices"][0]["text"] == text
    assert together[0]["choices"][0]["logprobs"]["token_logprobs"] == [-0.5] * len(new)
    assert together[0]["choices"][0]["finish_reason"] == apart[-1]["choices"][0]["finish_reason"]


def test_answer_text_decodes_a_bounded_tail_and_equals_decoding_everything(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """The streamed text of every prefix of an answer equals decoding the whole answer
    after the prompt, with random tokens (byte pieces split characters, and some never
    complete) and a run of byte pieces; and each step decodes at most a bounded tail."""
    info = ModelInfo("tiny", "tiny", None, None, "0" * 64, 64, 0.0)
    served = ServedModel(models[1], tokenizer, info)
    prompt = [tokenizer.eod_id, *tokenizer.encode(PROMPTS[1])]
    byte_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) != b""
                and len(tokenizer.token_bytes(i)) == 1 and tokenizer.token_bytes(i)[0] >= 0x80]  # fmt: skip
    accented = tokenizer.encode(" café crème brûlée, naïve façade")
    rng = random.Random(0)
    answers = [
        [rng.randrange(tokenizer.vocab_size) for _ in range(200)],
        [
            rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)
            for _ in range(200)
        ],  # fmt: skip
        accented * 8,
    ]
    counting = CountingTokenizer(tokenizer)
    streamed = ServedModel(models[1], counting, info)  # type: ignore[arg-type]
    longest = []
    for answer in answers:
        incremental = AnswerText(streamed, prompt)
        counting.lengths.clear()
        for end in range(1, len(answer) + 1):
            expected = served.text(text_context(prompt), answer[:end])
            assert incremental.push(answer[end - 1]) == expected, f"tokens {answer[:end]}"
        assert incremental.settled > 0
        longest.append(max(counting.lengths))
    # Each push decodes the context and the unsettled tail: SETTLE_AFTER tokens, a few
    # more while the text ends inside a character; not the whole answer (200 tokens).
    assert max(longest) < 2 * (TEXT_CONTEXT + AnswerText.SETTLE_AFTER), longest


class CountingTokenizer:
    """A tokenizer that records how many ids each ``decode`` call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


PROCESS_OPTIONS = {"block_size": 4, "num_blocks": None, "max_running": 4, "prefill_chunk": 64,
                   "cuda_graphs": True, "max_queue": 8, "max_batch_size": 4,
                   "batch_window_s": 0.005}  # fmt: skip


def test_an_engine_process_decodes_as_in_process_cancels_and_retires(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """The engine in a child process: greedy and seeded sampled tokens as the in-process
    engine gives them, a cancelled request ends 'cancelled' and frees its KV blocks, the
    counters cross over, and a retired engine finishes and exits."""
    info = ModelInfo("tiny", "tiny", None, None, "0" * 64, 64, 0.0)
    served = ServedModel(models[1], tokenizer, info)
    settings = [SamplingConfig(6, temperature=0.0), SamplingConfig(6, temperature=1.2, seed=5)]
    engine = ProcessEngine(served, EngineSpec("continuous", PROCESS_OPTIONS))
    engine.start()
    local = make_engine(served, EngineSpec("continuous", PROCESS_OPTIONS)).start()
    try:
        for sampling in settings:
            there, here = Collector(), Collector()
            engine.submit(pending(tokenizer, PROMPTS[0], sampling, there))
            local.submit(pending(tokenizer, PROMPTS[0], sampling, here))
            assert there.done.wait(60) and here.done.wait(60)
            assert there.result == here.result and there.tokens == here.tokens
        long = Collector()
        request = pending(tokenizer, PROMPTS[1], SamplingConfig(40, temperature=0.0), long)
        request.on_token = lambda token: (long.on_token(token), request.cancelled.set())
        engine.submit(request)
        assert long.done.wait(60)
        assert isinstance(long.result, Finished) and long.result.finish_reason == "cancelled"
        assert 1 <= len(long.tokens) < 40
        assert engine.stats.requests == 3 and engine.kv_stats()["blocks_used"] == 0
    finally:
        local.retire()
        engine.retire()
    assert engine.join(60) and local.join(60)
    with pytest.raises(EngineClosed):
        engine.submit(pending(tokenizer, PROMPTS[0], settings[0], Collector()))


def test_a_dead_engine_process_fails_its_requests_and_closes(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    """If the child dies mid-request, the request ends with an error naming it, not a hang,
    and the engine refuses new requests (a server then reloads or restarts)."""
    info = ModelInfo("tiny", "tiny", None, None, "0" * 64, 64, 0.0)
    served = ServedModel(models[1], tokenizer, info)
    engine = ProcessEngine(served, EngineSpec("static", PROCESS_OPTIONS)).start()
    sink = Collector()
    request = pending(tokenizer, PROMPTS[1], SamplingConfig(40, temperature=0.0), sink)
    request.on_token = lambda token: (sink.on_token(token), engine._process.kill())
    engine.submit(request)
    assert sink.done.wait(60)
    assert isinstance(sink.result, RuntimeError) and "engine process ended" in str(sink.result)
    assert engine.join(10)
    with pytest.raises(EngineClosed):
        engine.submit(pending(tokenizer, PROMPTS[0], SamplingConfig(2), Collector()))


def test_an_engine_process_that_cannot_start_says_why(
    models: dict[int, GPTModel], tokenizer: Tokenizer
) -> None:
    info = ModelInfo("tiny", "tiny", None, None, "0" * 64, 64, 0.0)
    served = ServedModel(models[1], tokenizer, info)
    options = {**PROCESS_OPTIONS, "block_size": 0}
    engine = ProcessEngine(served, EngineSpec("continuous", options))
    with pytest.raises(RuntimeError, match="did not start: ValueError: block_size"):
        engine.start()
    assert not engine._process.is_alive()
