"""The model registry: model packages as versions of MLflow registered models.

A model package (``training.models.package``) is a directory of
``model.safetensors``, ``config.json``, ``tokenizer.model`` (or ``tokenizer.json``) and
``checksums.json`` (``{"files": {name: sha256}}`` for every other file).
Registering uploads it as the run's artifacts under ``model/``, beside an
``MLmodel`` file, and creates a registered model version from there. Loading back
downloads the files and checks them against ``checksums.json``; nothing from the
artifact is ever unpickled or imported.

The sha256 of the MLflow files written beside the package (``MLmodel``,
``python_env.yaml``, ``requirements.txt``), as uploaded, and of ``checksums.json`` are
tags of the version in the registry, so loading a version refuses any of them changed
in the artifact store after registration (a swapped loader module included).

The ``MLmodel`` names a pyfunc ``loader_module`` from our installed package
(``registry.mlflow_pyfunc``) rather than pickled Python, so that
``mlflow models serve --env-manager local`` can serve a version once that module
exists: MLflow calls ``_load_pyfunc(<model dir>)`` (or ``(dir, model_config)``) on it.

Aliases (``candidate``, ``champion``) mark versions; stages are deprecated in MLflow.
"""

from __future__ import annotations

import json
import platform
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from megalith import safe_read
from megalith.storage import sha256_of_file
from training.mlflow_store.registered import (
    CHECKSUMS_FILE,
    CHECKSUMS_TAG,
    LOADER_MODULE,
    MAX_JSON_BYTES,
    MLFLOW_FILES,
    MLFLOW_FILES_TAG,
    RegistryError,
    listed_digests,
    mlflow_client,
    verify_package,
)
from training.mlflow_store.runs import flatten_params

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

MODEL_ARTIFACT_PATH = "model"
SERVING_REQUIREMENTS = (
    "mlflow", "torch", "safetensors", "sentencepiece", "tokenizers", "numpy", "pydantic",
)  # fmt: skip


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
    client = mlflow_client(tracking_uri)
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
    for relative in sorted(listed_digests(package)):
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
            digests[name] = sha256_of_file(str(path))
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
    tags[CHECKSUMS_TAG] = sha256_of_file(str(package / CHECKSUMS_FILE))
    tags.update(extra)
    return tags


def _package_tokenizer_id(package: Path) -> str | None:
    try:
        config = safe_read.read_json(
            package / "config.json", MAX_JSON_BYTES, allow_symlink=False, expect=dict
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
    # The pyfunc module loads models (torch): imported only when an MLmodel is written.
    from registry.mlflow_pyfunc import params_signature

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


# --- Aliases and tags -----------------------------------------------------------------


def set_alias(name: str, alias: str, version: int, *, tracking_uri: str | None = None) -> None:
    """Point ``alias`` at ``version`` (moving it from any other version)."""
    mlflow_client(tracking_uri).set_registered_model_alias(name, alias, str(version))
