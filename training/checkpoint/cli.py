"""``megalith ckpt inspect|verify PATH``: what a checkpoint or model package holds, and
whether every byte of it is sound.

A directory is recognised by its manifest: ``index.json`` (a training checkpoint; its
``format``/``version`` pick the verifier, :func:`verifier`) or ``checksums.json`` +
``config.json`` (a model package). ``verify`` runs every check the loaders run
(signature, sha256 of every file, names that cannot escape the directory, bounded
safetensors headers matching the index or the model) without reading any tensor, and
exits 1 with the reason on the first defect. ``inspect`` only reads JSON and headers.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megalith import safe_read
from megalith.errors import MegalithError
from training.checkpoint.safe_tensors import ITEMSIZE, TORCH_NAMES, check_safetensors
from training.checkpoint.signing import check_signature, signature_status

INDEX = "index.json"
CHECKSUMS = "checksums.json"
SIGNATURE = "signature.json"
MAX_MANIFEST_BYTES = 256 << 20
# The index formats :func:`verifiers` knows, as ``(format, version)``.
FORMATS = [("megalith-checkpoint", 1), ("megalith-sharded-checkpoint", 2)]
_ITEMSIZE = {TORCH_NAMES[k]: v for k, v in ITEMSIZE.items()}


class UnknownCheckpointError(MegalithError):
    """A directory that is neither a known checkpoint nor a model package."""


class UnlistedFileError(MegalithError):
    """A checkpoint or package folder holding files its manifest does not list."""


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    ckpt = subcommands.add_parser(
        "ckpt",
        help="inspect, verify or convert checkpoints and model packages",
        description="Inspect, verify or convert a training checkpoint (step directory with index.json) "
        "or a model package (checksums.json). Nothing is unpickled; no tensor is read.",
    )
    ckpt.set_defaults(group_parser=ckpt)
    commands = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="format, step, layout, tensors, files and signature status",
        description="Print what PATH holds: format, step, layout, every tensor (shape, dtype, "
        "bytes), every file (bytes, sha256) and the signature status. Reads only JSON and "
        "safetensors headers; use `verify` to check the bytes.",
    )
    inspect.add_argument("path", metavar="PATH", help="checkpoint step directory or package")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_inspect)
    verify = commands.add_parser(
        "verify",
        help="check every file; exit 0 when sound, 1 with the reason otherwise",
        description="Run every check a loader runs, without loading: the signature (in the "
        "scheme of the key this process holds: MEGALITH_ED25519_PUBLIC_KEY, which also requires "
        "one, or MEGALITH_SIGNING_KEY; required with --require-signature or "
        "MEGALITH_REQUIRE_SIGNATURE=1), every file's size and sha256 against the manifest, file "
        "names inside the directory, no symlinks and no file the manifest does not list, the "
        "step against the step-N folder's name, safetensors headers bounded and matching the "
        "index (checkpoints) or the model in config.json (packages).",
    )
    verify.add_argument("path", metavar="PATH", help="checkpoint step directory or package")
    verify.add_argument(
        "--require-signature",
        action="store_true",
        help="refuse an unsigned or wrongly signed PATH (needs MEGALITH_SIGNING_KEY or "
        "MEGALITH_ED25519_PUBLIC_KEY)",
    )
    verify.set_defaults(handler=_verify)
    convert = commands.add_parser(
        "convert",
        help="write any checkpoint as one consolidated file set (loads into any layout)",
        description="Read SRC (a checkpoint step directory: v2 in any layout, or v1) with "
        "every check a loader runs, and write it under OUT as a consolidated v2 checkpoint: "
        "one model file and one optimizer file of whole tensors plus state.json, committed "
        "like a training save (signed when MEGALITH_SIGNING_KEY is set). Training resumes "
        "from it in any layout (--set checkpoint.directory=OUT --resume), which is also how "
        "a consolidated checkpoint is split into a layout.",
    )
    convert.add_argument("source", metavar="SRC", help="checkpoint step directory")
    convert.add_argument("out", metavar="OUT", help="checkpoints directory to write into")
    convert.add_argument(
        "--require-signature",
        action="store_true",
        help="refuse an unsigned or wrongly signed SRC (needs MEGALITH_SIGNING_KEY)",
    )
    convert.set_defaults(handler=_convert)


# --------------------------------------------------------------------------- detection


def detect(path: Path) -> tuple[str, dict[str, Any]]:
    """``("checkpoint", index)`` or ``("package", checksums)``, from the manifest's JSON."""
    if not path.is_dir():
        raise UnknownCheckpointError(f"{path} is not a directory")
    for name, kind in ((INDEX, "checkpoint"), (CHECKSUMS, "package")):
        manifest = path / name
        if manifest.exists() or manifest.is_symlink():
            try:
                return kind, safe_read.read_json(manifest, MAX_MANIFEST_BYTES, allow_symlink=False)
            except safe_read.UnsafeFileError as exc:
                raise UnknownCheckpointError(str(exc)) from None
    raise UnknownCheckpointError(
        f"{path}: neither a checkpoint ({INDEX}) nor a model package ({CHECKSUMS})"
    )


