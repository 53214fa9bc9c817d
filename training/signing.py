"""Optional signing of checkpoints and model packages: HMAC-SHA256 over the manifest.

Every directory Megalith writes has one manifest that holds the sha256 of every other
file (``index.json`` for checkpoints, ``checksums.json`` for model packages) and
loaders check each file against it. Signing the manifest's bytes therefore covers
every byte of the directory: changing a tensor changes its sha256, which must then be
changed in the manifest, which breaks the signature.

The key is a shared secret from the environment (``MEGALITH_SIGNING_KEY``, at least 32
bytes), so whoever can sign can also verify. The signature lives beside the manifest
in ``signature.json``::

    {"algorithm": "hmac-sha256", "manifest": "index.json",
     "manifest_sha256": "...", "signature": "<hex>"}

The MAC is computed over ``"megalith-signature-v1\\0" + manifest name + "\\0" +
manifest bytes``, so a signature for one kind of manifest cannot be replayed as
another. Loaders call :func:`check_signature`; with ``required=True`` an unsigned or
wrongly signed directory is refused, and a signature that is present is always
checked when the key is available.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from preprocessing.storage import atomic_write_json
from training.errors import MegalithError

KEY_ENV = "MEGALITH_SIGNING_KEY"
MIN_KEY_BYTES = 32
SIGNATURE_FILE = "signature.json"
ALGORITHM = "hmac-sha256"
MAX_MANIFEST_BYTES = 256 << 20  # an index of a very large sharded checkpoint stays far below
_DOMAIN = b"megalith-signature-v1\0"


class SignatureError(MegalithError):
    """A signature that is missing (when required), malformed or does not match."""


def signing_key(required: bool = True) -> bytes | None:
    """The key from ``MEGALITH_SIGNING_KEY``; None when unset and not ``required``."""
    value = os.environ.get(KEY_ENV)
    if not value:
        if required:
            raise SignatureError(
                f"{KEY_ENV} is not set: signing and checking signatures need a secret key "
                f"of at least {MIN_KEY_BYTES} bytes in that environment variable"
            )
        return None
    key = value.encode("utf-8")
    if len(key) < MIN_KEY_BYTES:
        raise SignatureError(
            f"{KEY_ENV} holds {len(key)} bytes; a signing key needs at least {MIN_KEY_BYTES} "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return key


def should_sign(sign: bool | None) -> bool:
    """``checkpoint.sign``: True signs (and needs the key), False never, None when the key is set."""
    return bool(os.environ.get(KEY_ENV)) if sign is None else sign


def _mac(key: bytes, manifest_name: str, data: bytes) -> str:
    message = _DOMAIN + manifest_name.encode("utf-8") + b"\0" + data
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _read_manifest(directory: Path, manifest_name: str) -> bytes:
    path = directory / manifest_name
    if path.is_symlink() or not path.is_file():
        raise SignatureError(f"{path}: the manifest to sign is missing or not a plain file")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise SignatureError(f"{path}: {path.stat().st_size} bytes is too large for a manifest")
    return path.read_bytes()


def sign_directory(directory: str | Path, manifest_name: str, key: bytes | None = None) -> Path:
    """Write ``signature.json`` for ``directory/manifest_name`` (atomically); returns its path."""
    directory = Path(directory)
    key = key or signing_key(required=True)
    data = _read_manifest(directory, manifest_name)
    record = {
        "algorithm": ALGORITHM,
        "manifest": manifest_name,
        "manifest_sha256": hashlib.sha256(data).hexdigest(),
        "signature": _mac(key, manifest_name, data),
    }
    path = directory / SIGNATURE_FILE
    atomic_write_json(str(path), record)
    return path


def signature_status(directory: str | Path, manifest_name: str) -> str:
    """One word for ``ckpt inspect``: ``unsigned``, ``valid``, ``INVALID: ...`` or
    ``signed (not verified: no key)``."""
    directory = Path(directory)
    if not (directory / SIGNATURE_FILE).exists():
        return "unsigned"
    try:
        key = signing_key(required=False)
        if key is None:
            return f"signed (not verified: {KEY_ENV} is not set)"
        check_signature(directory, manifest_name, required=True)
    except SignatureError as exc:
        return f"INVALID: {exc}"
    return "valid"


def check_signature(directory: str | Path, manifest_name: str, required: bool) -> bool:
    """Check ``directory``'s signature over ``manifest_name``; returns whether one was verified.

    ``required``: refuse a directory without a valid signature (and refuse when the key is
    not set). Not required: an unsigned directory passes; a signature that is present is
    checked whenever the key is set, so a tampered signed checkpoint never loads quietly.
    Call this before trusting the manifest's sha256 values.
    """
    directory = Path(directory)
    sig_path = directory / SIGNATURE_FILE
    if not sig_path.exists() and not sig_path.is_symlink():
        if required:
            raise SignatureError(
                f"{directory}: unsigned ({SIGNATURE_FILE} is missing) and signatures are "
                "required (checkpoint.require_signature / --require-signature)"
            )
        return False
    key = signing_key(required=required)
    if key is None:
        return False
    record = _read_signature(sig_path)
    if record["manifest"] != manifest_name:
        raise SignatureError(
            f"{sig_path}: signs {record['manifest']!r}, expected a signature of {manifest_name!r}"
        )
    data = _read_manifest(directory, manifest_name)
    if not hmac.compare_digest(record["signature"], _mac(key, manifest_name, data)):
        raise SignatureError(
            f"{sig_path}: the HMAC-SHA256 signature of {manifest_name} does not match "
            f"(the manifest was changed after signing, or it was signed with another key)"
        )
    return True


def _read_signature(path: Path) -> dict[str, Any]:
    if path.is_symlink() or not path.is_file() or path.stat().st_size > 64 << 10:
        raise SignatureError(f"{path}: not a plain signature file of at most 64 KiB")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SignatureError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM:
        raise SignatureError(
            f"{path}: algorithm {record.get('algorithm') if isinstance(record, dict) else None!r}"
            f" is not supported (only {ALGORITHM!r})"
        )
    for field in ("manifest", "signature"):
        if not isinstance(record.get(field), str):
            raise SignatureError(f"{path}: field {field!r} must be a string")
    return record
