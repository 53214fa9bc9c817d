"""A corpus of crafted bad inputs for every loader (used by tests/test_security.py).

Each defect is a function ``defect(target, root, marker) -> regex`` that damages the
freshly written, sound input at ``root`` in place and returns a pattern the loader's
error must match (it names the file and the defect). ``marker`` is a path that must
never come to exist: pickles in the corpus create it when unpickled.

An attacker who supplies an unsigned directory controls every byte of it, manifest
included, so most defects also *restamp* the manifest (recompute every sha256 and
size): the deeper checks must hold on their own, not only the hash comparison.

A :class:`Target` describes one loader's input: where its main tensor file is, its
manifest (None for inputs that have none: HF and Megatron directories), and how to
name an extra file in it. Adding the v2 sharded checkpoint is one more Target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class WritesMarker:
    """Unpickling this object creates ``marker``: proof that a loader ran pickled code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@dataclass
class Target:
    """One loader's input format."""

    name: str
    tensor_file: str  # relative path of the main tensor file
    manifest: str | None  # index.json / checksums.json / None
    add_name: Callable[[Path, str], None]  # make the manifest (or index) name a file
    suffix: str = ".safetensors"
    other_file: str = ""  # a second file of the same directory (swapped with tensor_file)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def restamp(target: Target, root: Path) -> None:
    """Recompute the manifest's sha256 (and sizes) as an attacker would."""
    if target.manifest == "index.json":
        index = json.loads((root / "index.json").read_text())
        for name, entry in index["files"].items():
            path = root / name
            if path.is_file() and not path.is_symlink() and "/" not in name:
                entry.update(sha256=sha256(path), bytes=path.stat().st_size)
        (root / "index.json").write_text(json.dumps(index))
    elif target.manifest == "checksums.json":
        data = json.loads((root / "checksums.json").read_text())
        for name in data["files"]:
            path = root / name
            if path.is_file() and not path.is_symlink() and "/" not in name:
                data["files"][name] = sha256(path)
        (root / "checksums.json").write_text(json.dumps(data))


# --------------------------------------------------------------------------- defects


def pickle_in_tensor_file(target: Target, root: Path, marker: Path) -> str:
    """The main tensor file replaced by a torch.save pickle (whatever its name: .pt,
    .safetensors, pytorch_model.bin), manifest restamped."""
    file = root / target.tensor_file
    torch.save({"weight": WritesMarker(marker)}, file)
    restamp(target, root)
    return "header length field|not valid JSON|weights_only|allow-list"


def pickle_beside(target: Target, root: Path, marker: Path) -> str:
    """A ``model.pt`` pickle listed in the manifest next to the real files: never loaded."""
    torch.save({"weight": WritesMarker(marker)}, root / "model.pt")
    target.add_name(root, "model.pt")
    restamp(target, root)
    return ""  # loads fine; only the marker assertion matters


def tampered_byte(target: Target, root: Path, marker: Path) -> str:
    file = root / target.tensor_file
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x01
    file.write_bytes(bytes(data))
    return rf"{file.name}: sha256 .*(does not match|modified)"


def truncated(target: Target, root: Path, marker: Path) -> str:
    file = root / target.tensor_file
    file.write_bytes(file.read_bytes()[:-64])
    return rf"{file.name}: .*(bytes, index.json says|sha256)"


def truncated_restamped(target: Target, root: Path, marker: Path) -> str:
    truncated(target, root, marker)
    restamp(target, root)
    return rf"{target.tensor_file.rpartition('/')[2]}: .*(outside|cover|too short)"


def swapped_files(target: Target, root: Path, marker: Path) -> str:
    """Two files' names swapped (the main tensor file and another one)."""
    other = {"index.json": "optimizer.safetensors", "checksums.json": "tokenizer.model"}
    a, b = root / target.tensor_file, root / (target.other_file or other[target.manifest])
    tmp = root / "swap.tmp"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return rf"{a.name}: (sha256 .*(does not match|modified)|\d+ bytes, index.json says)"


def swapped_files_restamped(target: Target, root: Path, marker: Path) -> str:
    swapped_files(target, root, marker)
    restamp(target, root)
    return r"tensor names (differ|do not match)|tokenizer id does not match|has no tensor"


def name_outside(kind: str) -> Callable[[Target, Path, Path], str]:
    def defect(target: Target, root: Path, marker: Path) -> str:
        outside = root.parent / "outside.safetensors"
        outside.write_bytes((root / target.tensor_file).read_bytes())
        if kind == "symlink":
            file = root / target.tensor_file
            file.unlink()
            file.symlink_to(outside)
            return rf"{file.name}: .*(symbolic link|not a plain file)"
        name = "../outside.safetensors" if kind == "dotdot" else str(outside)
        target.add_name(root, name)
        return r"not a plain (file )?name"

    defect.__name__ = f"name_outside_{kind}"
    return defect


