"""``evaluate_model``: perplexity, tasks and generations of a model package in one report.

The report is a JSON object (``REPORT_FORMAT``, version 1)::

    {"format", "format_version", "created_at", "megalith_version",
     "model": {"package", "tokenizer_id", "parameters", "config"},
     "runtime": {"device", "precision", "seconds"},
     "perplexity": PerplexityResult | null,  (with "documents": per-document tokens, nll)
     "tasks": {name: TaskResult},  (with "per_item": choice log-likelihoods and picks)
     "generation": {"settings", "sampled_tokens", "seconds", "tokens_per_s", "samples"} | null,
     "lm_eval": {"version", "tasks", "samples", "metrics"} | null,
     "metrics": {name: number}}

``metrics`` repeats the headline numbers flat (``valid_perplexity``,
``sample_facts_acc``, ``lm_eval.sample_facts.acc_norm``, ...) for experiment trackers and
registry tags. ``lm_eval`` holds lm-evaluation-harness tasks run through
:mod:`evaluation.lm_eval_adapter` (the ``eval`` extra) on the same loaded model.

A T5 package (``model.family: t5``) is evaluated the same way, as it was pretrained:
perplexity on the span-corruption targets, each task choice scored as the span after
its context (:mod:`evaluation.seq2seq`), and seq2seq generations
(:mod:`training.inference.decode_t5`) of prompts that end where the span to fill starts
(``<extra_id_0>``, :data:`T5_DEFAULT_PROMPTS`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from evaluation import EvaluationError
from evaluation.perplexity import evaluate_perplexity, held_out_data
from evaluation.tasks import evaluate_task, load_task, resolve_task_file
from megalith import __version__
from megalith.config import DataConfig
from megalith.storage import atomic_write_bytes
from preprocessing.tokenizer import load_tokenizer
from training.families import model_family
from training.inference.decode import SamplingConfig
from training.inference.runtime import AUTOCAST_DTYPES, resolve_precision
from training.models.package import load_model_package, read_training_data
from training.runtime.device import resolve_device

REPORT_FORMAT = "megalith-eval-report"
REPORT_VERSION = 1
DEFAULT_PROMPTS = ("Once upon a time,", "The capital of")
# T5 fills a sentinel: the decoder answers "<extra_id_0> the span <extra_id_1> ...".
T5_DEFAULT_PROMPTS = tuple(f"{prompt}<extra_id_0>" for prompt in DEFAULT_PROMPTS)
# The default prompts by model.family (the names training.families registers): GPT
# continues a prompt, T5 fills its span.
FAMILY_PROMPTS: dict[str, tuple[str, ...]] = {"gpt": DEFAULT_PROMPTS, "t5": T5_DEFAULT_PROMPTS}


def evaluate_model(
    package_dir: str | Path,
    data: DataConfig | None = None,
    task_files: Sequence[str | Path] = (),
    prompts: Sequence[str] | None = None,
    *,
    split: str = "valid",
    max_samples: int = 64,
    batch_size: int = 8,
    sampling: SamplingConfig | None = None,
    device: str = "auto",
    precision: str = "auto",
    output: str | Path | None = None,
    lm_eval_tasks: Sequence[str] = (),
    lm_eval_limit: int | None = None,
    allow_split_mismatch: bool = False,
) -> dict[str, Any]:
    """Evaluate a model package and return the report (written to ``output`` if given).

    ``data``: shard set(s) for perplexity, or ``None`` to skip it. ``task_files``:
    paths or shipped task names. ``prompts``: ``None`` for :data:`DEFAULT_PROMPTS`,
    empty to skip generation. ``sampling``: defaults to ``SamplingConfig()``.
    ``lm_eval_tasks``: lm-eval task names or YAML files (``lm_eval_limit`` items each).
    Perplexity uses the split the model trained with (:func:`held_out_data`).
    """
    start = time.perf_counter()
    task_paths = [resolve_task_file(t) for t in task_files]
    _check_unique_names(task_paths)
    for path in task_paths:
        load_task(path)  # a broken task file fails before any model work
    if lm_eval_tasks:
        # lm-eval is an optional extra: imported only when its tasks are asked for.
        from evaluation import lm_eval_adapter

        lm_eval_checked = lm_eval_adapter.check_tasks(lm_eval_tasks)
    sampling = sampling or SamplingConfig()
    torch_device = resolve_device(device)
    precision = resolve_precision(precision, torch_device)
    autocast_dtype = AUTOCAST_DTYPES[precision]

    model, config, tokenizer_path = load_model_package(package_dir, torch_device)
    tokenizer = load_tokenizer(str(tokenizer_path))
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "format_version": REPORT_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "megalith_version": __version__,
        "model": {
            "package": str(Path(package_dir).resolve()),
            "tokenizer_id": tokenizer.id,
            "parameters": sum(p.numel() for p in model.parameters()),
            "config": config.model_dump(mode="json"),
        },
        "runtime": {"device": str(torch_device), "precision": precision},
        "perplexity": None,
        "tasks": {},
        "generation": None,
        "lm_eval": None,
    }
    if data is not None:
        data = held_out_data(data, read_training_data(package_dir), allow_split_mismatch)
        result = evaluate_perplexity(
            model,
            data,
            split=split,
            max_samples=max_samples,
            batch_size=batch_size,
            autocast_dtype=autocast_dtype,
            tokenizer_id=tokenizer.id,
        )
        report["perplexity"] = result.to_dict()
    for path in task_paths:
        result = evaluate_task(model, tokenizer, path, autocast_dtype=autocast_dtype)
        report["tasks"][result.name] = result.to_dict()
    if lm_eval_tasks:
        lm = lm_eval_adapter.MegalithLM.from_model(
            model, tokenizer, autocast_dtype=autocast_dtype, batch_size=batch_size
        )
        report["lm_eval"] = lm_eval_adapter.run_tasks(lm, lm_eval_checked, limit=lm_eval_limit)
    prompts = list(FAMILY_PROMPTS[config.family] if prompts is None else prompts)
    if prompts and sampling.max_new_tokens > 0:
        result = model_family(config).generator.generate(
            model,
            tokenizer,
            prompts,
            sampling,
            batch_size=batch_size,
            autocast_dtype=autocast_dtype,
        )
        report["generation"] = {
            "settings": sampling.to_dict(),
            "sampled_tokens": result.sampled_tokens,
            "seconds": result.seconds,
            "tokens_per_s": result.tokens_per_s,
            "samples": [g.to_dict() for g in result.generations],
        }
    report["runtime"]["seconds"] = time.perf_counter() - start
    report["metrics"] = headline_metrics(report)
    if output is not None:
        write_report(report, output)
    return report


def headline_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers as one flat ``{name: value}`` mapping."""
    metrics: dict[str, float] = {}
    ppl = report.get("perplexity")
    if ppl:
        metrics[f"{ppl['split']}_loss"] = ppl["loss"]
        metrics[f"{ppl['split']}_perplexity"] = ppl["perplexity"]
    for name, task in report.get("tasks", {}).items():
        for key in ("acc", "acc_norm", "acc_per_token"):
            metrics[f"{name}_{key}"] = task[key]
    if report.get("lm_eval"):
        metrics.update(report["lm_eval"]["metrics"])
    if report.get("generation"):
        metrics["generation_tokens_per_s"] = report["generation"]["tokens_per_s"]
    return metrics


