"""Issue 16 §6: every reader of untrusted input, fuzzed within a fixed budget.

Files: a real tiny training run (its sharded checkpoint, latest.json and model package),
the session's shard set and the tiny recipe are copied, then mutated as an attacker or a
broken disk would: bits flipped, files cut short, runs of bytes or big integers written
over binary headers, JSON/YAML values swapped for wrong types, huge or negative numbers,
NaN, long strings, path names or deep nesting, keys dropped or added. Most mutations are
then *restamped* (the manifest's sha256 and sizes recomputed, as someone who controls the
whole folder would), so the checks behind the hashes are reached too. The public entry
point must then load the input or raise a ``MegalithError`` with a message; anything
else escaping fails the example, and so does running past ``EXAMPLE_TIMEOUT_S`` (SIGALRM)
or allocating past ``EXAMPLE_MEMORY_BYTES`` more address space (``RLIMIT_AS``, lowered
around each example in this process and restored after).

HTTP bodies: the real server (uvicorn in a thread on 127.0.0.1, ``test_serving.running``)
serving a tiny model package, sent hypothesis-made bodies: valid requests with fields
swapped for wrong types, NaN, infinities, huge or negative numbers, deep nesting, unknown
keys, mutated bytes and wrong content types. Every answer must be a 2xx or a 4xx whose
``detail`` names where the request is wrong; never a 5xx, never a hang (each request has
a client timeout), and the server still answers a plain request afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import yaml
from bad_checkpoints import Target, restamp, sha256
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from parallel_helpers import RECIPE, fit_one_process, trainer_settings
from test_evaluation import tiny_model
from test_serving import running

from deploy.request_body import DEFAULT_MAX_BODY_BYTES
from deploy.server import ServeConfig
from megalith.config import DataConfig, DatasetSource, LoRAConfig, MegalithConfig, load_config
from megalith.errors import MegalithError
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from preprocessing.verify import verify_shard_set
from registry.mlflow_pyfunc import MegalithPyfunc, ScoringInputError
from training.checkpoint.cli import verify as ckpt_verify
from training.checkpoint.format import load_checkpoint, save_checkpoint
from training.checkpoint.safe_tensors import check_safetensors
from training.checkpoint.sharded_index import is_sharded, latest_sharded_checkpoint, read_index
from training.checkpoint.sharded_reader import load_sharded_checkpoint, read_model_weights
from training.data import build_gpt_datasets
from training.data.shard_set import open_shard_set
from training.finetune.adapter import load_adapter, merge_adapter, save_adapter
from training.inference.decode import SamplingConfig, generate
from training.inference.loading import load_served_model
from training.interop.export import export_hf
from training.interop.hf import import_hf
from training.memory.estimate import memory_report, resolve_layout
from training.models import build_model
from training.models.package import (
    load_model_package,
    model_tensors,
    read_package_model_config,
    save_model_package,
)
from training.optim.adamw import build_optimizer
from training.parallel.groups import single_process_state

# CI's budget; MEGALITH_FUZZ_EXAMPLES=5000 runs a longer search by hand.
FUZZ = settings(
    max_examples=int(os.environ.get("MEGALITH_FUZZ_EXAMPLES", "100")),
    deadline=None,
    database=None,
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


# --- readers: harness ----------------------------------------------------------------

EXAMPLE_TIMEOUT_S = 10
EXAMPLE_MEMORY_BYTES = 1 << 30
MAX_MESSAGE_CHARS = 10_000  # a screenful: a message must not echo a crafted 100 KB value


class ReaderHung(Exception):
    """Raised by SIGALRM inside a reader that ran past ``EXAMPLE_TIMEOUT_S``."""


def _hung(signum: int, frame: Any) -> None:
    raise ReaderHung("the reader ran past its time bound")


def _address_space() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[0])
    return pages * resource.getpagesize()


@contextlib.contextmanager
def bounded(timeout_s: int) -> Iterator[None]:
    """At most ``timeout_s`` seconds and ``EXAMPLE_MEMORY_BYTES`` more memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + EXAMPLE_MEMORY_BYTES
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    previous = signal.signal(signal.SIGALRM, _hung)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.alarm(timeout_s)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


