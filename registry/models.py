"""The model registry: model packages as versions of MLflow registered models.

A model package (``training.models.package``) is a directory of
``model.safetensors``, ``config.json``, ``tokenizer.model`` and ``checksums.json``
(``{"files": {name: sha256}}`` for every other file).
Registering uploads it as the run's artifacts under ``model/``, beside an
``MLmodel`` file, and creates a registered model version from there. Loading back
downloads the files and checks them against ``checksums.json``; nothing from the
artifact is ever unpickled or imported.

The sha256 of the MLflow files written beside the package (``MLmodel``,
``python_env.yaml``, ``requirements.txt``), as uploaded, and of ``checksums.json`` are
tags of the version in the registry, so loading a version refuses any of them changed
in the artifact store after registration (a swapped loader module included).

The ``MLmodel`` names a pyfunc ``loader_module`` from our installed package
(``deploy.mlflow_pyfunc``) rather than pickled Python, so that
``mlflow models serve --env-manager local`` can serve a version once that module
exists: MLflow calls ``_load_pyfunc(<model dir>)`` (or ``(dir, model_config)``) on it.

Aliases (``candidate``, ``champion``) mark versions; stages are deprecated in MLflow.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from megalith import safe_read
from megalith.errors import MegalithError
from registry.tracking import ensure_tracking_store, flatten_params

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

MODEL_ARTIFACT_PATH = "model"
CHECKSUMS_FILE = "checksums.json"
LOADER_MODULE = "deploy.mlflow_pyfunc"
# Files MLflow needs beside the package; not covered by checksums.json but by the tag below.
MLFLOW_FILES = frozenset({"MLmodel", "python_env.yaml", "requirements.txt"})
CHECKSUMS_TAG = "megalith.package.checksums_sha256"
MLFLOW_FILES_TAG = "megalith.package.mlflow_files_sha256"  # JSON {file name: sha256}
SERVING_REQUIREMENTS = ("mlflow", "torch", "safetensors", "sentencepiece", "numpy", "pydantic")

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))/?$")
_HASH_CHUNK = 8 << 20
_MAX_JSON_BYTES = 1 << 20  # a package's config.json and checksums.json are a few KB


class RegistryError(MegalithError):
    """A registry request that cannot be met: unknown model or alias, or bad files."""


# --- Registering ----------------------------------------------------------------------


def register_model(
    package_dir: str | Path,
    name: str,
    run_id: str,
    eval_metrics: Mapping[str, Any],
    alias: str | None = "candidate",
    *,
    tags: Mapping[str, str] | None = None,
    tracking_uri: str | None = None,
) -> int:
    """Register a model package as a new version of ``name`` and point ``alias`` at it.

    ``run_id`` is the training run: the package is uploaded as its artifacts.

    The version is tagged with the eval metrics (``eval.<metric>``), the run's
    lineage tags (``megalith.*``) and the sha256 of its ``checksums.json``. Returns
    the new version number.
    """
    package = Path(package_dir)
    verify_package(package)
    client = _client(tracking_uri)
    run = client.get_run(run_id)
    _upload_package(client, run, package)
    _ensure_registered_model(client, name)
    version_tags = _version_tags(run, package, eval_metrics, tags or {})
    version_tags[MLFLOW_FILES_TAG] = json.dumps(_uploaded_mlflow_digests(client, run_id))
    version = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri}/{MODEL_ARTIFACT_PATH}",
        run_id=run_id,
        tags=version_tags,
    )
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return int(version.version)


def _upload_package(client: MlflowClient, run: Run, package: Path) -> None:
    """Upload the package under ``model/``; checksums.json goes last and marks it complete.

    A retry after a partial upload starts over; a run that already holds a
    different complete package is refused rather than overwritten, since an
    earlier version may point at it.
    """
    uploaded = _uploaded_checksums(client, run.info.run_id)
    local = (package / CHECKSUMS_FILE).read_bytes()
    if uploaded == local:
        return
    if uploaded is not None:
        raise RegistryError(
            f"run {run.info.run_id} already holds a different model under "
            f"{MODEL_ARTIFACT_PATH}/; register this package from its own run"
        )
    for relative in sorted(_expected_digests(package)):
        parent = Path(MODEL_ARTIFACT_PATH, relative).parent.as_posix()
        client.log_artifact(run.info.run_id, str(package / relative), parent)
    with tempfile.TemporaryDirectory(prefix="megalith-mlmodel-") as staging:
        write_mlmodel(Path(staging), run.info.run_id)
        client.log_artifacts(run.info.run_id, staging, MODEL_ARTIFACT_PATH)
    client.log_artifact(run.info.run_id, str(package / CHECKSUMS_FILE), MODEL_ARTIFACT_PATH)


def _uploaded_checksums(client: MlflowClient, run_id: str) -> bytes | None:
    names = {Path(item.path).name for item in client.list_artifacts(run_id, MODEL_ARTIFACT_PATH)}
    if CHECKSUMS_FILE not in names:
        return None
    with tempfile.TemporaryDirectory(prefix="megalith-checksums-") as tmp:
        path = client.download_artifacts(run_id, f"{MODEL_ARTIFACT_PATH}/{CHECKSUMS_FILE}", tmp)
        return Path(path).read_bytes()


def _uploaded_mlflow_digests(client: MlflowClient, run_id: str) -> dict[str, str]:
    """sha256 of each MLflow file as the artifact store holds it (this upload's or a retried one's)."""
    with tempfile.TemporaryDirectory(prefix="megalith-mlmodel-") as tmp:
        digests = {}
        for name in sorted(MLFLOW_FILES):
            path = client.download_artifacts(run_id, f"{MODEL_ARTIFACT_PATH}/{name}", tmp)
            digests[name] = _sha256(Path(path))
        return digests


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def _version_tags(
    run: Run, package: Path, eval_metrics: Mapping[str, Any], extra: Mapping[str, str]
) -> dict[str, str]:
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("megalith.")}
    tokenizer_id = _package_tokenizer_id(package)
    if tokenizer_id:  # what the model actually uses, whatever the run was told
        tags["megalith.tokenizer.id"] = tokenizer_id
    tags.update({f"eval.{k}": v for k, v in flatten_params(eval_metrics).items()})
    tags[CHECKSUMS_TAG] = _sha256(package / CHECKSUMS_FILE)
    tags.update(extra)
    return tags


def _package_tokenizer_id(package: Path) -> str | None:
    try:
        config = safe_read.read_json(
            package / "config.json", _MAX_JSON_BYTES, allow_symlink=False, expect=dict
        )
    except (OSError, safe_read.UnsafeFileError):
        return None
    tokenizer = config.get("tokenizer")
    identity = tokenizer.get("id") if isinstance(tokenizer, dict) else None
    return identity if isinstance(identity, str) else None


def write_mlmodel(directory: Path, run_id: str | None = None) -> Path:
    """Write ``MLmodel`` (+ environment files) that serve the package via our loader module."""
    import mlflow
    from mlflow.models import Model
    from mlflow.pyfunc import add_to_model

    model = Model(artifact_path=MODEL_ARTIFACT_PATH, run_id=run_id)
    add_to_model(model, loader_module=LOADER_MODULE, python_env="python_env.yaml")
    from deploy.mlflow_pyfunc import params_signature

    model.signature = params_signature()  # so MLflow passes max_tokens etc. to predict
    model.metadata = {"format": "megalith-model-package", "checksums": CHECKSUMS_FILE}
    model.save(str(directory / "MLmodel"))
    python_env = {
        "python": platform.python_version(),
        "build_dependencies": ["pip"],
        "dependencies": ["-r requirements.txt"],
    }
    (directory / "python_env.yaml").write_text(yaml.safe_dump(python_env, sort_keys=False))
    requirements = [f"mlflow=={mlflow.__version__}"] + [
        _pinned(name) for name in SERVING_REQUIREMENTS[1:]
    ]
    note = "# The loader module comes from the megalith package: serve with --env-manager local.\n"
    (directory / "requirements.txt").write_text(note + "\n".join(requirements) + "\n")
    return directory / "MLmodel"


def _pinned(distribution: str) -> str:
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return distribution
    return f"{distribution}=={version.split('+')[0]}"  # torch's "+cpu" is not on PyPI


# --- Loading back ---------------------------------------------------------------------


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
    client = _client(tracking_uri)
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
    verify_package(package, allowed_extra=MLFLOW_FILES)
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
        if _sha256(path) != digest:
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
    expected = _expected_digests(root)
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
        if _sha256(path) != digest:
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
        or pyfunc.get("loader_module") != LOADER_MODULE
        or unsafe
    ):
        raise RegistryError(
            f"{path}: expected only a python_function flavor loaded by {LOADER_MODULE}, "
            f"found flavors {sorted(flavors)} and loader {pyfunc.get('loader_module')!r}"
        )


def _expected_digests(root: Path) -> dict[str, str]:
    """``{file name: sha256}`` from checksums.json (``{"files": {name: sha256}}``)."""
    path = root / CHECKSUMS_FILE
    try:
        data = safe_read.read_json(path, _MAX_JSON_BYTES, allow_symlink=False)
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- Aliases and tags -----------------------------------------------------------------


def get_alias_version(name: str, alias: str, *, tracking_uri: str | None = None) -> int | None:
    """The version ``alias`` points at, or None if the model or alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return int(_client(tracking_uri).get_model_version_by_alias(name, alias).version)
    except MlflowException as error:
        # An unknown model is RESOURCE_DOES_NOT_EXIST; an unknown alias INVALID_PARAMETER_VALUE.
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def set_alias(name: str, alias: str, version: int, *, tracking_uri: str | None = None) -> None:
    """Point ``alias`` at ``version`` (moving it from any other version)."""
    _client(tracking_uri).set_registered_model_alias(name, alias, str(version))


def model_version_tags(
    name: str, version: int, *, tracking_uri: str | None = None
) -> dict[str, str]:
    return dict(_client(tracking_uri).get_model_version(name, str(version)).tags)


def _client(tracking_uri: str | None) -> MlflowClient:
    """A client for ``tracking_uri``, else ``MLFLOW_TRACKING_URI``/MLflow's default."""
    import mlflow
    from mlflow import MlflowClient

    uri = tracking_uri or mlflow.get_tracking_uri()
    ensure_tracking_store(uri)
    return MlflowClient(tracking_uri=uri)
