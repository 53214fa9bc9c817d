"""The recurring fine-tune: new chat data → fine-tune the champion → evaluate → register → gate.

Served as the ``finetune`` deployment on a cron schedule (``megalith serve-pipelines
--finetune-cron``). Each run:

1. lists the chat ``.jsonl`` files (``.jsonl.gz``, ``.jsonl.zst`` too) under
   ``data_location`` (a directory or an ``s3://`` prefix, through fsspec) and keeps those
   not recorded in ``WORKDIR/finetune-state.json`` with the same size and modification
   time (or ETag): new or changed files. None: the run ends here, marked skipped.
2. resolves ``models:/NAME@champion`` to its version, downloads and verifies it, and
   tokenizes the new files with the champion's tokenizer into chat shards;
3. fine-tunes from that version (``finetune.base``; LoRA or full, as the recipe says);
4. evaluates the fine-tuned model *and the champion* on the same held-out split of the
   new data and the same tasks, so the gate compares like with like;
5. registers the result as ``@candidate`` (lineage: base version, data manifest) and
   runs the promotion gate (``registry.promotion``), which moves ``@champion`` if every
   rule passes;
6. records the files as processed, only now: a failed run leaves them new for the next.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from megalith.config import MegalithConfig, ModelConfig
from megalith.errors import MegalithError
from megalith.storage import atomic_write_bytes
from pipelines.artifacts import (
    publish_evaluation,
    publish_promotion,
    publish_registration,
    publish_training_summary,
)
from pipelines.tasks import evaluate_task, gate_task, pretrain_task, register_task
from pipelines.tokenize import manifest_markdown, write_shards_task
from training.mlflow_store.registered import get_alias_version, load_registered_model
from training.models.package import package_tokenizer_path, read_package_model_config

STATE_FILE = "finetune-state.json"
CHAT_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
EVAL_TASKS = ["sample_facts"]


class FinetuneError(MegalithError):
    """The recurring fine-tune cannot start: no champion, or unreadable state."""


@task(name="find-new-data", cache_policy=NO_CACHE)
def find_new_data(location: str, state_path: str) -> list[dict[str, Any]]:
    """The chat files under ``location`` not yet processed (new, or changed since)."""
    found, new = new_chat_files(location, state_path)
    get_run_logger().info(
        "%d chat file(s) under %s, %d new or changed", len(found), location, len(new)
    )
    return new


def new_chat_files(location: str, state_path: str) -> tuple[list[dict], list[dict]]:
    """Every chat file under ``location``, and those the state does not hold as processed
    with the same signature."""
    processed = read_state(state_path)["processed"]
    found = list_chat_files(location)
    return found, [f for f in found if processed.get(f["path"]) != f["signature"]]


def list_chat_files(location: str) -> list[dict[str, Any]]:
    """``{"path", "signature"}`` of every chat file under a directory or URL prefix."""
    fs, root = fsspec.core.url_to_fs(location)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = []
    for path, info in sorted(fs.find(root, detail=True).items()):
        if info.get("type") == "file" and path.endswith(CHAT_SUFFIXES):
            url = path if protocol in ("file", "local") else f"{protocol}://{path}"
            found.append({"path": url, "signature": _signature(info)})
    return found


def _signature(info: dict[str, Any]) -> str:
    """Size plus whatever the store says changes with the content (ETag, or mtime)."""
    changed = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
    return f"{info.get('size')}:{changed}"


def read_state(state_path: str) -> dict[str, Any]:
    """``{"processed": {path: signature}, "runs": [...]}``; empty when there is none yet."""
    fs, path = fsspec.core.url_to_fs(state_path)
    if not fs.exists(path):
        return {"processed": {}, "runs": []}
    try:
        with fs.open(path, "rb") as handle:
            state = json.loads(handle.read(16 << 20))
    except ValueError as error:
        raise FinetuneError(
            f"{state_path}: not JSON ({error}); move it away to start over"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("processed"), dict):
        raise FinetuneError(f"{state_path}: expected an object with a 'processed' mapping")
    state.setdefault("runs", [])
    return state


@task(name="mark-processed", cache_policy=NO_CACHE)
def mark_processed(state_path: str, files: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Record ``files`` as processed (written to a temporary name, then renamed)."""
    state = read_state(state_path)
    state["processed"].update({f["path"]: f["signature"] for f in files})
    state["runs"].append(summary)
    text = json.dumps(state, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(state_path, text.encode("utf-8"))


@task(name="resolve-base", cache_policy=NO_CACHE)
def resolve_base(name: str, alias: str, dest: str) -> dict[str, Any]:
    """Pin ``models:/name@alias`` to its version and download it, verified."""

    version = get_alias_version(name, alias)
    if version is None:
        raise FinetuneError(
            f"registered model {name!r} has no @{alias} to fine-tune; promote a version "
            f"first: megalith registry promote {name} VERSION"
        )
    uri = f"models:/{name}/{version}"
    package = load_registered_model(uri, dest)
    model = read_package_model_config(package).model_dump(mode="json")
    return {"uri": uri, "version": version, "package": str(package), "model": model}


@flow(name="finetune", log_prints=True)
def finetune(
    config: MegalithConfig,
    data_location: str,
    workdir: str,
    base_alias: str = "champion",
    nproc_per_node: int = 1,
) -> dict[str, Any]:
    """Fine-tune the champion on chat data that arrived since the last run, evaluate it
    against the champion, register it as @candidate and gate it (module docstring)."""
    logger = get_run_logger()
    root = Path(workdir)
    state_path = str(root / STATE_FILE)
    new_files = find_new_data(data_location, state_path)
    if not new_files:
        message = f"No new chat data under `{data_location}` since the last run: skipped."
        create_markdown_artifact(key="finetune", markdown=f"# Fine-tune\n\n{message}")
        logger.info(message)
        return {"skipped": True, "data_location": data_location}

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    round_dir = root / "rounds" / stamp
    name = config.logging.registered_model
    base = resolve_base(name, base_alias, str(round_dir / "base"))
    run_config = _round_config(config, new_files, round_dir, base)
    shards = write_shards_task(run_config.data, run_config.tokenizer, run_config.tokenizer.model)
    create_markdown_artifact(key="shard-manifest", markdown=manifest_markdown(shards))

    trained = pretrain_task(run_config, str(round_dir / "run"), nproc_per_node=nproc_per_node)
    publish_training_summary(trained)
    run_id = trained.get("mlflow_run_id")
    candidate = evaluate_task(
        trained["model_package"],
        run_config,
        str(round_dir / "eval-candidate.json"),
        EVAL_TASKS,
        run_id=run_id,
        package_id=trained["package_id"],
    )
    publish_evaluation(candidate)
    champion = evaluate_task(
        base["package"], run_config, str(round_dir / "eval-champion.json"), EVAL_TASKS
    )
    if not run_id:
        raise FinetuneError("logging.mlflow is off: the fine-tuned model cannot be registered")
    registration = register_task(
        trained["model_package"], name, run_id, candidate["metrics"], trained["package_id"]
    )
    publish_registration(registration, run_id)
    rules = [rule.model_dump() for rule in config.promotion.rules]
    decision = gate_task(name, rules, registration["version"], champion["metrics"])
    publish_promotion(decision)
    summary = {
        "started": stamp,
        "files": len(new_files),
        "base": base["uri"],
        "candidate_version": registration["version"],
        "promoted": decision["promoted"],
    }
    mark_processed(state_path, new_files, summary)
    return {"skipped": False, **summary, "decision": decision["reason"]}


def _round_config(
    config: MegalithConfig, files: list[dict[str, Any]], round_dir: Path, base: dict[str, Any]
) -> MegalithConfig:
    """The recipe for this round: the new files as chat data, the champion's tokenizer and
    architecture, and the champion's pinned version as the fine-tuning base."""
    data = config.data.model_copy(
        update={
            "format": "chat",
            "inputs": [f["path"] for f in files],
            "blend": [],
            "output": str(round_dir / "shards"),
        }
    )
    tokenizer = config.tokenizer.model_copy(
        update={"model": str(package_tokenizer_path(base["package"]))}
    )
    finetune = config.finetune.model_copy(update={"base": base["uri"]})
    model = ModelConfig.model_validate(base["model"])
    return config.model_copy(
        update={"data": data, "tokenizer": tokenizer, "finetune": finetune, "model": model}
    )
