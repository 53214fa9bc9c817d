"""Optional signing of checkpoints and model packages: HMAC-SHA256 over the manifest.

Every directory Megalith writes has one manifest that holds the sha256 of every other
file (``index.json`` for checkpoints, ``checksums.json`` for model packages) and
loaders check each file against it. Signing the manifest's bytes therefore covers
every byte of the directory: changing a tensor changes its sha256, which must then be
changed in the manifest, which breaks the signature.

Two algorithms:

- ``hmac-sha256`` (default): a shared secret from ``MEGALITH_SIGNING_KEY`` (at least 32
  bytes), so whoever can verify can also sign;
- ``ed25519`` (through ``cryptography``): signing needs the private key
  (``MEGALITH_ED25519_PRIVATE_KEY``: a PEM file path), verifying only the public key
  (``MEGALITH_ED25519_PUBLIC_KEY``), so loaders never hold a signing secret. When the
  private key is set it is used for signing instead of HMAC.

The signature lives beside the manifest in ``signature.json``::

    {"algorithm": "hmac-sha256" | "ed25519", "manifest": "index.json",
     "manifest_sha256": "...", "signature": "<hex>"}

The MAC is computed over ``"megalith-signature-v1\\0" + manifest name + "\\0" +
manifest bytes``, so a signature for one kind of manifest cannot be replayed as
another. Loaders call :func:`check_signature`; with ``required=True`` an unsigned or
wrongly signed directory is refused, and a signature that is present is always
checked when the key is available.

The scheme is the verifier's, never the file's: whoever holds an Ed25519 public key
(``MEGALITH_ED25519_PUBLIC_KEY``) accepts only Ed25519 signatures, and requires one
(a public key exists only to verify); whoever holds only an HMAC key accepts only
HMAC. A ``signature.json`` that names another algorithm is refused, so an attacker
cannot pick the scheme the verifier has no key for and pass unchecked.

``MEGALITH_REQUIRE_SIGNATURE=1`` requires a valid signature at every loader (training
resume, fine-tuning bases, evaluation, serving, export, ``ckpt``), in addition to the
``checkpoint.require_signature`` / ``--require-signature`` switches.

What a signature vouches for is the manifest's bytes, hence every file's sha256,
hence the checkpoint's identity in them (its step, in ``index.json`` and in the hashed
``state.json``); loaders compare that step with the one they asked for
(:mod:`training.checkpoint.format`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megalith import safe_read
from megalith.errors import MegalithError
from megalith.safe_read import brief
from megalith.storage import atomic_write_json

KEY_ENV = "MEGALITH_SIGNING_KEY"
ED25519_PRIVATE_ENV = "MEGALITH_ED25519_PRIVATE_KEY"
ED25519_PUBLIC_ENV = "MEGALITH_ED25519_PUBLIC_KEY"
REQUIRE_ENV = "MEGALITH_REQUIRE_SIGNATURE"
MIN_KEY_BYTES = 32
SIGNATURE_FILE = "signature.json"
ALGORITHM = "hmac-sha256"
ED25519 = "ed25519"
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
    """``checkpoint.sign``: True signs (and needs a key), False never, None when a signing
    key (HMAC or Ed25519 private) is set."""
    if sign is not None:
        return sign
    return bool(os.environ.get(KEY_ENV) or os.environ.get(ED25519_PRIVATE_ENV))


def _message(manifest_name: str, data: bytes) -> bytes:
    return _DOMAIN + manifest_name.encode("utf-8") + b"\0" + data


def _mac(key: bytes, manifest_name: str, data: bytes) -> str:
    return hmac.new(key, _message(manifest_name, data), hashlib.sha256).hexdigest()


def _ed25519_key(env: str, private: bool, required: bool):
    """The Ed25519 key whose PEM file ``env`` names; None when unset and not required."""
    path = os.environ.get(env)
    if not path:
        if required:
            raise SignatureError(
                f"{env} is not set: Ed25519 signatures need the path of a PEM "
                f"{'private' if private else 'public'} key in that environment variable"
            )
        return None
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    try:
        data = safe_read.read_bytes_bounded(path, 64 << 10)  # a PEM key is < 1 KiB
        key = (
            serialization.load_pem_private_key(data, password=None)
            if private
            else serialization.load_pem_public_key(data)
        )
    except (OSError, ValueError, TypeError, safe_read.UnsafeFileError) as exc:
        raise SignatureError(f"{env}={path}: cannot read a PEM key: {exc}") from None
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise SignatureError(
            f"{env}={path}: not an Ed25519 {'private' if private else 'public'} key"
        )
    return key


def _read_manifest(directory: Path, manifest_name: str) -> bytes:
    path = directory / manifest_name
    if path.is_symlink() or not path.is_file():
        raise SignatureError(f"{path}: the manifest to sign is missing or not a plain file")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise SignatureError(f"{path}: {path.stat().st_size} bytes is too large for a manifest")
    return path.read_bytes()


def signature_record(manifest_name: str, data: bytes, key: bytes | None = None) -> dict[str, str]:
    """The ``signature.json`` content for manifest bytes ``data``: lets a writer that commits
    by writing the manifest last (object stores) write the signature before it.

    Ed25519 when ``MEGALITH_ED25519_PRIVATE_KEY`` is set (and no HMAC ``key`` is passed),
    otherwise HMAC-SHA256 with ``key`` or ``MEGALITH_SIGNING_KEY``.
    """
    private = None if key else _ed25519_key(ED25519_PRIVATE_ENV, private=True, required=False)
    if private is not None:
        algorithm, signature = ED25519, private.sign(_message(manifest_name, data)).hex()
    else:
        key = key or signing_key(required=True)
        algorithm, signature = ALGORITHM, _mac(key, manifest_name, data)
    return {
        "algorithm": algorithm,
        "manifest": manifest_name,
        "manifest_sha256": hashlib.sha256(data).hexdigest(),
        "signature": signature,
    }


def sign_directory(directory: str | Path, manifest_name: str, key: bytes | None = None) -> Path:
    """Write ``signature.json`` for ``directory/manifest_name`` (atomically); returns its path."""
    directory = Path(directory)
    record = signature_record(manifest_name, _read_manifest(directory, manifest_name), key)
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
        if not check_signature(directory, manifest_name, required=False):
            return "signed (not verified: no verification key is set)"
    except SignatureError as exc:
        return f"INVALID: {exc}"
    algorithm = _read_signature(directory / SIGNATURE_FILE)["algorithm"]
    return f"valid ({algorithm})"


def check_signature(directory: str | Path, manifest_name: str, required: bool) -> bool:
    """Check ``directory``'s signature over ``manifest_name``; returns whether one was verified.

    ``required``: refuse a directory without a valid signature (and refuse when the key is
    not set). Not required: an unsigned directory passes (unless an Ed25519 public key or
    ``MEGALITH_REQUIRE_SIGNATURE`` is set); a signature that is present is checked whenever
    a key is set, so a tampered signed checkpoint never loads quietly. Call this before
    trusting the manifest's sha256 values; a caller that parses the manifest should use
    :func:`read_signature` and :func:`check_signature_bytes` on the bytes it parses.
    """
    directory = Path(directory)
    return check_signature_bytes(
        read_signature(directory),
        manifest_name,
        lambda: _read_manifest(directory, manifest_name),
        required,
        str(directory / SIGNATURE_FILE),
    )


def read_signature(directory: str | Path) -> dict[str, Any] | None:
    """``directory``'s ``signature.json``, validated; None when there is none."""
    path = Path(directory) / SIGNATURE_FILE
    if not path.exists() and not path.is_symlink():
        return None
    return _read_signature(path)


