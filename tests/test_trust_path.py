"""One checkpoint trust path (issue 16 §3): every loader of weights verifies before it
reads, honours required signatures, takes the signature scheme from its own key, checks
the step a checkpoint claims against the step it was asked for, and ``ckpt verify``
reports files its manifest does not list.

Real files throughout (v1 and v2 checkpoints, model packages), real ``megalith``
subprocesses for the CLI refusals, hypothesis for the index reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megalith.config import ModelConfig, OptimizerConfig
from megalith.errors import MegalithError
from training.checkpoint.async_save import Checkpointer
from training.checkpoint.cli import inspect, verify
from training.checkpoint.format import latest_checkpoint, load_checkpoint, save_checkpoint
from training.checkpoint.sharded_index import latest_sharded_checkpoint
from training.checkpoint.sharded_reader import (
    load_sharded_checkpoint,
    read_global_tensors,
    read_model_weights,
)
from training.checkpoint.sharded_writer import SaveRequest
from training.checkpoint.signing import (
    ED25519_PRIVATE_ENV,
    ED25519_PUBLIC_ENV,
    KEY_ENV,
    REQUIRE_ENV,
    sign_directory,
)
from training.finetune.base import load_base
from training.models.gpt import GPTModel
from training.models.package import load_model_package, save_model_package
from training.optim.adamw import build_optimizer
from training.parallel.groups import single_process_state

REPO = Path(__file__).resolve().parents[1]
KEY = "k" * 40
SIGNING_ENVS = (KEY_ENV, ED25519_PRIVATE_ENV, ED25519_PUBLIC_ENV, REQUIRE_ENV)


@pytest.fixture(autouse=True)
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SIGNING_ENVS:
        monkeypatch.delenv(name, raising=False)


def tiny_model() -> GPTModel:
    torch.manual_seed(0)
    config = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, vocab_size=64, max_position_embeddings=16, backend="torch",
    )  # fmt: skip
    return GPTModel(config)


def trained(model: GPTModel):
    optimizer, names = build_optimizer(model, OptimizerConfig(lr=1e-2), torch.device("cpu"))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    model(tokens, labels=tokens).backward()
    optimizer.step()
    return optimizer, names


def state_of(model: GPTModel) -> dict:
    return {"consumed_samples": 0, "model_config": model.config.model_dump(mode="json")}


def save(kind: str, root: Path, step: int, model: GPTModel, sign: bool = False) -> Path:
    """A complete v1 or v2 checkpoint of ``model`` at ``root/step-N``."""
    optimizer, names = trained(model)
    if kind == "v1":
        return save_checkpoint(
            root, step, model, optimizer, names, state_of(model), keep_last=10, sign=sign
        )
    request = SaveRequest(
        str(root), step, model, optimizer, names, state_of(model), single_process_state(),
        "ddp", keep_last=10, sign=sign,
    )  # fmt: skip
    return Path(Checkpointer().save(request, background=False))


def load(kind: str, path: Path, require_signature: bool = False) -> dict:
    """Resume-style load into a fresh model (what the trainer does)."""
    model = tiny_model()
    optimizer, names = build_optimizer(model, OptimizerConfig(lr=1e-2), torch.device("cpu"))
    if kind == "v1":
        return load_checkpoint(path, model, optimizer, names, require_signature=require_signature)
    return load_sharded_checkpoint(
        path, model, optimizer, names, single_process_state(), require_signature=require_signature
    )


def package(root: Path, sign: bool = False) -> Path:
    model = tiny_model()
    (root / "tok.model").write_bytes(b"not a real tokenizer, only hashed")
    return save_model_package(model, model.config, root / "tok.model", root / "pkg", sign=sign)


@contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block runs longer than ``seconds``."""

    def timeout(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def megalith(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SIGNING_ENVS}
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**clean, **(env or {})},
    )