def loads_or_refuses(
    read: Callable[[], Any], timeout_s: int = EXAMPLE_TIMEOUT_S
) -> MegalithError | None:
    """Run ``read`` within the bounds: it returns, or raises a MegalithError with a short
    message; any other exception (MemoryError, ReaderHung, KeyError, ...) fails."""
    try:
        with bounded(timeout_s):
            read()
    except MegalithError as error:
        message = str(error)
        assert message.strip() and len(message) <= MAX_MESSAGE_CHARS, message[:500]
        event(f"refused: {type(error).__name__}")
        return error
    event("accepted")
    return None


def test_the_bounds_stop_a_memory_bomb_and_a_hang() -> None:
    """The fuzz's bounds hold: an allocation past them and a reader that never returns
    both fail the example instead of taking the machine or the run."""
    with pytest.raises(MemoryError):
        loads_or_refuses(lambda: bytearray(2 * EXAMPLE_MEMORY_BYTES))
    with pytest.raises(ReaderHung):
        loads_or_refuses(lambda: threading.Event().wait(), timeout_s=1)


@contextlib.contextmanager
def copy_of(source: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        target = Path(tmp) / source.name
        shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("index-cache"))
        yield target


# --- readers: mutations ----------------------------------------------------------------

BIG_INTS = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 10**12]
JSON_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([*BIG_INTS, -(2**63), 10**30, -(10**30), 1e308, -0.5, 0.5, float("nan")]),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.integers(0, 5000),
    st.sampled_from(
        [
            "",
            "abc",
            "../../etc/passwd",
            "/dev/zero",
            "a/b",
            "..",
            "x" * 100_000,
            "\u0000",
            "float128",
            "int64",
            "megalith-sharded-checkpoint",
            "step-99999999",
        ]
    ),
    st.text(max_size=20),
    st.integers(1, 500).map(lambda depth: json.loads("[" * depth + "]" * depth)),
    st.lists(st.integers(-5, 2**40), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
)


def json_paths(value: Any, prefix: tuple = (), limit: int = 4000) -> list[tuple]:
    """Paths (keys and indices) to the nodes of a parsed JSON document, the first ``limit``."""
    paths: list[tuple] = []
    stack = [(prefix, value)]
    while stack and len(paths) < limit:
        path, node = stack.pop()
        paths.append(path)
        if isinstance(node, dict):
            stack.extend((path + (key,), child) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((path + (i,), child) for i, child in enumerate(node[:50]))
    return paths


def mutate_document(data: st.DataObject, document: Any) -> Any:
    """Replace, drop or add one value somewhere in ``document`` (or replace the whole)."""
    path = data.draw(st.sampled_from(json_paths(document)), label="path")
    if not path:
        return data.draw(JSON_JUNK, label="document")
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    action = data.draw(st.sampled_from(["replace", "replace", "drop", "add"]), label="action")
    last = path[-1]
    if action == "replace":
        parent[last] = data.draw(JSON_JUNK, label="value")
    elif action == "drop":
        del parent[last]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=8), label="key")] = data.draw(JSON_JUNK, label="value")
    else:
        parent.append(data.draw(JSON_JUNK, label="value"))
    return document