def verifier(path: Path, index: Any) -> Callable[..., dict[str, Any]]:
    """The verifier for this index's format and version: ``verify(path,
    require_signature) -> index``, every check short of reading tensors."""
    key = (index.get("format"), index.get("version")) if isinstance(index, dict) else None
    if key not in FORMATS:
        raise UnknownCheckpointError(
            f"{path / INDEX}: format {safe_read.brief(key)} is not one of {FORMATS}"
        )
    # Imported here: they load torch, which `megalith --help` should not wait for.
    from training.checkpoint.format import verify_checkpoint
    from training.checkpoint.sharded_reader import verify_sharded_checkpoint

    if key == FORMATS[0]:
        return verify_checkpoint
    return lambda path, require_signature=False: verify_sharded_checkpoint(
        path, require_signature=require_signature
    )


def _check_tables(path: Path, index: Any) -> None:
    """The index's tables are of the shapes its format reads (no file is checked): what
    ``inspect`` describes without verifying."""
    verifier(path, index)  # a known format and version
    from training.checkpoint.format import check_index_tables
    from training.checkpoint.sharded_index import check_index

    if index["version"] == 1:
        check_index_tables(index, path / INDEX)
    else:
        check_index(index, str(path / INDEX))


# --------------------------------------------------------------------------- verify


def verify(path: str | Path, require_signature: bool = False) -> str:
    """Every check short of reading tensors; returns a one-line summary or raises."""
    from training.checkpoint.format import TENSOR_FILES, check_tensor_file
    from training.models.package import verify_model_package, verify_package_weights

    path = Path(path)
    kind, manifest = detect(path)
    if kind == "package":
        meta = verify_model_package(path, require_signature=require_signature)
        verify_package_weights(path, meta)
        files = len(manifest.get("files", {}))
    else:
        index = verifier(path, manifest)(path, require_signature=require_signature)
        if index.get("version") == 1:  # v2's verifier checks its own shard headers
            for name in TENSOR_FILES:
                check_tensor_file(path / name, index)
        files = len(index["files"])
    listed = manifest.get("files", {}) if kind == "package" else index["files"]
    check_nothing_unlisted(path, set(listed) | {INDEX if kind == "checkpoint" else CHECKSUMS})
    signed = check_signature(path, INDEX if kind == "checkpoint" else CHECKSUMS, False)
    return f"{path}: sound ({kind}, {files} files checked{', signature valid' if signed else ''})"


def check_nothing_unlisted(path: Path, listed: set[str]) -> None:
    """Every entry of the folder is a file its manifest lists (or the signature): a stray
    file is not covered by any hash or signature, and a tool that reads the folder by
    name (Megatron's loaders unpickle ``model_optim_rng.pt``) would trust it."""
    stray = sorted(entry.name for entry in path.iterdir() if entry.name not in listed | {SIGNATURE})
    if stray:
        raise UnlistedFileError(
            f"{path}: holds {len(stray)} file(s) its manifest does not list: "
            f"{', '.join(stray[:10])}{' ...' if len(stray) > 10 else ''}; no hash or signature "
            "covers them and a tool reading this folder could load them (a stray "
            "model_optim_rng.pt is unpickled by Megatron's loaders): remove them"
        )