def refused(result: subprocess.CompletedProcess, *names: str) -> str:
    """The CLI's refusal: exit 1, one ``error:`` line naming ``names``, no traceback."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip()
    assert message.startswith("error: ") and len(message.splitlines()) == 1, message
    for name in names:
        assert name in message, (name, message)
    return message


# --------------------------------------------------------------------------- unhashed reads

# Every loader of a checkpoint step folder; each must verify before it reads.
STEP_LOADERS: dict[str, Callable[[str, Path], object]] = {
    "resume": lambda kind, path: load(kind, path),
    "finetune-base": lambda kind, path: load_base(str(path)),
    "read_model_weights": lambda kind, path: read_model_weights(path),
    "ckpt-verify": lambda kind, path: verify(path),
}


def dev_zero_state(path: Path) -> None:
    (path / "state.json").unlink()
    (path / "state.json").symlink_to("/dev/zero")


def fifo_state(path: Path) -> None:
    (path / "state.json").unlink()
    os.mkfifo(path / "state.json")  # a read would block forever


def fifo_index(path: Path) -> None:
    (path / "index.json").unlink()
    os.mkfifo(path / "index.json")


@pytest.mark.parametrize("loader", STEP_LOADERS)
@pytest.mark.parametrize("attack", [dev_zero_state, fifo_state, fifo_index])
@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_an_unhashed_file_is_never_read(
    kind: str, attack: Callable[[Path], None], loader: str, tmp_path: Path
) -> None:
    path = save(kind, tmp_path, 1, tiny_model())
    attack(path)
    name = "index.json" if attack is fifo_index else "state.json"
    started = time.monotonic()
    with within(10), pytest.raises(MegalithError, match=rf"{name}.*(symbolic link|regular file)"):
        STEP_LOADERS[loader](kind, path)
    assert time.monotonic() - started < 1.0  # refused, not read


def restamp_state(path: Path, state: dict) -> None:
    """Rewrite state.json and re-hash it in the index, as the writer of an unsigned
    checkpoint can: the checks on its content must hold on their own."""
    data = json.dumps(state).encode()
    (path / "state.json").write_bytes(data)
    index = json.loads((path / "index.json").read_text())
    index["files"]["state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "index.json").write_text(json.dumps(index))


STATE_LIES: dict[str, tuple[Callable[[dict], dict], str]] = {
    "rng-not-an-object": (lambda s: {**s, "rng": "x"}, "key 'rng'"),
    "python-rng-short": (lambda s: {**s, "rng": {**s["rng"], "python": [3]}}, "rng.python"),
    "numpy-pos-string": (
        lambda s: {**s, "rng": {**s["rng"], "numpy": {**s["rng"]["numpy"], "pos": "a"}}},
        "rng.numpy.pos",
    ),
    "no-consumed-samples": (
        lambda s: {k: v for k, v in s.items() if k != "consumed_samples"},
        "consumed_samples",
    ),
    "optimizer-not-an-object": (lambda s: {**s, "optimizer": "x"}, "key 'optimizer'"),
    "scaler-of-strings": (lambda s: {**s, "scaler": {"scale": "x"}}, "scaler"),
    "model-config-a-string": (lambda s: {**s, "model_config": "x"}, "model_config"),
    "step-a-string": (lambda s: {**s, "step": "1"}, "step"),
}


@pytest.mark.parametrize("loader", ["resume", "finetune-base"])
@pytest.mark.parametrize("lie", STATE_LIES)
@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_a_restamped_state_json_of_the_wrong_shape_is_refused_naming_the_key(
    kind: str, lie: str, loader: str, tmp_path: Path
) -> None:
    path = save(kind, tmp_path, 1, tiny_model())
    change, key = STATE_LIES[lie]
    restamp_state(path, change(json.loads((path / "state.json").read_text())))
    with pytest.raises(MegalithError, match=rf"state\.json.*{re.escape(key)}"):
        STEP_LOADERS[loader](kind, path)


def test_ckpt_inspect_never_blocks_on_a_pipe(tmp_path: Path) -> None:
    """``inspect`` reads only JSON and headers, unverified, but never waits on a FIFO."""
    pkg = package(tmp_path)
    (pkg / "model.safetensors").unlink()
    os.mkfifo(pkg / "model.safetensors")
    with within(10), pytest.raises(MegalithError, match="model.safetensors: not a regular file"):
        inspect(pkg)
    path = save("v1", tmp_path / "v1", 1, tiny_model())
    fifo_state(path)
    with within(10):
        assert inspect(path)["step"] is None


def test_read_global_tensors_checks_the_signature(tmp_path: Path, monkeypatch) -> None:
    path = save("v2", tmp_path, 1, tiny_model())
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(MegalithError, match="unsigned"):
        read_global_tensors(path, require_signature=True)
    sign_directory(path, "index.json")
    assert read_global_tensors(path, require_signature=True)
    index = json.loads((path / "index.json").read_text())
    (path / "index.json").write_text(json.dumps({**index, "layout": {}}))
    with pytest.raises(MegalithError, match="HMAC-SHA256 signature of index.json does not match"):
        read_global_tensors(path)  # present and a key set: checked even when not required


# --------------------------------------------------------------------------- ckpt verify


@pytest.mark.parametrize("kind", ["v1", "v2", "package"])
def test_ckpt_verify_reports_files_the_manifest_does_not_list(kind: str, tmp_path: Path) -> None:
    path = package(tmp_path) if kind == "package" else save(kind, tmp_path, 1, tiny_model())
    verify(path)  # sound
    torch.save({"iteration": 1}, path / "model_optim_rng.pt")  # what Megatron would unpickle
    (path / "notes").mkdir()
    message = refused(megalith("ckpt", "verify", str(path)), str(path), "model_optim_rng.pt")
    assert "notes" in message and "does not list" in message


def test_ckpt_verify_refuses_a_state_json_linked_to_dev_zero(tmp_path: Path) -> None:
    path = save("v2", tmp_path, 1, tiny_model())  # v1 and every loader: in process above
    dev_zero_state(path)
    refused(megalith("ckpt", "verify", str(path)), "state.json", "symbolic link")


# --------------------------------------------------------------------------- schemes


def ed25519_keys(directory: Path) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    private = ed25519.Ed25519PrivateKey.generate()
    private_pem, public_pem = directory / "signer.pem", directory / "signer.pub.pem"
    private_pem.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_pem.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return str(private_pem), str(public_pem)


def rewrite_signature(path: Path, **fields: str) -> None:
    record = json.loads((path / "signature.json").read_text())
    (path / "signature.json").write_text(json.dumps({**record, **fields}))


# (format, manifest, loader that honours require_signature)
SIGNED_LOADERS: dict[str, Callable[[Path, bool], object]] = {
    "v1": lambda path, required: load("v1", path, required),
    "v2": lambda path, required: load("v2", path, required),
    "package": lambda path, required: load_model_package(path, require_signature=required),
}


def signed_copy(kind: str, tmp_path: Path) -> tuple[Path, str]:
    if kind == "package":
        return package(tmp_path), "checksums.json"
    return save(kind, tmp_path, 1, tiny_model()), "index.json"


@pytest.mark.parametrize("kind", SIGNED_LOADERS)
def test_the_scheme_is_the_verifiers_not_the_files(kind: str, tmp_path: Path, monkeypatch) -> None:
    private, public = ed25519_keys(tmp_path)
    path, manifest = signed_copy(kind, tmp_path)
    loader = SIGNED_LOADERS[kind]

    monkeypatch.setenv(ED25519_PUBLIC_ENV, public)  # a verifier holding a public key:
    with pytest.raises(MegalithError, match=r"unsigned .*MEGALITH_ED25519_PUBLIC_KEY is set"):
        loader(path, False)  # unsigned fails even when not asked to require
    monkeypatch.setenv(KEY_ENV, KEY)
    sign_directory(path, manifest)  # HMAC-signed with a key the verifier also has
    with pytest.raises(MegalithError, match="signed with hmac-sha256, .* Ed25519 public key"):
        loader(path, False)
    rewrite_signature(path, algorithm="none")
    with pytest.raises(MegalithError, match="algorithm 'none' is not supported"):
        loader(path, False)

    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(ED25519_PRIVATE_ENV, private)
    sign_directory(path, manifest)
    loader(path, True)  # Ed25519 with its public key: loads
    monkeypatch.delenv(ED25519_PRIVATE_ENV)

    monkeypatch.delenv(ED25519_PUBLIC_ENV)  # a verifier holding only an HMAC key:
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(MegalithError, match="signed with ed25519, .* an HMAC key"):
        loader(path, False)  # before: passed unchecked, as no public key was set
    sign_directory(path, manifest)
    rewrite_signature(path, algorithm="ed25519", signature="0" * 128)
    with pytest.raises(MegalithError, match="signed with ed25519, .* an HMAC key"):
        loader(path, False)


def test_require_signature_env_reaches_every_package_loader(tmp_path: Path, monkeypatch) -> None:
    """MEGALITH_REQUIRE_SIGNATURE: evaluation, serving and export load packages through
    load_model_package; the CLI export refuses too."""
    from training.inference.loading import load_served_model
    from training.interop.export import export_hf

    pkg = package(tmp_path)
    monkeypatch.setenv(REQUIRE_ENV, "1")
    monkeypatch.setenv(KEY_ENV, KEY)
    for call in (
        lambda: load_model_package(pkg),
        lambda: load_served_model(str(pkg)),
        lambda: export_hf(pkg, tmp_path / "hf"),
        lambda: load_base(str(pkg)),
    ):
        with pytest.raises(MegalithError, match=r"unsigned .*MEGALITH_REQUIRE_SIGNATURE"):
            call()
    assert not (tmp_path / "hf").exists()
    env = {REQUIRE_ENV: "1", KEY_ENV: KEY}
    refused(megalith("export", "hf", str(pkg), str(tmp_path / "hf"), env=env), "unsigned")
    refused(megalith("ckpt", "verify", str(pkg), env=env), "unsigned")
    sign_directory(pkg, "checksums.json")
    load_model_package(pkg)  # signed: loads
    monkeypatch.setenv(REQUIRE_ENV, "maybe")
    with pytest.raises(MegalithError, match="MEGALITH_REQUIRE_SIGNATURE='maybe'"):
        load_model_package(pkg)


def test_adapters_are_signed_and_checked(tmp_path: Path, monkeypatch) -> None:
    """A LoRA adapter saved alone loads weights too: signed when a key is set, refused
    unsigned when required, and a changed adapter.json breaks its signature."""
    from megalith.config import LoRAConfig
    from training.finetune.adapter import load_adapter, save_adapter

    tensors = {
        "layers.0.attention.proj.lora.a": torch.ones(4, 32),
        "layers.0.attention.proj.lora.b": torch.zeros(32, 4),
    }
    lora, config = LoRAConfig(rank=4, alpha=8), tiny_model().config
    unsigned = save_adapter(tensors, lora, config, {}, tmp_path / "unsigned")
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(MegalithError, match=r"unsigned \(signature\.json is missing\)"):
        load_adapter(unsigned, require_signature=True)
    signed = save_adapter(tensors, lora, config, {}, tmp_path / "signed")
    assert load_adapter(signed, require_signature=True).tensors.keys() == tensors.keys()
    meta = json.loads((signed / "adapter.json").read_text())
    meta["lora"]["alpha"] = 800  # a 100x stronger adapter, same weights file
    (signed / "adapter.json").write_text(json.dumps(meta))
    with pytest.raises(MegalithError, match="signature of adapter.json does not match"):
        load_adapter(signed)


# --------------------------------------------------------------------------- identity


def two_signed_steps(kind: str, root: Path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv(KEY_ENV, KEY)
    first = save(kind, root, 1, tiny_model(), sign=True)
    second = save(kind, root, 2, tiny_model(), sign=True)
    return first, second


def latest(kind: str, root: Path) -> Path:
    return Path(latest_checkpoint(root) if kind == "v1" else latest_sharded_checkpoint(root))


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_an_older_signed_step_copied_over_a_newer_one_is_refused(
    kind: str, tmp_path: Path, monkeypatch
) -> None:
    first, second = two_signed_steps(kind, tmp_path, monkeypatch)
    assert load(kind, latest(kind, tmp_path), require_signature=True)["step"] == 2
    shutil.rmtree(second)
    shutil.copytree(first, second)  # step 1's signed files under step 2's name
    for target in (second, latest(kind, tmp_path)):
        with pytest.raises(MegalithError, match="holds step 1, but its folder names step 2"):
            load(kind, target, require_signature=True)
    with pytest.raises(MegalithError, match="holds step 1, but its folder names step 2"):
        load_base(str(tmp_path), require_signature=True)  # fine-tuning from "latest"
    if kind == "v2":  # the CLI once; the verifiers of both formats are called above
        refused(megalith("ckpt", "verify", str(second)), "holds step 1")

    shutil.rmtree(second)
    first.rename(second)  # renamed, latest.json still naming step 2
    with pytest.raises(MegalithError, match="holds step 1, but its folder names step 2"):
        load(kind, latest(kind, tmp_path), require_signature=True)


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_a_latest_pointer_whose_step_and_folder_disagree_is_refused(
    kind: str, tmp_path: Path, monkeypatch
) -> None:
    two_signed_steps(kind, tmp_path, monkeypatch)
    (tmp_path / "latest.json").write_text(json.dumps({"step": 2, "path": "step-00000001"}))
    with pytest.raises(MegalithError, match=r"step 2 but path 'step-00000001'"):
        latest(kind, tmp_path)
    (tmp_path / "latest.json").write_text(json.dumps({"step": 2, "path": "step-00000002"}))
    shutil.rmtree(tmp_path / "step-00000002")
    (tmp_path / "step-00000002").symlink_to(tmp_path / "step-00000001")
    with pytest.raises(MegalithError, match="symbolic link"):
        latest(kind, tmp_path)


def test_a_checkpoint_signed_before_its_index_held_the_step_still_loads(
    tmp_path: Path, monkeypatch
) -> None:
    """v1 indexes written before this change have no "step": the signed, hashed
    state.json gives it, so old signed checkpoints keep loading (and are still checked)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    path = save("v1", tmp_path, 3, tiny_model())
    index = json.loads((path / "index.json").read_text())
    del index["step"]
    (path / "index.json").write_text(json.dumps(index, indent=2))
    sign_directory(path, "index.json")  # as the old code signed it
    assert load("v1", path, require_signature=True)["step"] == 3
    moved = path.rename(tmp_path / "step-00000004")
    with pytest.raises(MegalithError, match="holds step 3, but its folder names step 4"):
        load("v1", moved, require_signature=True)


