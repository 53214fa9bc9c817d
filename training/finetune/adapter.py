"""LoRA adapters saved alone, loaded back onto their base, or merged into a package.

An adapter directory is small (``rank · (in + out)`` values per target layer)::

    adapter.safetensors   the whole (single-device) A and B of every target:
                          ``layers.0.attention.proj.lora.a`` [r, in], ``... .lora.b`` [out, r]
    adapter.json          {"format": "megalith-lora-adapter", "format_version": 1,
                           "lora": LoRAConfig, "model": ModelConfig,
                           "base": {megalith.base.* lineage, content_id included},
                           "weights": {"file": "adapter.safetensors", "sha256": hex}}

Written to a temporary sibling directory renamed into place, with ``signature.json``
over adapter.json when a signing key is set (:mod:`training.checkpoint.signing`). Loading reads
adapter.json once, checks its signature over those bytes (required with
``require_signature``), then the weights' sha256 before reading a tensor, bounds the safetensors header, and checks every name
and shape against the base weights it is put on; an adapter made on other base
weights (another ``content_id``) is refused unless the caller allows it.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from megalith import safe_read
from megalith.config import LoRAConfig, ModelConfig, format_validation_error
from megalith.errors import MegalithError
from megalith.storage import sha256_of_file
from training.checkpoint.safe_tensors import UnsafeTensorFileError, check_safetensors
from training.checkpoint.signing import (
    SignatureError,
    check_signature_bytes,
    read_signature,
    should_sign,
    sign_directory,
)
from training.finetune.lora import (
    adapters_of,
    apply_lora,
    is_adapter_param,
    merge_tensors,
    target_linears,
)

ADAPTER_FORMAT = "megalith-lora-adapter"
FORMAT_VERSION = 1
WEIGHTS_FILE = "adapter.safetensors"
META_FILE = "adapter.json"
MAX_META_BYTES = 1 << 20


class AdapterError(MegalithError):
    """An adapter directory that cannot be used; the message names the file at fault."""


@dataclass
class Adapter:
    lora: LoRAConfig
    model: ModelConfig
    base: dict[str, str]  # the lineage of the base it was trained on
    tensors: dict[str, Tensor]

    @property
    def scale(self) -> float:
        return self.lora.alpha / self.lora.rank


def save_adapter(
    tensors: dict[str, Tensor],
    lora: LoRAConfig,
    model: ModelConfig,
    base: dict[str, str],
    out_dir: str | Path,
    sign: bool | None = None,
) -> Path:
    """Write whole adapter tensors (single-device names) and their JSON record; ``sign``
    as ``checkpoint.sign`` (None: when a signing key is set)."""
    out_dir = Path(out_dir)
    bad = [name for name in tensors if not is_adapter_param(name)]
    if bad:
        raise AdapterError(f"not adapter tensors: {bad[:5]}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weights = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        meta = {
            "format": ADAPTER_FORMAT,
            "format_version": FORMAT_VERSION,
            "lora": lora.model_dump(mode="json"),
            "model": model.model_dump(mode="json"),
            "base": dict(base),
            "weights": {"file": WEIGHTS_FILE, "sha256": sha256_of_file(str(tmp / WEIGHTS_FILE))},
        }
        text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
        (tmp / META_FILE).write_text(text, encoding="utf-8")
        if should_sign(sign):
            sign_directory(tmp, META_FILE)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_adapter(adapter_dir: str | Path, require_signature: bool = False) -> Adapter:
    """Read and verify an adapter directory (signature and sha256 first, then a bounded
    header)."""
    adapter_dir = Path(adapter_dir)
    meta = _read_meta(adapter_dir / META_FILE, require_signature)
    weights = _plain_file(adapter_dir / WEIGHTS_FILE)
    actual = sha256_of_file(str(weights))
    if actual != meta["weights"].get("sha256"):
        raise AdapterError(
            f"{weights}: sha256 {actual} does not match {meta['weights'].get('sha256')} in "
            f"{META_FILE}; the file was changed or damaged"
        )
    try:
        check_safetensors(weights)
        tensors = load_file(str(weights))
    except (UnsafeTensorFileError, OSError, ValueError) as exc:
        raise AdapterError(f"{weights}: cannot read tensors: {exc}") from None
    where = adapter_dir / META_FILE
    try:
        lora = LoRAConfig.model_validate(meta["lora"])
        model = ModelConfig.model_validate(meta["model"])
    except ValidationError as exc:
        raise AdapterError(format_validation_error(exc, str(where))) from None
    return Adapter(lora, model, dict(meta.get("base") or {}), tensors)


def merge_adapter(
    adapter: Adapter, base_tensors: dict[str, Tensor], base_content_id: str | None = None
) -> dict[str, Tensor]:
    """The base tensors with the adapter folded in (``W + scale · B A``).

    ``base_content_id`` given: refused unless it is the one the adapter was trained on."""
    expected = adapter.base.get("megalith.base.content_id")
    if base_content_id is not None and expected and base_content_id != expected:
        raise AdapterError(
            f"the adapter was trained on base weights {expected[:12]}..., these are "
            f"{base_content_id[:12]}...; merge it onto its own base"
        )
    check_shapes(adapter, base_tensors)
    return merge_tensors({**base_tensors, **adapter.tensors}, adapter.scale)


def check_shapes(adapter: Adapter, base_tensors: dict[str, Tensor]) -> None:
    """Every adapter pair names a base weight and fits it: ``A [r, in]``, ``B [out, r]``."""
    rank = adapter.lora.rank
    modules = {n.rsplit(".lora.", 1)[0] for n in adapter.tensors}
    for module in sorted(modules):
        weight = base_tensors.get(f"{module}.weight")
        a, b = adapter.tensors.get(f"{module}.lora.a"), adapter.tensors.get(f"{module}.lora.b")
        if weight is None or a is None or b is None:
            raise AdapterError(
                f"adapter tensors of {module}: need .lora.a, .lora.b and a base weight"
            )
        out, inp = weight.shape
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise AdapterError(
                f"adapter {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the "
                f"base weight {tuple(weight.shape)} at rank {rank}"
            )


def attach_adapter(model: nn.Module, adapter: Adapter) -> nn.Module:
    """Put the adapter onto a single-device model holding its base weights (in place);
    the model then computes the fine-tuned function without merging."""
    check_shapes(adapter, dict(model.named_parameters()))
    targets = target_linears(model, adapter.lora.target_modules)
    expected = {f"{name}.lora.{factor}" for name in targets for factor in ("a", "b")}
    if expected != set(adapter.tensors):
        raise AdapterError(
            f"adapter tensors do not match its target_modules on this model: "
            f"{sorted(expected ^ set(adapter.tensors))[:5]}"
        )
    apply_lora(model, adapter.lora, seed=0)
    with torch.no_grad():
        for name, module in adapters_of(model).items():
            module.a.copy_(adapter.tensors[f"{name}.lora.a"])
            module.b.copy_(adapter.tensors[f"{name}.lora.b"])
    return model


def _read_meta(path: Path, require_signature: bool) -> dict[str, Any]:
    """adapter.json from bytes read once (bounded, a regular file, no link), whose
    signature is checked before they are trusted."""
    try:
        data = safe_read.read_bytes_bounded(path, MAX_META_BYTES, allow_symlink=False)
        check_signature_bytes(
            read_signature(path.parent), META_FILE, data, require_signature,
            str(path.parent / "signature.json"),
        )  # fmt: skip
        meta = safe_read.loads_json(data, str(path))
    except FileNotFoundError:
        raise AdapterError(f"{path}: missing or not a plain file") from None
    except (safe_read.UnsafeFileError, SignatureError) as exc:
        raise AdapterError(str(exc)) from None
    if not isinstance(meta, dict) or meta.get("format") != ADAPTER_FORMAT:
        raise AdapterError(f"{path}: not a {ADAPTER_FORMAT} record")
    if meta.get("format_version") != FORMAT_VERSION:
        raise AdapterError(
            f"{path}: format_version {meta.get('format_version')!r}; this version reads "
            f"{FORMAT_VERSION}"
        )
    if not isinstance(meta.get("weights"), dict) or not isinstance(meta.get("lora"), dict):
        raise AdapterError(f"{path}: expected 'weights' and 'lora' sections")
    return meta


def _plain_file(path: Path) -> Path:
    if path.is_symlink() or not path.is_file():
        raise AdapterError(f"{path}: missing or not a plain file")
    return path


__all__ = [
    "Adapter",
    "AdapterError",
    "attach_adapter",
    "check_shapes",
    "load_adapter",
    "merge_adapter",
    "save_adapter",
]