def mutate_bytes(data: st.DataObject, blob: bytes) -> bytes:
    """Flip bits, cut the end, insert bytes or write a big integer over some position."""
    out = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 3), label="byte edits")):
        at = data.draw(st.integers(0, max(len(out) - 1, 0)), label="offset")
        action = data.draw(st.sampled_from(["flip", "cut", "insert", "integer"]), label="edit")
        if action == "flip" and out:
            out[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif action == "cut":
            del out[at:]
        elif action == "insert":
            out[at:at] = data.draw(st.binary(min_size=1, max_size=64), label="inserted")
        else:
            fmt = data.draw(st.sampled_from(["<q", "<Q", "<i", "<I"]), label="format")
            value = data.draw(st.sampled_from(BIG_INTS), label="integer")
            out[at : at + struct.calcsize(fmt)] = packed_integer(fmt, value)
    return bytes(out)


def packed_integer(fmt: str, value: int) -> bytes:
    """``value`` wrapped into the range of ``fmt`` (so -1 as ``<Q`` is 2**64 - 1)."""
    bits = 8 * struct.calcsize(fmt)
    wrapped = value % (1 << bits)
    if fmt[-1].islower() and wrapped >= 1 << (bits - 1):
        wrapped -= 1 << bits
    return struct.pack(fmt, wrapped)


def mutate_safetensors_header(data: st.DataObject, blob: bytes) -> bytes:
    """Mutate the JSON header of a safetensors file and re-frame it with its new length."""
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    text = json.dumps(mutate_document(data, header)).encode()
    return struct.pack("<Q", len(text)) + text + blob[8 + length :]


def mutate_file(data: st.DataObject, path: Path) -> None:
    blob = path.read_bytes()
    kinds = ["bytes"]
    if path.suffix in (".json", ".yaml"):
        kinds += ["document", "document", "document"]
    elif path.suffix == ".safetensors":
        kinds += ["header", "header"]
    kind = data.draw(st.sampled_from(kinds), label=f"mutation of {path.name}")
    if kind == "bytes":
        path.write_bytes(mutate_bytes(data, blob))
    elif kind == "header":
        path.write_bytes(mutate_safetensors_header(data, blob))
    elif path.suffix == ".yaml":
        document = mutate_document(data, yaml.safe_load(blob))
        path.write_text(yaml.safe_dump(document, sort_keys=False))
    else:
        path.write_text(json.dumps(mutate_document(data, json.loads(blob))))


def mutate_folder(
    data: st.DataObject, root: Path, names: list[str], restamp: Callable[[Path], None]
) -> None:
    """Mutate one or two of ``names`` in ``root``; usually restamp the manifest after."""
    chosen = st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)
    for name in data.draw(chosen, label="files"):
        mutate_file(data, root / name)
    if data.draw(st.integers(0, 3), label="restamp") > 0:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, IndexError):
            restamp(root)  # a manifest broken by the mutation stays as it is


def restamp_checksums(root: Path) -> None:
    """checksums.json (a package) or index.json (a checkpoint) re-hashed as an attacker would."""
    manifest = "index.json" if (root / "index.json").exists() else "checksums.json"
    target = Target("fuzz", "", manifest, add_name=lambda root, name: None)
    restamp(target, root)


def restamp_package(root: Path) -> None:
    """A package restamped whole: config.json's tokenizer id too, then checksums.json."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, IndexError):
        config = json.loads((root / "config.json").read_text())
        config["tokenizer"]["id"] = sha256(root / "tokenizer.model")
        (root / "config.json").write_text(json.dumps(config))
    restamp_checksums(root)


def restamp_shards(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    for shard in manifest["shards"]:
        for name, entry in shard["files"].items():
            path = root / name
            if path.is_file() and "/" not in name:
                entry.update(sha256=sha256(path), bytes=path.stat().st_size)
    (root / "manifest.json").write_text(json.dumps(manifest))


# --- readers: the inputs ----------------------------------------------------------------


@pytest.fixture(scope="module")
def run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-step training run: a sharded checkpoint, latest.json, a model package."""
    out = tmp_path_factory.mktemp("fuzz-run")
    settings_ = trainer_settings(shards, {"training.train_iters": 2, "checkpoint.interval": 2})
    return fit_one_process(settings_, out)


@pytest.fixture(scope="module")
def step_dir(run: Path) -> Path:
    (step,) = (run / "checkpoints").glob("step-*")
    return step