# --------------------------------------------------------------------------- fine-tuning CLI


def test_a_finetune_that_requires_signatures_refuses_an_unsigned_base(
    shards: Path, tmp_path: Path
) -> None:
    """``megalith train`` with ``finetune.base`` a checkpoint: refused before any training
    when ``checkpoint.require_signature`` (or MEGALITH_REQUIRE_SIGNATURE) is set."""
    model = tiny_model()
    save("v2", tmp_path / "base", 1, model)
    common = [
        "train", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--quiet",
        "--set", f"finetune.base={tmp_path / 'base'}",
        "--set", f"data.output={shards}",
        "--set", "logging.mlflow=false",
        "--set", "training.device=cpu",
    ]  # fmt: skip
    out = tmp_path / "run"
    result = megalith(
        *common, "--output", str(out), "--set", "checkpoint.require_signature=true",
        env={KEY_ENV: KEY},
    )  # fmt: skip
    refused(result, "unsigned", "signature.json")
    assert not (out / "checkpoints").exists()
    result = megalith(*common, "--output", str(out), env={KEY_ENV: KEY, REQUIRE_ENV: "1"})
    refused(result, "unsigned")

    os.environ[KEY_ENV] = KEY  # the same base signed passes the same check in process
    try:
        sign_directory(tmp_path / "base" / "step-00000001", "index.json")
        base = load_base(str(tmp_path / "base"), require_signature=True)
    finally:
        del os.environ[KEY_ENV]
    assert base.details["step"] == "1" and base.config == model.config


