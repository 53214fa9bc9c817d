"""Hardened loading: every loader refuses every crafted bad input in tests/bad_checkpoints.py
with an error naming the file and the defect, and no pickle in the corpus ever runs.

Loaders (``LOADERS``): v1 ``load_checkpoint``, ``megalith ckpt verify`` on a v1 checkpoint
and on a model package, ``load_model_package``, ``megalith import hf`` (with
``--allow-torch-bin``) and ``megalith import megatron``. The v2 sharded checkpoint adds
one entry (a sound-input writer, its Target and its load call).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bad_checkpoints as bad
import pytest
import torch

from megalith.config import ModelConfig, OptimizerConfig, TokenizerConfig
from megalith.errors import MegalithError
from pipelines.cli import main
from preprocessing.tokenizer import train_tokenizer
from training.checkpoint.async_save import Checkpointer
from training.checkpoint.cli import verify
from training.checkpoint.format import load_checkpoint, save_checkpoint
from training.checkpoint.sharded_reader import load_sharded_checkpoint
from training.checkpoint.sharded_writer import SaveRequest
from training.checkpoint.signing import KEY_ENV
from training.interop.export import export_hf
from training.interop.hf import import_hf
from training.interop.megatron import import_megatron
from training.models.gpt import GPTModel
from training.models.package import load_model_package, save_model_package
from training.optim.adamw import build_optimizer
from training.parallel.groups import single_process_state

REPO = Path(__file__).resolve().parents[1]
VOCAB = 448
KEY = "k" * 40
STATE = {"consumed_samples": 0}  # what state.json needs beyond what saving adds


def tiny_model() -> GPTModel:
    torch.manual_seed(0)
    config = ModelConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        backend="torch",
    )
    return GPTModel(config)


def fresh_v1(model: GPTModel):
    optimizer, names = build_optimizer(model, OptimizerConfig(lr=1e-2), torch.device("cpu"))
    return optimizer, names


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One sound input per format, copied for every case."""
    base = tmp_path_factory.mktemp("sound")
    lines = (REPO / "preprocessing/sample_corpus/stories.jsonl").read_text().splitlines()
    docs = [json.loads(line)["text"] for line in lines[:300]]
    config = TokenizerConfig(vocab_size=400, pad_vocab_multiple=64, max_training_documents=300)
    train_tokenizer(docs, config, str(base / "tok"))
    model = tiny_model()
    optimizer, names = fresh_v1(model)
    model(
        torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)
    ).backward()
    optimizer.step()
    v1 = save_checkpoint(base / "ckpts", 1, model, optimizer, names, STATE, sign=False)
    v2 = Checkpointer().save(
        SaveRequest(
            str(base / "v2"), 1, model, optimizer, names, STATE, single_process_state(), "ddp",
            sign=False,
        ),
        background=False,
    )  # fmt: skip
    package = save_model_package(model, model.config, base / "tok.model", base / "pkg", sign=False)
    return {
        "tokenizer": base / "tok.model",
        "v1": v1,
        "v2": Path(v2),
        "package": package,
        "hf": export_hf(package, base / "hf"),
        "megatron": bad.megatron_checkpoint(base / "megatron"),
    }


# --------------------------------------------------------------------------- loaders


def _add_to_index(root: Path, name: str) -> None:
    index = json.loads((root / "index.json").read_text())
    index["files"][name] = {"sha256": "0" * 64, "bytes": 0}
    (root / "index.json").write_text(json.dumps(index))


def _add_to_checksums(root: Path, name: str) -> None:
    data = json.loads((root / "checksums.json").read_text())
    data["files"][name] = "0" * 64
    (root / "checksums.json").write_text(json.dumps(data))


def _add_to_hf_index(root: Path, name: str) -> None:
    keys = json.loads((root / "config.json").read_text())  # any key set works: names are checked
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": name}, "n": len(keys)})
    )


V1 = bad.Target("v1", "model.safetensors", "index.json", _add_to_index)
V2 = bad.Target(
    "v2", "model-r00000.safetensors", "index.json", _add_to_index,
    other_file="optimizer-r00000.safetensors",
)  # fmt: skip
PACKAGE = bad.Target("package", "model.safetensors", "checksums.json", _add_to_checksums)
HF = bad.Target("hf", "model.safetensors", None, _add_to_hf_index)
MEGATRON = bad.Target(
    "megatron", "iter_0000007/mp_rank_00/model_optim_rng.pt", None, lambda r, n: None, ".pt"
)


def _load_v1(root: Path, out: Path, sources: dict, require_signature: bool = False) -> None:
    model = tiny_model()
    optimizer, names = fresh_v1(model)
    load_checkpoint(root, model, optimizer, names, require_signature=require_signature)


