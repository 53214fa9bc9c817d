"""Issue 16 §6: every reader of untrusted input, fuzzed within a fixed budget.

HTTP bodies: the real server (uvicorn in a thread on 127.0.0.1, ``test_serving.running``)
serving a tiny model package, sent hypothesis-made bodies: valid requests with fields
swapped for wrong types, NaN, infinities, huge or negative numbers, deep nesting, unknown
keys, mutated bytes and wrong content types. Every answer must be a 2xx or a 4xx whose
``detail`` names where the request is wrong; never a 5xx, never a hang (each request has
a client timeout), and the server still answers a plain request afterwards.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_evaluation import tiny_model
from test_serving import running

from deploy.loading import load_served_model
from deploy.mlflow_pyfunc import MegalithPyfunc, ScoringInputError
from deploy.request_body import DEFAULT_MAX_BODY_BYTES
from deploy.server import ServeConfig
from preprocessing.tokenizer import load_tokenizer
from training.models.package import save_model_package

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
REQUEST_TIMEOUT_S = 30  # a hang fails the example instead of the whole run
FUZZ_BODY_LIMIT = 16 << 10  # the fuzzed server's body limit: oversized bodies stay cheap


@pytest.fixture(scope="module")
def package(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = load_tokenizer(str(Path(shards) / "tokenizer.model"))
    model = tiny_model(tokenizer)
    out = tmp_path_factory.mktemp("fuzz-package") / "model"
    return save_model_package(model, model.config, tokenizer.model_path, out)


@pytest.fixture(scope="module")
def server(package: Path) -> Iterator[str]:
    config = ServeConfig(
        model=str(package), max_tokens=4, timeout_s=10, max_body_bytes=FUZZ_BODY_LIMIT
    )
    with running(config) as (url, _):
        yield url


@pytest.fixture(scope="module")
def default_server(package: Path) -> Iterator[str]:
    with running(ServeConfig(model=str(package), max_tokens=4, timeout_s=10)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


# --- HTTP bodies: each bad value answers 4xx naming the field -------------------------


def post_raw(
    http: httpx.Client, path: str, body: bytes, content_type: str | None
) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return http.post(path, content=body, headers=headers)


def assert_clean_refusal(response: httpx.Response, status: int, loc: list[Any], words: str) -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert loc in [error["loc"] for error in detail], detail
    assert any(words in error["msg"] for error in detail), detail


@pytest.mark.parametrize(
    ("field", "literal", "words"),
    [
        ("temperature", "NaN", "finite number"),
        ("temperature", "Infinity", "finite number"),
        ("temperature", "1e-320", "0 (greedy) or at least"),
        ("temperature", "1e400", "finite number"),  # JSON's 1e400 is Python's inf
        ("top_p", "NaN", "finite number"),
        ("top_p", "1e-320", "greater than or equal"),
        ("top_p", "1.5", "less than or equal"),
        ("top_k", "0", "greater than or equal"),
        ("top_k", "-Infinity", "finite number"),
        ("seed", "-1", "greater than or equal"),
        ("seed", str(2**64), "less than or equal"),
        ("seed", "NaN", "finite number"),
        ("max_tokens", "1e9", "at most 4"),
        ("max_tokens", "0", "greater than or equal"),
        ("max_tokens", '"many"', "valid integer"),
        ("timeout_s", "NaN", "finite number"),
        ("timeout_s", "-Infinity", "finite number"),
        ("timeout_s", "0", "greater than"),
        ("stream", '"sometimes"', "valid boolean"),
        ("prompt", '"\\ud800"', "unicode string"),  # a lone surrogate is not text
        ("prompt", '["a", "list"]', "valid string"),
        ("prompt", '{"nested": {"object": 1}}', "valid string"),
    ],
)
def test_bad_sampling_values_answer_422_naming_the_field(
    http: httpx.Client, field: str, literal: str, words: str
) -> None:
    fields = {"prompt": '"Once upon a time"', field: literal}
    body = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
    response = post_raw(http, "/v1/generate", body.encode(), "application/json")
    assert_clean_refusal(response, 422, ["body", field], words)


def test_chat_sampling_values_are_checked_as_generate_does(http: httpx.Client) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}'
    response = post_raw(http, "/v1/chat", body, "application/json")
    assert_clean_refusal(response, 422, ["body", "top_p"], "finite number")


@pytest.mark.parametrize(
    ("body", "content_type", "status", "words"),
    [
        (b'{"prompt": "hi"}', "text/plain", 415, "expected 'application/json'"),
        (b'{"prompt": "hi"}', None, 415, "content type is 'none'"),
        (b"prompt=hi", "application/x-www-form-urlencoded", 415, "expected 'application/json'"),
        (b'{"prompt": "hi"}', "application/json; charset=latin-1", 415, "(UTF-8)"),
        (b'{"prompt": "caf\xe9"}', "application/json", 422, "not UTF-8"),
        (b'{"prompt": "\xff\xfe"}', "application/json", 422, "not UTF-8"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", 422, "deeper"),
        (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "application/json", 422, "digits"),
        (b'{"prompt": "hi"', "application/json", 422, "not valid JSON"),
        (b"[1, 2, 3]", "application/json", 422, "valid dictionary"),
    ],
)
def test_malformed_bodies_answer_4xx_saying_what_was_expected(
    http: httpx.Client, body: bytes, content_type: str | None, status: int, words: str
) -> None:
    response = post_raw(http, "/v1/generate", body, content_type)
    assert_clean_refusal(response, status, ["body"], words)


def test_a_huge_prompt_answers_413_at_the_default_limit(default_server: str) -> None:
    body = json.dumps({"prompt": "Once upon a time " * (DEFAULT_MAX_BODY_BYTES // 16)})
    response = httpx.post(
        f"{default_server}/v1/generate",
        content=body,
        headers={"content-type": "application/json"},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert_clean_refusal(response, 413, ["body"], f"{DEFAULT_MAX_BODY_BYTES}-byte limit")


def raw_exchange(url: str, head: str, chunks: list[bytes]) -> bytes:
    """Send ``head`` and ``chunks`` on a plain socket; the server's whole answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read(
    server: str,
) -> None:
    """Content-Length says 1 GB and no byte follows: the answer comes anyway."""
    head = (
        "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**9}\r\n\r\n"
    )
    answer = raw_exchange(server, head, [])
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large", answer[:200]
    assert b"byte limit" in rest