def check_signature_bytes(
    record: dict[str, Any] | None,
    manifest_name: str,
    data: bytes | Callable[[], bytes],
    required: bool,
    where: str,
) -> bool:
    """:func:`check_signature` on a parsed ``signature.json`` (None: absent) and the
    manifest's bytes (or a function reading them), for stores that are not local
    directories; ``where`` names the signature in errors."""
    scheme = verifier_scheme()
    required = required or signature_required() or scheme == ED25519
    if record is None:
        if required:
            raise SignatureError(
                f"{where}: unsigned ({SIGNATURE_FILE} is missing) and signatures are "
                f"required (checkpoint.require_signature / --require-signature / {REQUIRE_ENV}"
                f"{' / ' + ED25519_PUBLIC_ENV + ' is set' if scheme == ED25519 else ''})"
            )
        return False
    if record["manifest"] != manifest_name:
        raise SignatureError(
            f"{where}: signs {brief(record['manifest'])}, expected a signature of {manifest_name!r}"
        )
    if scheme is None:
        if required:
            raise SignatureError(
                f"{where}: signatures are required but no verification key is set: "
                f"{ED25519_PUBLIC_ENV} is not set (Ed25519) and {KEY_ENV} is not set (HMAC)"
            )
        return False
    if record["algorithm"] != scheme:
        raise SignatureError(
            f"{where}: signed with {record['algorithm']}, but this verifier holds "
            f"{'an Ed25519 public key' if scheme == ED25519 else 'an HMAC key'} and accepts "
            f"only {scheme} signatures (the scheme is the verifier's, not the file's)"
        )
    if scheme == ED25519:
        _verify_ed25519(record, manifest_name, _bytes(data), where)
        return True
    key = signing_key(required=True)
    if not hmac.compare_digest(record["signature"], _mac(key, manifest_name, _bytes(data))):
        raise SignatureError(
            f"{where}: the HMAC-SHA256 signature of {manifest_name} does not match "
            f"(the manifest was changed after signing, or it was signed with another key)"
        )
    return True