def _load_v2(root: Path, out: Path, sources: dict, require_signature: bool = False) -> None:
    model = tiny_model()
    optimizer, names = fresh_v1(model)
    load_sharded_checkpoint(
        root, model, optimizer, names, single_process_state(), require_signature=require_signature
    )


@dataclass
class Loader:
    name: str
    source: str
    target: bad.Target
    load: Callable[..., object]


LOADERS = {
    "v1-load": Loader("v1-load", "v1", V1, _load_v1),
    "v1-ckpt-verify": Loader(
        "v1-ckpt-verify", "v1", V1, lambda r, o, s, **k: verify(r, k.get("require_signature"))
    ),
    "v2-load": Loader("v2-load", "v2", V2, _load_v2),
    "v2-ckpt-verify": Loader(
        "v2-ckpt-verify", "v2", V2, lambda r, o, s, **k: verify(r, k.get("require_signature"))
    ),
    "package-load": Loader(
        "package-load", "package", PACKAGE, lambda r, o, s, **k: load_model_package(r, **k)
    ),
    "package-ckpt-verify": Loader(
        "package-ckpt-verify",
        "package",
        PACKAGE,
        lambda r, o, s, **k: verify(r, k.get("require_signature")),
    ),
    "hf-import": Loader(
        "hf-import", "hf", HF, lambda r, o, s, **k: import_hf(r, o, allow_torch_bin=True)
    ),
    "megatron-import": Loader(
        "megatron-import",
        "megatron",
        MEGATRON,
        lambda r, o, s, **k: import_megatron(r, o, tokenizer=s["tokenizer"]),
    ),
}

CHECKPOINTS = [
    "v1-load", "v1-ckpt-verify", "v2-load", "v2-ckpt-verify", "package-load", "package-ckpt-verify"
]  # fmt: skip
ALL = [*CHECKPOINTS, "hf-import"]
# defect -> the loaders it applies to. HF and Megatron directories carry no sha256
# manifest, so a tampered byte there is undetectable by design (docs/security.md).
CASES: dict[Callable, list[str]] = {
    bad.pickle_in_tensor_file: [*ALL, "megatron-import"],
    bad.pickle_beside: CHECKPOINTS,
    bad.pickle_as_torch_bin: ["hf-import"],
    bad.tampered_byte: CHECKPOINTS,
    bad.truncated: ["v1-load", "v1-ckpt-verify", "v2-load", "v2-ckpt-verify"],
    bad.truncated_restamped: ALL,
    bad.swapped_files: CHECKPOINTS,
    bad.swapped_files_restamped: CHECKPOINTS,
    bad.name_outside("dotdot"): ALL,
    bad.name_outside("absolute"): ALL,
    bad.name_outside("symlink"): [*CHECKPOINTS, "megatron-import"],
    bad.huge_header_length: ALL,
    bad.huge_tensor: ALL,
    bad.wrong_dtype: CHECKPOINTS,
    bad.wrong_shape: ALL,
    bad.megatron_wrong_shape: ["megatron-import"],
    bad.tracker_outside: ["megatron-import"],
    bad.missing_file: [*ALL, "megatron-import"],
}
PARAMS = [
    pytest.param(defect, loader, id=f"{defect.__name__}-{loader}")
    for defect, loaders in CASES.items()
    for loader in loaders
]


def _copy(sources: dict, loader: Loader, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sources[loader.source], tmp_path / "in", symlinks=True))