@pytest.fixture(scope="module")
def run_config(run: Path) -> MegalithConfig:
    """The run's recipe with the model its package holds (the vocabulary filled in)."""
    config = load_config(run / "config.yaml")
    return config.model_copy(update={"model": read_package_model_config(run / "model")})


def trainee(config: MegalithConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[str]]:
    """A fresh model and optimizer of the run's config, as a resuming trainer holds."""
    torch.manual_seed(0)
    model = build_model(config.model)
    optimizer, names = build_optimizer(model, config.optimizer, torch.device("cpu"))
    return model, optimizer, names


@pytest.fixture(scope="module")
def checkpoints(step_dir: Path, run_config: MegalithConfig, tmp_path_factory) -> dict[str, Path]:
    """The run's v2 step folder, and a v1 (whole-tensor) one of the same model."""
    model, optimizer, names = trainee(run_config)
    state = {"consumed_samples": 0, "model_config": run_config.model.model_dump(mode="json")}
    root = tmp_path_factory.mktemp("fuzz-v1")
    return {"v2": step_dir, "v1": save_checkpoint(root, 2, model, optimizer, names, state)}


def resume(step: Path, config: MegalithConfig) -> None:
    """Trainer.resume's load, in one process: v2 resharded to this layout, or v1."""
    model, optimizer, names = trainee(config)
    if is_sharded(read_index(str(step))):
        load_sharded_checkpoint(
            step, model, optimizer, names, single_process_state(), restore_rng_state=False
        )
    else:
        load_checkpoint(step, model, optimizer, names, restore_rng=False)


# --- readers: the fuzz -------------------------------------------------------------------


TINY_RECIPES = [
    "tiny-cpu.yaml",
    "t5-tiny-cpu.yaml",
    "moe-tiny-cpu.yaml",
    "sft-tiny-cpu.yaml",
    "finetune-lora-tiny.yaml",
]
OVERRIDE_KEYS = [
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.max_position_embeddings",
    "model.num_experts",
    "data.seq_length",
    "training.micro_batch_size",
    "parallel.tensor",
    "model",
]
OVERRIDE_VALUES = [
    "1e400",
    "nan",
    "-1",
    "0",
    "10000000",
    "10000000000",
    "9" * 5000,
    "[[[[",
    "{a: *b}",
    "!!python/object/apply:os.system [id]",
    "0x10",
    "true",
    "null",
    "'",
    "[1, 2]",
    "{}",
]
OVERRIDES = st.builds(
    "{}={}".format,
    st.one_of(st.sampled_from(OVERRIDE_KEYS), st.text(max_size=12)),
    st.one_of(
        st.sampled_from(OVERRIDE_VALUES), st.integers(0, 70_000).map(str), st.text(max_size=12)
    ),
) | st.text(max_size=20)


def plan_memory(recipe: Path, overrides: list[str]) -> None:
    """``megalith train``'s first steps: the recipe and ``--set`` values validated, the
    model built on the meta device and its memory counted."""
    config = load_config(recipe, overrides)
    memory_report(config, resolve_layout(config, None))


@FUZZ
@given(data=st.data())
def test_fuzzed_recipes_load_or_raise_a_megalith_error(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(TINY_RECIPES), label="recipe")
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        recipe = Path(tmp) / name
        shutil.copy(RECIPE.parent / name, recipe)
        if data.draw(st.booleans(), label="mutate the file"):
            mutate_file(data, recipe)
        overrides = data.draw(st.lists(OVERRIDES, max_size=2), label="--set")
        loads_or_refuses(lambda: plan_memory(recipe, overrides))


@FUZZ
@given(data=st.data())
def test_fuzzed_model_packages_load_or_raise_a_megalith_error(
    run: Path, data: st.DataObject
) -> None:
    names = ["config.json", "checksums.json", "model.safetensors", "tokenizer.model"]
    with copy_of(run / "model") as package:
        mutate_folder(data, package, names, restamp_package)
        refused = loads_or_refuses(lambda: ckpt_verify(package))
        loaded = loads_or_refuses(lambda: load_model_package(package))
        loads_or_refuses(lambda: generate_from(package))
        if refused is None:  # what `megalith ckpt verify` accepts, the loader loads
            assert loaded is None, loaded