@pytest.mark.parametrize(
    ("shape", "boxes", "message"),
    [
        ([1 << 16], [[[i, i + 1]] for i in range(1 << 16)], "final_norm.weight is"),
        ([1 << 16], [[[0, 2]], *([[i, i + 1]] for i in range(1, 1 << 16))], "overlaps"),
        ([1 << 15, 1 << 15], [[[i, i + 1], [i, i + 1]] for i in range(1 << 15)], "cells"),
    ],
    ids=["65536-shards", "65536-overlapping", "cell-bomb"],
)
def test_an_index_with_the_most_shards_is_checked_in_bounded_time(
    shape: list[int], boxes: list, message: str, tmp_path: Path
) -> None:
    """The shard-cover check is linear in the shards (a pairwise check of 65536 boxes
    would run for hours)."""
    path = save("v2", tmp_path, 1, tiny_model())
    index = json.loads((path / "index.json").read_text())
    shard = index["tensors"]["final_norm.weight"]["shards"][0]
    shards = [{**shard, "box": box} for box in boxes]
    index["tensors"]["final_norm.weight"] = {"shape": shape, "dtype": "float32", "shards": shards}
    (path / "index.json").write_text(json.dumps(index))
    with within(20), pytest.raises(MegalithError, match=message):  # hours before
        verify(path)