@pytest.mark.parametrize(("defect", "loader_name"), PARAMS)
def test_bad_input_is_refused_naming_file_and_defect(
    sources: dict, tmp_path: Path, defect: Callable, loader_name: str, monkeypatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    loader = LOADERS[loader_name]
    root = _copy(sources, loader, tmp_path)
    marker = tmp_path / "pwned"
    pattern = defect(loader.target, root, marker)
    if not pattern:  # a pickle beside the real files: loads, never unpickled
        loader.load(root, tmp_path / "out", sources)
    else:
        with pytest.raises(MegalithError, match=pattern) as refused:
            loader.load(root, tmp_path / "out", sources)
        print(f"{defect.__name__} x {loader_name}: {refused.value}")
        assert not (tmp_path / "out").exists(), "an output was written for a refused input"
    assert not marker.exists(), f"{loader_name} unpickled code from the {defect.__name__} input"


@pytest.mark.parametrize("loader_name", [*ALL, "megatron-import"])
def test_sound_inputs_load(sources: dict, tmp_path: Path, loader_name: str) -> None:
    loader = LOADERS[loader_name]
    loader.load(_copy(sources, loader, tmp_path), tmp_path / "out", sources)


# --------------------------------------------------------------------------- signatures


def _signed_copy(sources: dict, loader: Loader, tmp_path: Path, monkeypatch) -> Path:
    from training.checkpoint.signing import sign_directory

    root = _copy(sources, loader, tmp_path)
    monkeypatch.setenv(KEY_ENV, KEY)
    sign_directory(root, loader.target.manifest)
    return root


@pytest.mark.parametrize("loader_name", CHECKPOINTS)
def test_signatures_when_required(
    sources: dict, tmp_path: Path, loader_name: str, monkeypatch
) -> None:
    loader = LOADERS[loader_name]
    out = tmp_path / "out"
    unsigned = _copy(sources, loader, tmp_path / "u")
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(MegalithError, match=r"unsigned \(signature\.json is missing\)"):
        loader.load(unsigned, out, sources, require_signature=True)

    root = _signed_copy(sources, loader, tmp_path / "s", monkeypatch)
    loader.load(root, out, sources, require_signature=True)  # valid: loads

    monkeypatch.setenv(KEY_ENV, "x" * 40)  # another key
    with pytest.raises(MegalithError, match=r"signature\.json: the HMAC-SHA256 .* does not match"):
        loader.load(root, out, sources, require_signature=True)

    monkeypatch.setenv(KEY_ENV, KEY)  # a tensor changed and the manifest restamped after signing
    bad.tampered_byte(loader.target, root, tmp_path / "marker")
    bad.restamp(loader.target, root)
    with pytest.raises(MegalithError, match=r"signature\.json: the HMAC-SHA256 .* does not match"):
        loader.load(root, out, sources)  # present + key set: checked even when not required

    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(MegalithError, match=f"{KEY_ENV} holds 5 bytes; .* at least 32"):
        loader.load(root, out, sources, require_signature=True)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(MegalithError, match=f"{KEY_ENV} is not set"):
        loader.load(root, out, sources, require_signature=True)


def test_saving_signs_when_the_key_is_set(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    model = tiny_model()
    optimizer, names = fresh_v1(model)
    path = save_checkpoint(tmp_path, 3, model, optimizer, names, STATE)
    record = json.loads((path / "signature.json").read_text())
    assert record["algorithm"] == "hmac-sha256" and record["manifest"] == "index.json"
    assert main(["ckpt", "verify", "--require-signature", str(path)]) == 0
    monkeypatch.delenv(KEY_ENV)
    assert not (
        save_checkpoint(tmp_path, 4, model, optimizer, names, STATE) / "signature.json"
    ).exists()


# --------------------------------------------------------------------------- audit

# Files allowed to call torch.load, always with weights_only=True (checked below).
TORCH_LOAD_ALLOWED = {
    "training/interop/hf.py",
    "training/interop/megatron.py",
    "training/interop/dcp.py",
    "tests/bad_checkpoints.py",
    # registers megatron-core's own allow-list, as a Megatron run has it, to load our export
    # through megatron-core's dist_checkpointing.load
    "tests/test_megatron_export.py",
}
# Files allowed to import pickle, for a pickle.Unpickler whose find_class admits an
# allow-list only (DCP's .metadata); pickle.load/loads stay refused everywhere.
RESTRICTED_UNPICKLERS = {"training/interop/dcp.py"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _true_keywords(call: ast.Call) -> Callable[[str], bool]:
    values = {k.arg: k.value for k in call.keywords}
    return lambda key: isinstance(values.get(key), ast.Constant) and values[key].value is True


def _unsafe_calls(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(root))
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [
                f"{where}: imports {n}"
                for n in names
                if n
                and n.split(".")[0] in UNSAFE_MODULES
                and not (n == "pickle" and rel in RESTRICTED_UNPICKLERS)
            ]
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        true = _true_keywords(node)
        if func in ("pickle.load", "pickle.loads"):
            found.append(f"{where}: {func}()")
        if func in ("eval", "exec", "os.system", "os.popen", "yaml.unsafe_load", "yaml.full_load"):
            found.append(f"{where}: {func}()")
        if func == "yaml.load" and "SafeLoader" not in ast.unparse(node):
            found.append(f"{where}: yaml.load without SafeLoader")
        if true("shell"):
            found.append(f"{where}: {func}(shell=True)")
        if func.endswith("load") and true("allow_pickle"):
            found.append(f"{where}: {func}(allow_pickle=True)")
        if func.endswith("safe_globals") and rel not in TORCH_LOAD_ALLOWED:
            found.append(f"{where}: {func} widens the weights_only allow-list")
        if func == "torch.load" and (rel not in TORCH_LOAD_ALLOWED or not true("weights_only")):
            found.append(f"{where}: torch.load outside the allow-list or without weights_only=True")
    return found


def test_no_unsafe_deserialization_in_the_source_tree() -> None:
    files = [
        p
        for p in REPO.rglob("*.py")
        if not any(
            part.startswith(".") or part in {"build", "node_modules"}
            for part in p.relative_to(REPO).parts
        )
    ]
    assert len(files) > 50, "the audit found too few source files"
    problems = [problem for path in files for problem in _unsafe_calls(path)]
    assert not problems, "unsafe deserialization or shell use:\n" + "\n".join(problems)


def test_the_audit_catches_each_pattern(tmp_path: Path) -> None:
    # The sample lives in tmp_path (never in the source tree), audited as if it sat in tests/.
    sample = tmp_path / "tests" / "audit_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import pickle\nimport torch, yaml, subprocess\n"
        "torch.load('x')\ntorch.load('x', weights_only=False)\neval('1')\nexec('1')\n"
        "yaml.load('a')\nsubprocess.run('ls', shell=True)\n"
    )
    problems = _unsafe_calls(sample, root=tmp_path)
    kinds = [
        "imports pickle",
        "torch.load",
        "torch.load",
        "eval()",
        "exec()",
        "yaml.load",
        "shell=True",
    ]
    assert len(problems) == len(kinds), problems
    for kind, problem in zip(kinds, problems, strict=False):
        assert any(kind in p for p in problems), (kind, problem)


def test_ckpt_cli_inspect_and_verify(sources: dict, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    for source in ("v1", "package"):
        assert main(["ckpt", "verify", str(sources[source])]) == 0
        assert main(["ckpt", "inspect", "--json", str(sources[source])]) == 0
        report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
        assert report["signature"] == "unsigned"
        names = {t["name"]: t for t in report["tensors"]}
        assert names["embedding.word.weight"]["shape"] == [VOCAB, 32]
        assert names["embedding.word.weight"]["bytes"] == VOCAB * 32 * 4
    assert main(["ckpt", "inspect", str(sources["v1"])]) == 0
    text = capsys.readouterr().out
    assert re.search(r"step:\s+1\b", text) and "optimizer.safetensors" in text
    root = _copy(sources, LOADERS["v1-load"], tmp_path)
    bad.tampered_byte(V1, root, tmp_path / "m")
    assert main(["ckpt", "verify", str(root)]) == 1
    assert "model.safetensors: sha256 does not match" in capsys.readouterr().err
    index = json.loads((root / "index.json").read_text())
    (root / "index.json").write_text(
        json.dumps({**index, "format": "megalith-sharded-checkpoint", "version": 2})
    )
    assert main(["ckpt", "verify", str(root)]) == 1  # a v1 index relabelled v2: no shards
    assert "index.json" in capsys.readouterr().err
    assert main(["ckpt", "verify", str(sources["v2"])]) == 0
    assert main(["ckpt", "inspect", str(sources["v2"])]) == 0
    assert "model-r00000.safetensors" in capsys.readouterr().out


def _ed25519_pems(directory: Path, name: str) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    private = ed25519.Ed25519PrivateKey.generate()
    private_pem, public_pem = directory / f"{name}.pem", directory / f"{name}.pub.pem"
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
    return private_pem, public_pem


@pytest.mark.parametrize("loader_name", ["v1-load", "package-load"])
def test_ed25519_signatures_verify_with_the_public_key_only(
    sources: dict, tmp_path: Path, loader_name: str, monkeypatch
) -> None:
    from training.checkpoint.signing import ED25519_PRIVATE_ENV, ED25519_PUBLIC_ENV, sign_directory

    loader = LOADERS[loader_name]
    private_pem, public_pem = _ed25519_pems(tmp_path, "signer")
    _, other_public = _ed25519_pems(tmp_path, "other")
    monkeypatch.delenv(KEY_ENV, raising=False)
    root = _copy(sources, loader, tmp_path)
    monkeypatch.setenv(ED25519_PRIVATE_ENV, str(private_pem))
    sign_directory(root, loader.target.manifest)
    assert json.loads((root / "signature.json").read_text())["algorithm"] == "ed25519"
    monkeypatch.delenv(ED25519_PRIVATE_ENV)  # loaders hold only the public key

    with pytest.raises(MegalithError, match=f"{ED25519_PUBLIC_ENV} is not set"):
        loader.load(root, tmp_path / "out", sources, require_signature=True)
    monkeypatch.setenv(ED25519_PUBLIC_ENV, str(public_pem))
    loader.load(root, tmp_path / "out", sources, require_signature=True)
    assert main(["ckpt", "verify", "--require-signature", str(root)]) == 0

    monkeypatch.setenv(ED25519_PUBLIC_ENV, str(other_public))
    with pytest.raises(MegalithError, match=r"Ed25519 signature of .* does not verify"):
        loader.load(root, tmp_path / "out", sources, require_signature=True)
    monkeypatch.setenv(ED25519_PUBLIC_ENV, str(public_pem))
    bad.tampered_byte(loader.target, root, tmp_path / "marker")
    bad.restamp(loader.target, root)
    with pytest.raises(MegalithError, match=r"Ed25519 signature of .* does not verify"):
        loader.load(root, tmp_path / "out", sources)