def test_a_chunked_body_is_cut_off_at_the_limit(server: str) -> None:
    """No Content-Length: the guard counts the chunks and answers once past the limit."""
    head = (
        "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b'{"prompt": "' + b"a" * 4000
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    answer = raw_exchange(server, head, [chunk] * (FUZZ_BODY_LIMIT // len(piece) + 1))
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"byte limit" in answer


# --- HTTP bodies: property-based fuzz --------------------------------------------------

ODD_NUMBERS = st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), 1e-320, -0.0, 1e308, 2**63, 2**64, -(2**63)]
)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    ODD_NUMBERS,
    st.text(max_size=30),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
VALID = {
    "prompt": st.text(min_size=1, max_size=40),
    "max_tokens": st.integers(1, 4),
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0]),
    "top_k": st.integers(1, 50),
    "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(),
    "timeout_s": st.sampled_from([0.5, 5.0]),
}


@st.composite
def generate_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request, then some of its fields swapped for junk and some keys added."""
    body = {
        key: draw(value) for key, value in VALID.items() if key == "prompt" or draw(st.booleans())
    }
    for key in draw(st.lists(st.sampled_from(sorted(VALID)), max_size=3)):
        body[key] = draw(JUNK)
    if draw(st.booleans()):
        body[draw(st.text(max_size=12))] = draw(JUNK)
    if draw(st.integers(0, 9)) == 0:
        body["prompt"] = draw(nested(draw(st.integers(1, 200))))
    return body


def nested(depth: int) -> st.SearchStrategy[Any]:
    return st.just(json.loads("[" * depth + "]" * depth))


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "robot"]),
            "content": st.text(max_size=20),
        }
    )
    messages = draw(st.one_of(st.lists(message, max_size=4), JUNK))
    body = {**{k: v for k, v in draw(generate_bodies()).items() if k != "prompt"}}
    body["messages"] = messages
    return body


def check_answer(response: httpx.Response) -> None:
    """2xx, or a 4xx whose detail names where the request is wrong; never a 5xx."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        detail = response.json()["detail"]
        assert detail and all(error["loc"][0] == "body" and error["msg"] for error in detail)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert "event: error" not in response.text
    else:
        assert response.json()["finish_reason"] in ("eod", "length", "timeout")


def still_serves(http: httpx.Client) -> None:
    answer = http.post("/v1/generate", json={"prompt": "Once upon a time", "temperature": 0})
    assert answer.status_code == 200 and answer.json()["completion_tokens"] > 0


@FUZZ
@given(body=generate_bodies())
def test_fuzzed_generate_bodies_never_answer_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(post_raw(http, "/v1/generate", json.dumps(body).encode(), "application/json"))


@FUZZ
@given(body=chat_bodies())
def test_fuzzed_chat_bodies_never_answer_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(post_raw(http, "/v1/chat", json.dumps(body).encode(), "application/json"))


VALID_BODY = json.dumps({"prompt": "Once upon a time", "max_tokens": 2, "top_k": 5}).encode()


@st.composite
def mutated_bytes(draw: st.DrawFn) -> bytes:
    """The valid body with a few bytes flipped, cut, or a run of bytes inserted."""
    data = bytearray(VALID_BODY)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=FUZZ_BODY_LIMIT // 4))
    return bytes(data)


CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json; charset=utf-8", "text/plain", "", "application/xml"]
)


@FUZZ
@given(
    body=mutated_bytes(),
    content_type=CONTENT_TYPES,
    path=st.sampled_from(["/v1/generate", "/v1/chat"]),
)
def test_fuzzed_raw_bodies_never_answer_5xx(
    http: httpx.Client, body: bytes, content_type: str, path: str
) -> None:
    check_answer(post_raw(http, path, body, content_type or None))


def test_the_server_still_answers_after_the_fuzz(http: httpx.Client) -> None:
    still_serves(http)


# --- MLflow pyfunc params (``mlflow models serve`` passes them on from the request) ----


@pytest.fixture(scope="module")
def pyfunc(package: Path) -> MegalithPyfunc:
    return MegalithPyfunc(load_served_model(str(package)))


PARAM_VALUES = st.one_of(
    JUNK,
    st.sampled_from([0, 1, 2, 0.5, 1.0, "3", "0.7"]),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    params=st.dictionaries(
        st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "seed"]),
        PARAM_VALUES,
        max_size=5,
    )
)
def test_fuzzed_pyfunc_params_generate_or_raise_a_scoring_error(
    pyfunc: MegalithPyfunc, params: dict[str, Any]
) -> None:
    params = {"max_tokens": 2, **params}  # keep the examples that generate short
    try:
        texts = pyfunc.predict(["Once upon a time"], params)
    except ScoringInputError as error:
        assert str(error).startswith(("params: ", "unknown params"))
    else:
        assert len(texts) == 1 and isinstance(texts[0], str)