def verifier_scheme() -> str | None:
    """The scheme this process verifies with: ``ed25519`` when a public key is set, else
    ``hmac-sha256`` when an HMAC key is set, else None."""
    if os.environ.get(ED25519_PUBLIC_ENV):
        return ED25519
    if os.environ.get(KEY_ENV):
        return ALGORITHM
    return None


def signature_required() -> bool:
    """``MEGALITH_REQUIRE_SIGNATURE``: 1/true/yes requires a signature at every loader."""
    value = os.environ.get(REQUIRE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise SignatureError(f"{REQUIRE_ENV}={value!r}: expected 1/true/yes or 0/false/no")


def _verify_ed25519(record: dict[str, Any], manifest_name: str, data: bytes, where: str) -> None:
    from cryptography.exceptions import InvalidSignature

    public = _ed25519_key(ED25519_PUBLIC_ENV, private=False, required=True)
    try:
        public.verify(bytes.fromhex(record["signature"]), _message(manifest_name, data))
    except (InvalidSignature, ValueError):
        raise SignatureError(
            f"{where}: the Ed25519 signature of {manifest_name} does not verify with "
            f"{ED25519_PUBLIC_ENV} (the manifest was changed after signing, or another key)"
        ) from None


def _bytes(data: bytes | Callable[[], bytes]) -> bytes:
    return data() if callable(data) else data


def parse_signature(raw: bytes, where: str) -> dict[str, Any]:
    """A ``signature.json``'s content, validated (at most 64 KiB, known algorithm)."""
    if len(raw) > 64 << 10:
        raise SignatureError(f"{where}: not a signature file of at most 64 KiB")
    try:  # bounded nesting: a 64 KiB "[[[[..." is a RecursionError in json.loads
        record = safe_read.loads_json(raw, where)
    except safe_read.UnsafeFileError as exc:
        raise SignatureError(str(exc)) from None
    if not isinstance(record, dict) or record.get("algorithm") not in (ALGORITHM, ED25519):
        raise SignatureError(
            f"{where}: algorithm {brief(record.get('algorithm') if isinstance(record, dict) else None)}"
            f" is not supported (only {ALGORITHM!r} and {ED25519!r})"
        )
    for field in ("manifest", "signature"):
        if not isinstance(record.get(field), str):
            raise SignatureError(f"{where}: field {field!r} must be a string")
    length = 64 if record["algorithm"] == ALGORITHM else 128  # HMAC-SHA256, Ed25519
    if len(record["signature"]) != length or not all(
        c in "0123456789abcdef" for c in record["signature"]
    ):
        raise SignatureError(f"{where}: 'signature' must be {length} lowercase hex digits")
    return record


def _read_signature(path: Path) -> dict[str, Any]:
    if path.is_symlink() or not path.is_file() or path.stat().st_size > 64 << 10:
        raise SignatureError(f"{path}: not a plain signature file of at most 64 KiB")
    return parse_signature(path.read_bytes(), str(path))