# --------------------------------------------------------------------------- fuzz

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(["../x", "/dev/zero", "abc", "0" * 64, "float32", "state.json", "x" * 5000]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def mutate(data: st.DataObject, value: object) -> object:
    """``value`` with one subtree replaced by arbitrary JSON (or a key dropped)."""
    if isinstance(value, dict | list) and value and data.draw(st.integers(0, 3)) > 0:
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        key = data.draw(st.sampled_from(keys))
        if isinstance(value, dict) and data.draw(st.integers(0, 5)) == 0:
            del value[key]
        else:
            value[key] = mutate(data, value[key])
        return value
    return data.draw(JSON)


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    return {kind: save(kind, root / kind, 1, tiny_model()) for kind in ("v1", "v2")}


@pytest.mark.parametrize("kind", ["v1", "v2"])
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_index_only_raises_megalith_errors(
    kind: str, sound: dict[str, Path], data: st.DataObject
) -> None:
    path = sound[kind]
    original = (path / "index.json").read_bytes()
    index = mutate(data, json.loads(original))
    (path / "index.json").write_text(json.dumps(index))
    try:
        with within(20):  # a hang fails the example
            inspect(path)
            verify(path)
            load(kind, path)
    except MegalithError as error:
        assert len(str(error)) < 2000, str(error)[:300]  # one short message, no echo
    finally:
        (path / "index.json").write_bytes(original)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    record=JSON
    | st.fixed_dictionaries(
        {
            "algorithm": st.sampled_from(["hmac-sha256", "ed25519", "none"]) | JSON,
            "manifest": st.sampled_from(["index.json"]) | JSON,
            "signature": st.sampled_from(["0" * 64, "0" * 128]) | JSON,
        },
    ),  # fmt: skip
    raw=st.none() | st.binary(max_size=64) | st.just(b"[" * 60000),
)
def test_fuzzed_signature_files_only_raise_megalith_errors(
    sound: dict[str, Path], record: object, raw: bytes | None, monkeypatch
) -> None:
    """signature.json is read before anything is trusted: any content is refused cleanly
    (none of these is a valid signature) by the verifier holding a key."""
    path = sound["v2"]
    monkeypatch.setenv(KEY_ENV, KEY)
    (path / "signature.json").write_bytes(json.dumps(record).encode() if raw is None else raw)
    try:
        with within(20), pytest.raises(MegalithError, match="signature.json"):
            verify(path)
    finally:
        (path / "signature.json").unlink()


def test_a_key_path_to_dev_zero_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = save("v1", tmp_path, 1, tiny_model())
    monkeypatch.setenv(ED25519_PUBLIC_ENV, "/dev/zero")
    (path / "signature.json").write_text(
        json.dumps({"algorithm": "ed25519", "manifest": "index.json", "signature": "0" * 128})
    )
    with within(10), pytest.raises(MegalithError, match="/dev/zero: cannot read a PEM key"):
        verify(path)