def write_report(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as JSON atomically (readers see the old file or the new one)."""
    text = json.dumps(_json_safe(report), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write_bytes(str(path), text.encode("utf-8"))


def _json_safe(value: Any) -> Any:
    """NaN and infinities (a diverged model's loss) become null: strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def format_table(report: dict[str, Any], max_text_chars: int = 240) -> str:
    """A plain-text summary of the report for the console."""
    model = report["model"]
    lines = [
        f"model       {model['package']}",
        f"            {model['parameters']:,} parameters, tokenizer {model['tokenizer_id'][:12]}, "
        f"{report['runtime']['device']} {report['runtime']['precision']}",
    ]
    ppl = report.get("perplexity")
    if ppl:
        lines += [
            "",
            f"perplexity  {ppl['perplexity']:.3f}  (loss {ppl['loss']:.4f}, {ppl['split']} split, "
            f"{ppl['samples']} samples, {ppl['tokens']:,} tokens: "
            f"{ppl.get('scored', 'every next token')})",
        ]
    if report.get("tasks"):
        lines += ["", _task_table(report["tasks"])]
    if report.get("lm_eval"):
        lines += ["", f"lm-evaluation-harness {report['lm_eval']['version']}"]
        lines += [
            f"  {name:<40} {value:.4f}" for name, value in report["lm_eval"]["metrics"].items()
        ]
    generation = report.get("generation")
    if generation:
        lines += ["", _generation_header(generation)]
        for index, sample in enumerate(generation["samples"], start=1):
            text = _one_line(sample["text"], max_text_chars)
            lines.append(f'  [{index}] "{_one_line(sample["prompt"], 80)}" → "{text}"')
            lines.append(
                f"      {sample['new_tokens']} tokens, stopped by {sample['finish_reason']}"
            )
    return "\n".join(lines)


def _task_table(tasks: dict[str, Any]) -> str:
    width = max(12, *(len(name) for name in tasks))
    rows = [f"{'task':<{width}}  {'items':>5}  {'acc':>6}  {'acc_norm':>8}  {'acc_tok':>7}"]
    for name, task in tasks.items():
        rows.append(
            f"{name:<{width}}  {task['items']:>5}  {task['acc']:>6.3f}  {task['acc_norm']:>8.3f}  "
            f"{task['acc_per_token']:>7.3f}"
        )
        for kind, scores in task.get("by_kind", {}).items():
            rows.append(
                f"{'  ' + kind:<{width}}  {scores['items']:>5}  {scores['acc']:>6.3f}  "
                f"{scores['acc_norm']:>8.3f}  {scores['acc_per_token']:>7.3f}"
            )
    return "\n".join(rows)


def _generation_header(generation: dict[str, Any]) -> str:
    settings = generation["settings"]
    if settings["temperature"] == 0:
        how = "greedy"
    else:
        how = f"temperature {settings['temperature']}"
        if settings["top_k"]:
            how += f", top-k {settings['top_k']}"
        if settings["top_p"] is not None:
            how += f", top-p {settings['top_p']}"
        how += f", seed {settings['seed']}"
    return (
        f"generations ({how}, up to {settings['max_new_tokens']} new tokens, "
        f"{generation['tokens_per_s']:.1f} tokens/s)"
    )


def _one_line(text: str, limit: int) -> str:
    text = text.replace("\n", " ⏎ ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_unique_names(paths: Sequence[Path]) -> None:
    names = [p.stem for p in paths]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EvaluationError(f"task names must be unique (file stems); repeated: {duplicates}")