def huge_header_length(target: Target, root: Path, marker: Path) -> str:
    """The 8-byte header length says 2**62 bytes."""
    file = root / target.tensor_file
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    restamp(target, root)
    return rf"{file.name}: header length field claims {1 << 62} bytes"


def huge_tensor(target: Target, root: Path, marker: Path) -> str:
    """A header whose first tensor claims 64 GiB ([2**24, 2**10] float32)."""
    file = root / target.tensor_file
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name] = {"dtype": "F32", "shape": [1 << 24, 1 << 10], "data_offsets": [0, 1 << 36]}
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    restamp(target, root)
    return rf"{file.name}: tensor .*data_offsets .* outside the file"


def wrong_dtype(target: Target, root: Path, marker: Path) -> str:
    file = root / target.tensor_file
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].double()
    save_file(tensors, file)
    restamp(target, root)
    return rf"{file.name}: .*{name}"


def wrong_shape(target: Target, root: Path, marker: Path) -> str:
    file = root / target.tensor_file
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if tensors[n].dim() == 2)
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, file)
    restamp(target, root)
    return rf"{name}.*(shape|\[)"


def pickle_as_torch_bin(target: Target, root: Path, marker: Path) -> str:
    """HF only: the weights as pytorch_model.bin holding a pickled callable (read with
    --allow-torch-bin, i.e. through weights_only=True, which must refuse it)."""
    (root / target.tensor_file).unlink()
    torch.save({"model.embed_tokens.weight": WritesMarker(marker)}, root / "pytorch_model.bin")
    return r"pytorch_model\.bin: cannot be loaded with weights_only=True"


def tracker_outside(target: Target, root: Path, marker: Path) -> str:
    """Megatron only: the iteration tracker names a path instead of a number."""
    (root / "latest_checkpointed_iteration.txt").write_text("../../etc")
    return r"latest_checkpointed_iteration\.txt: expected an iteration number"


def megatron_wrong_shape(target: Target, root: Path, marker: Path) -> str:
    """Megatron only: a tensor whose shape does not fit args (rewritten with plain tensors)."""
    file = root / target.tensor_file
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(file, weights_only=True)
    state["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(32, 47)
    torch.save(state, file)
    return r"tensor layers\.0\.mlp\.fc2\.weight is \[32, 47\], the config needs \[32, 48\]"


def missing_file(target: Target, root: Path, marker: Path) -> str:
    file = root / target.tensor_file
    file.unlink()
    return rf"{file.name}|no model\.safetensors|no mp_rank"


# --------------------------------------------------------------------------- sound inputs


def megatron_checkpoint(root: Path, vocab: int = 448, layers: int = 1, hidden: int = 32) -> Path:
    """A sound legacy Megatron-LM checkpoint (TP=1, Llama style, random tensors), written
    as Megatron-LM writes it, without needing megatron-core."""
    gen = torch.Generator().manual_seed(0)
    ffn, qkv_rows = 48, hidden + 2 * 2 * (hidden // 4)  # 4 heads, 2 KV groups

    def rand(*shape: int) -> torch.Tensor:
        return 0.02 * torch.randn(*shape, generator=gen)

    model = {"embedding.word_embeddings.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        model[p + "input_layernorm.weight"] = torch.ones(hidden)
        model[p + "self_attention.linear_qkv.weight"] = rand(qkv_rows, hidden)
        model[p + "self_attention.linear_qkv._extra_state"] = None
        model[p + "self_attention.linear_proj.weight"] = rand(hidden, hidden)
        model[p + "pre_mlp_layernorm.weight"] = torch.ones(hidden)
        model[p + "mlp.linear_fc1.weight"] = rand(2 * ffn, hidden)
        model[p + "mlp.linear_fc2.weight"] = rand(hidden, ffn)
    model["decoder.final_layernorm.weight"] = torch.ones(hidden)
    model["output_layer.weight"] = rand(vocab, hidden)
    args = argparse.Namespace(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        ffn_hidden_size=ffn,
        padded_vocab_size=vocab,
        max_position_embeddings=32,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        params_dtype=torch.float32,
    )
    rank_dir = root / "iter_0000007" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    state = {"args": args, "iteration": 7, "checkpoint_version": 3.0, "model": model}
    torch.save(state, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    return root