def _verify(args: argparse.Namespace) -> int:
    print(verify(args.path, require_signature=args.require_signature))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from training.checkpoint.convert import consolidate

    written = consolidate(args.source, args.out, require_signature=args.require_signature)
    print(f"{args.source} -> {written}")
    return 0


# --------------------------------------------------------------------------- inspect


def inspect(path: str | Path) -> dict[str, Any]:
    """A description of ``path`` from its JSON and safetensors headers (not verified)."""
    path = Path(path)
    kind, manifest = detect(path)
    if kind == "package":
        return _inspect_package(path, manifest)
    return _inspect_checkpoint(path, manifest)


def _tensor_row(name: str, shape: list[int], dtype: str, **extra: Any) -> dict[str, Any]:
    size = math.prod(shape) * _ITEMSIZE.get(dtype, 0)
    return {"name": name, "shape": shape, "dtype": dtype, "bytes": size, **extra}


def _inspect_checkpoint(path: Path, index: Any) -> dict[str, Any]:
    _check_tables(path, index)
    files = index.get("files") or {}
    tensors = []
    if index.get("version") == 2:
        for name, meta in index["tensors"].items():
            shards = len(meta.get("shards", []))
            tensors.append(_tensor_row(name, meta["shape"], meta["dtype"], shards=shards))
        step, layout = index.get("step"), index.get("layout")
    else:
        for file, content in index["tensors"].items():
            for name, meta in content.items():
                tensors.append(_tensor_row(name, meta["shape"], meta["dtype"], file=file))
        step, layout = _v1_step(path), "whole tensors, written by rank 0"
    return {
        "path": str(path),
        "kind": "checkpoint",
        "format": index.get("format"),
        "version": index.get("version"),
        "step": step,
        "layout": layout,
        "signature": signature_status(path, INDEX),
        "files": [{"name": n, **m} for n, m in files.items()],
        "tensors": tensors,
    }


def _v1_step(path: Path) -> int | None:
    try:
        state = safe_read.read_json(path / "state.json", 64 << 20, allow_symlink=False)
    except (OSError, safe_read.UnsafeFileError):
        return None
    return state.get("step") if isinstance(state, dict) else None


def _inspect_package(path: Path, checksums: dict[str, Any]) -> dict[str, Any]:
    meta = safe_read.read_json(path / "config.json", 1 << 20, allow_symlink=False, expect=dict)
    header = check_safetensors(path / "model.safetensors")
    files = [
        {"name": n, "bytes": (path / n).stat().st_size, "sha256": sha}
        for n, sha in checksums.get("files", {}).items()
        if (path / n).is_file()
    ]
    return {
        "path": str(path),
        "kind": "package",
        "format": meta.get("format"),
        "version": meta.get("format_version"),
        "step": None,
        "layout": f"one file, {meta.get('dtype')}",
        "model": meta.get("model"),
        "signature": signature_status(path, CHECKSUMS),
        "files": files,
        "tensors": [_tensor_row(n, s, d) for n, (s, d) in header.items()],
    }


def _inspect(args: argparse.Namespace) -> int:
    report = inspect(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    total = sum(t["bytes"] for t in report["tensors"])
    print(f"{report['path']}: {report['format']} version {report['version']} ({report['kind']})")
    print(f"  step:      {report['step']}")
    print(f"  layout:    {report['layout']}")
    print(f"  signature: {report['signature']}")
    print(f"  files ({len(report['files'])}):")
    for f in report["files"]:
        print(f"    {f['name']:<32} {f.get('bytes', '?'):>12} bytes  sha256 {f['sha256'][:16]}…")
    print(f"  tensors ({len(report['tensors'])}, {total} bytes):")
    for t in report["tensors"]:
        where = f"  [{t['file']}]" if "file" in t else ""
        shards = f"  {t['shards']} shards" if "shards" in t else ""
        print(
            f"    {t['name']:<48} {t['dtype']:<9} {t['shape']!s:<16} {t['bytes']:>10}{where}{shards}"
        )
    return 0
