"""Reading a registered model version back: ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``
resolved to a version, downloaded and verified against its ``checksums.json`` and the sha256
tags recorded at registration (``registry.models`` writes them). Training (fine-tuning from a
registered base, ``megalith export``), evaluation and serving load versions through here; the
registry builds on it to register and promote."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from megalith import safe_read
from megalith.errors import MegalithError
from megalith.storage import sha256_of_file
from training.mlflow_store.runs import ensure_tracking_store

if TYPE_CHECKING:
    from mlflow import MlflowClient

MODELS_SCHEME = "models:/"  # a registered model: models:/NAME/VERSION or models:/NAME@ALIAS
CHECKSUMS_FILE = "checksums.json"
LOADER_MODULE = "registry.mlflow_pyfunc"
# Versions registered before the wrapper moved to the registry name this module; megalith
# loads them from their files as before (mlflow models serve needs re-registering them).
FORMER_LOADER_MODULES = frozenset({"deploy.mlflow_pyfunc"})
# Files MLflow needs beside the package; not covered by checksums.json but by the tag below.
MLFLOW_FILES = frozenset({"MLmodel", "python_env.yaml", "requirements.txt"})
# MLflow's own models:/ download writes this (the name and version, never read here) into
# the model's directory: into the artifact store itself when that is a local directory, so
# after an `mlflow.pyfunc.load_model` or `mlflow models serve` it is part of the version.
MLFLOW_WRITTEN = frozenset({"registered_model_meta"})
CHECKSUMS_TAG = "megalith.package.checksums_sha256"
MLFLOW_FILES_TAG = "megalith.package.mlflow_files_sha256"  # JSON {file name: sha256}
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))/?$")
MAX_JSON_BYTES = 1 << 20  # a package's config.json and checksums.json are a few KB


def is_registry_uri(source: str) -> bool:
    return source.startswith(MODELS_SCHEME)


class RegistryError(MegalithError):
    """A registry request that cannot be met: unknown model or alias, or bad files."""


def load_registered_model(
    uri_or_name_alias: str,
    dest_dir: str | Path | None = None,
    *,
    tracking_uri: str | None = None,
) -> Path:
    """Download ``models:/name@alias`` or ``models:/name/version`` and verify it.

    Returns the local package directory (``<dest_dir>/model``; a new temporary
    directory when ``dest_dir`` is None). Raises ``RegistryError`` if a file is
    missing, altered or unexpected.
    """
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    name, version = _resolve(uri_or_name_alias, tracking_uri)
    client = mlflow_client(tracking_uri)
    try:
        source = client.get_model_version_download_uri(name, str(version))
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise RegistryError(f"{uri_or_name_alias}: no such model version") from error
    target = (
        Path(dest_dir) if dest_dir is not None else Path(tempfile.mkdtemp(prefix="megalith-model-"))
    )
    target.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=source, dst_path=str(target), tracking_uri=client.tracking_uri
    )
    package = Path(local)
    verify_package(package, allowed_extra=MLFLOW_FILES | MLFLOW_WRITTEN)
    check_registered_digests(package, client.get_model_version(name, str(version)).tags)
    check_mlmodel(package / "MLmodel")
    return package


def check_registered_digests(package: Path, tags: Mapping[str, str]) -> None:
    """Refuse a downloaded version whose ``checksums.json`` or MLflow files differ from the
    sha256 recorded in the version's tags at registration (versions registered before
    these tags existed are checked by :func:`check_mlmodel` alone)."""
    expected = {}
    if CHECKSUMS_TAG in tags:
        expected[CHECKSUMS_FILE] = tags[CHECKSUMS_TAG]
    if MLFLOW_FILES_TAG in tags:
        try:
            recorded = safe_read.loads_json(tags[MLFLOW_FILES_TAG].encode(), MLFLOW_FILES_TAG)
        except safe_read.UnsafeFileError as error:
            raise RegistryError(str(error)) from None
        if not isinstance(recorded, dict) or set(recorded) != MLFLOW_FILES:
            raise RegistryError(
                f"tag {MLFLOW_FILES_TAG}: expected the sha256 of {sorted(MLFLOW_FILES)}"
            )
        expected.update(recorded)
    for name, digest in sorted(expected.items()):
        path = package / name
        if not path.is_file():
            raise RegistryError(f"{path}: missing from the registered version")
        if sha256_of_file(str(path)) != digest:
            raise RegistryError(
                f"{path}: sha256 differs from the one recorded when the version was registered "
                "(modified in the artifact store)"
            )


def resolve_model_version(uri: str, *, tracking_uri: str | None = None) -> tuple[str, int]:
    """``(name, version)`` that ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` names
    now: pin the version before downloading, so a moving alias cannot change what a
    caller records (fine-tuning lineage) and what it loads."""
    return _resolve(uri, tracking_uri)


def _resolve(uri: str, tracking_uri: str | None) -> tuple[str, int]:
    match = _MODELS_URI.match(uri)
    if match is None:
        raise RegistryError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    name = match["name"]
    if match["version"] is not None:
        return name, int(match["version"])
    version = get_alias_version(name, match["alias"], tracking_uri=tracking_uri)
    if version is None:
        raise RegistryError(f"{uri}: registered model {name!r} has no alias {match['alias']!r}")
    return name, version


def verify_package(directory: str | Path, allowed_extra: frozenset[str] = frozenset()) -> None:
    """Check every file against ``checksums.json``; refuse missing, altered or unlisted files."""
    root = Path(directory)
    expected = listed_digests(root)
    links = sorted(p.name for p in root.rglob("*") if p.is_symlink())
    if links:
        raise RegistryError(f"{root}: symbolic links are not allowed in a package: {links}")
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    unexpected = present - set(expected) - {CHECKSUMS_FILE} - allowed_extra
    if unexpected:
        raise RegistryError(f"{root}: files not listed in {CHECKSUMS_FILE}: {sorted(unexpected)}")
    for relative, digest in sorted(expected.items()):
        path = root / relative
        if not path.is_file():
            raise RegistryError(f"{path}: listed in {CHECKSUMS_FILE} but missing")
        if sha256_of_file(str(path)) != digest:
            raise RegistryError(
                f"{path}: sha256 does not match {CHECKSUMS_FILE} (modified or corrupted)"
            )


def check_mlmodel(path: Path) -> None:
    """checksums.json does not cover ``MLmodel``: check that it serves only through our loader."""
    if not path.is_file():
        return  # packages registered before MLmodel was written, or by hand
    try:
        mlmodel = safe_read.read_yaml(path)
    except safe_read.UnsafeFileError as error:
        raise RegistryError(str(error)) from None
    except OSError as error:
        raise RegistryError(f"{path}: cannot read the MLmodel file ({error.strerror})") from None
    flavors = mlmodel.get("flavors") if isinstance(mlmodel, dict) else None
    pyfunc = flavors.get("python_function") if isinstance(flavors, dict) else None
    if not isinstance(pyfunc, dict):
        raise RegistryError(f"{path}: not an MLmodel file (no flavors.python_function mapping)")
    unsafe = set(pyfunc) & {"code", "model_code_path", "cloudpickle_version", "python_model"}
    if (
        set(flavors) != {"python_function"}
        or pyfunc.get("loader_module") not in {LOADER_MODULE, *FORMER_LOADER_MODULES}
        or unsafe
    ):
        raise RegistryError(
            f"{path}: expected only a python_function flavor loaded by {LOADER_MODULE}, "
            f"found flavors {sorted(flavors)} and loader {pyfunc.get('loader_module')!r}"
        )


def listed_digests(root: Path) -> dict[str, str]:
    """``{file name: sha256}`` from checksums.json (``{"files": {name: sha256}}``)."""
    path = root / CHECKSUMS_FILE
    try:
        data = safe_read.read_json(path, MAX_JSON_BYTES, allow_symlink=False)
    except safe_read.UnsafeFileError as error:
        raise RegistryError(str(error)) from None
    except OSError as error:
        raise RegistryError(
            f"{path}: cannot read the package's checksums ({error.strerror})"
        ) from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise RegistryError(f'{path}: expected {{"files": {{name: sha256}}}}')
    for name, digest in files.items():
        if not isinstance(digest, str) or not _is_inside(name):
            raise RegistryError(f"{path}: bad entry {name!r}: {digest!r}")
    return files


def _is_inside(relative: str) -> bool:
    parts = Path(relative).parts
    return bool(parts) and not Path(relative).is_absolute() and ".." not in parts


def get_alias_version(name: str, alias: str, *, tracking_uri: str | None = None) -> int | None:
    """The version ``alias`` points at, or None if the model or alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return int(mlflow_client(tracking_uri).get_model_version_by_alias(name, alias).version)
    except MlflowException as error:
        # An unknown model is RESOURCE_DOES_NOT_EXIST; an unknown alias INVALID_PARAMETER_VALUE.
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def model_version_tags(
    name: str, version: int, *, tracking_uri: str | None = None
) -> dict[str, str]:
    return dict(mlflow_client(tracking_uri).get_model_version(name, str(version)).tags)


def mlflow_client(tracking_uri: str | None) -> MlflowClient:
    """A client for ``tracking_uri``, else ``MLFLOW_TRACKING_URI``/MLflow's default."""
    import mlflow
    from mlflow import MlflowClient

    uri = tracking_uri or mlflow.get_tracking_uri()
    ensure_tracking_store(uri)
    return MlflowClient(tracking_uri=uri)