def generate_from(package: Path) -> None:
    """What ``megalith serve`` and ``megalith eval`` do with a package: load it (weights,
    tokenizer) and generate a few tokens."""
    served = load_served_model(str(package))
    sampling = SamplingConfig(max_new_tokens=2, temperature=0)
    generate(served.model, served.tokenizer, ["Once upon a time"], sampling)


@FUZZ
@given(data=st.data())
def test_fuzzed_tokenizer_models_load_or_raise_a_megalith_error(
    shards: Path, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        model = Path(tmp) / "tokenizer.model"
        shutil.copy(Path(shards) / "tokenizer.model", model)
        mutate_file(data, model)
        loads_or_refuses(lambda: round_trip(load_tokenizer(str(model))))


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer.json (Hugging Face tokenizers), as a user brings one."""
    from test_hf_tokenizer import train_byte_level_bpe

    path = tmp_path_factory.mktemp("fuzz-tokenizer-json") / "tokenizer.json"
    train_byte_level_bpe(300).save(str(path))
    return path


@FUZZ
@given(data=st.data())
def test_fuzzed_tokenizer_json_files_load_or_raise_a_megalith_error(
    tokenizer_json: Path, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        path = Path(tmp) / "tokenizer.json"
        shutil.copy(tokenizer_json, path)
        mutate_file(data, path)
        loads_or_refuses(lambda: round_trip(load_tokenizer(str(path))))


def round_trip(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time, the horse said hello.")
    tokenizer.decode([*ids, *range(min(tokenizer.vocab_size, 64))])


@FUZZ
@given(kind=st.sampled_from(["v2", "v1"]), data=st.data())
def test_fuzzed_checkpoints_verify_load_or_raise_a_megalith_error(
    checkpoints: dict[str, Path], run_config: MegalithConfig, kind: str, data: st.DataObject
) -> None:
    names = sorted(path.name for path in checkpoints[kind].iterdir())
    with copy_of(checkpoints[kind]) as step:
        mutate_folder(data, step, names, restamp_checksums)
        refused = loads_or_refuses(lambda: ckpt_verify(step))
        weights = loads_or_refuses(lambda: read_model_weights(step))
        loads_or_refuses(lambda: resume(step, run_config))  # may also refuse: it has a model
        if refused is None:  # what verify accepts, the weights readers read
            assert weights is None, weights


@pytest.mark.parametrize("kind", ["v2", "v1"])
@pytest.mark.parametrize(("key", "value"), [("eps", float("nan")), ("betas", [0.9]), ("lr", "1")])
def test_optimizer_settings_unlike_the_optimizers_are_refused_on_resume(
    checkpoints: dict[str, Path], run_config: MegalithConfig, kind: str, key: str, value: Any
) -> None:
    """A NaN eps, a one-element betas or a string lr would fail (or poison) the first step
    after the resume; they are refused naming the group and setting."""
    with copy_of(checkpoints[kind]) as step:
        state = json.loads((step / "state.json").read_text())
        state["optimizer"]["param_groups"][0][key] = value
        (step / "state.json").write_text(json.dumps(state))
        restamp_checksums(step)
        with pytest.raises(MegalithError, match=f"{key}"):
            resume(step, run_config)


@FUZZ
@given(data=st.data())
def test_fuzzed_latest_pointers_resolve_or_raise_a_megalith_error(
    run: Path, data: st.DataObject
) -> None:
    with copy_of(run / "checkpoints") as root:
        mutate_file(data, root / "latest.json")
        loads_or_refuses(lambda: latest_sharded_checkpoint(root))


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_headers_are_checked_or_refused(
    step_dir: Path, data: st.DataObject
) -> None:
    with copy_of(step_dir) as step:
        tensors = step / "model-r00000.safetensors"
        mutate_file(data, tensors)
        loads_or_refuses(lambda: check_safetensors(tensors))


@pytest.fixture(scope="module")
def adapter(run: Path, run_config: MegalithConfig, tmp_path_factory) -> Path:
    """A rank-4 LoRA adapter on the run's model: layer 0's attention projection."""
    hidden = run_config.model.hidden_size
    tensors = {
        "layers.0.attention.proj.lora.a": torch.full((4, hidden), 0.01),
        "layers.0.attention.proj.lora.b": torch.full((hidden, 4), 0.01),
    }
    out = tmp_path_factory.mktemp("fuzz-adapter") / "adapter"
    return save_adapter(tensors, LoRAConfig(rank=4, alpha=8), run_config.model, {}, out)


def restamp_adapter(root: Path) -> None:
    meta = json.loads((root / "adapter.json").read_text())
    meta["weights"]["sha256"] = sha256(root / "adapter.safetensors")
    (root / "adapter.json").write_text(json.dumps(meta))


@FUZZ
@given(data=st.data())
def test_fuzzed_lora_adapters_load_and_merge_or_raise_a_megalith_error(
    run: Path, adapter: Path, data: st.DataObject
) -> None:
    base = model_tensors(load_model_package(run / "model")[0])
    with copy_of(adapter) as copy:
        mutate_folder(data, copy, ["adapter.json", "adapter.safetensors"], restamp_adapter)
        loads_or_refuses(lambda: merge_adapter(load_adapter(copy), base))


CACHE_SAMPLES = (48, 0, 0)


def cache_config(shards: Path, cache: Path) -> DataConfig:
    """Two sources (so a blend is cached too), 32-token samples, the cache in ``cache``."""
    sources = [DatasetSource(path=str(shards)), DatasetSource(path=str(shards), weight=0.5)]
    return DataConfig(blend=sources, seq_length=32, split=(1.0, 0.0, 0.0), cache_dir=str(cache))


def samples_digest(data: DataConfig) -> str:
    """The sha256 of every training sample the datasets of ``data`` give, in order."""
    train, _, _ = build_gpt_datasets(data, CACHE_SAMPLES)
    samples = [train[i]["tokens"].tolist() for i in range(len(train))]
    return hashlib.sha256(json.dumps(samples).encode()).hexdigest()


@pytest.fixture(scope="module")
def cached(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A built index cache and the digest of the samples it gives."""
    cache = tmp_path_factory.mktemp("fuzz-cache") / "cache"
    return cache, samples_digest(cache_config(Path(shards), cache))


def mutate_array(data: st.DataObject, path: Path) -> None:
    """One value set to a big or negative integer, the array cut, reshaped or made float."""
    array = np.load(path, allow_pickle=False)
    action = data.draw(st.sampled_from(["value", "value", "cut", "shape", "float"]), label="array")
    if action == "value" and array.size:
        flat = array.reshape(-1).astype(np.int64)
        at = data.draw(st.integers(0, flat.size - 1), label="element")
        flat[at] = data.draw(st.sampled_from([-1, 10**6, 2**40, *BIG_INTS[:8]]), label="value")
        array = flat.reshape(array.shape)
    elif action == "cut":
        array = array[: data.draw(st.integers(0, max(len(array) - 1, 0)), label="length")]
    elif action == "shape":
        array = array.reshape(-1)
    else:
        array = array.astype(np.float64)
    np.save(path, array, allow_pickle=False)


@FUZZ
@given(data=st.data())
def test_fuzzed_index_caches_are_rebuilt_or_refused(
    shards: Path, cached: tuple[Path, str], data: st.DataObject
) -> None:
    """The index cache may sit on shared storage: a tampered entry is rebuilt or read (a
    value changed within bounds picks other samples of the same data), never a crash or
    a hang."""
    cache, _ = cached
    with copy_of(cache) as copy:
        arrays = sorted(path.name for path in copy.glob("*.npy"))
        for name in data.draw(
            st.lists(st.sampled_from(arrays), min_size=1, max_size=2, unique=True)
        ):
            if data.draw(st.booleans(), label="as bytes"):
                mutate_file(data, copy / name)
            else:
                mutate_array(data, copy / name)
        loads_or_refuses(lambda: samples_digest(cache_config(Path(shards), copy)))


@pytest.mark.parametrize("name", ["shuffle_index", "sample_index", "document_index"])
def test_an_index_cache_pointing_past_its_data_is_rebuilt(
    shards: Path, cached: tuple[Path, str], name: str
) -> None:
    cache, expected = cached
    with copy_of(cache) as copy:
        for path in copy.glob(f"*-{name}.npy"):
            array = np.load(path).astype(np.int64)
            array.reshape(-1)[0] = 10**12
            np.save(path, array)
        assert samples_digest(cache_config(Path(shards), copy)) == expected


@pytest.fixture(scope="module")
def hf_dir(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's package exported as a Hugging Face directory (what the Hub serves)."""
    return export_hf(run / "model", tmp_path_factory.mktemp("fuzz-hf") / "hf")


@FUZZ
@given(data=st.data())
def test_fuzzed_hf_directories_import_or_raise_a_megalith_error(
    hf_dir: Path, data: st.DataObject
) -> None:
    names = ["config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"]
    with copy_of(hf_dir) as source:
        for name in data.draw(
            st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)
        ):
            mutate_file(data, source / name)
        loads_or_refuses(lambda: import_hf(source, source.parent / "package"))


def read_every_document(root: Path) -> None:
    """Open the shard set as training does and read its documents (the first 64)."""
    shard_set = open_shard_set(str(root))
    for document in range(min(shard_set.num_documents, 64)):
        length = int(shard_set.document_lengths[document])
        shard_set.document_tokens(document, 0, length)


@FUZZ
@given(data=st.data())
def test_fuzzed_shard_sets_verify_open_or_raise_a_megalith_error(
    shards: Path, data: st.DataObject
) -> None:
    names = ["manifest.json", "shard-00000.idx", "shard-00000.bin", "shard-00001.idx"]
    with copy_of(Path(shards)) as root:
        mutate_folder(data, root, names, restamp_shards)
        problems: list[str] = []
        loads_or_refuses(lambda: problems.extend(verify_shard_set(str(root))))
        assert all(isinstance(p, str) and p for p in problems)
        loads_or_refuses(lambda: read_every_document(root))


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


OPENAI_EXTRA = {
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1), max_size=3)),
    "logprobs": st.integers(0, 3),
    "stream_options": st.just({"include_usage": True}),
}


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A completions or chat body as the fuzz above draws them, with OpenAI's fields (model,
    n, stop, logprobs...), some of them junk."""
    chat = draw(st.booleans())
    body = draw(chat_bodies() if chat else generate_bodies())
    body.pop("timeout_s", None)
    body["model"] = draw(st.one_of(st.just("model"), st.just("model"), JUNK))
    for key, value in OPENAI_EXTRA.items():
        if draw(st.booleans()):
            body[key] = draw(st.one_of(value, JUNK) if draw(st.booleans()) else value)
    if chat and "logprobs" in body:
        body["logprobs"], body["top_logprobs"] = True, body["logprobs"]
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(FUZZ, max_examples=max(30, FUZZ.max_examples // 3))  # ~3 s on CI
@given(request=openai_bodies())
def test_fuzzed_openai_bodies_never_answer_5xx(
    http: httpx.Client, request: tuple[str, dict[str, Any]]
) -> None:
    """2xx, or a 4xx in OpenAI's error shape naming what is wrong; never a 5xx."""
    path, body = request
    response = post_raw(http, path, json.dumps(body).encode(), "application/json")
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"].endswith("_error"), error
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text
    else:
        assert all(c["finish_reason"] in ("stop", "length") for c in response.json()["choices"])


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


@FUZZ
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
