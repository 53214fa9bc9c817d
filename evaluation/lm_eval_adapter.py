"""Megalith model packages as an lm-evaluation-harness model type, ``megalith``.

EleutherAI's lm-evaluation-harness (``pip install 'megalith[eval]'``) asks a model for
three things; this adapter answers them with the scoring and decoding code ``megalith
eval`` uses, for GPT and T5 packages alike:

- ``loglikelihood(context, continuation)``: the continuation's summed log-probability
  and whether greedy decoding would produce it. Context and continuation are tokenized as
  :func:`evaluation.tasks.choice_tokens` does (after the end-of-document token every
  training document follows), so an lm-eval multiple-choice task scores exactly what
  ``megalith eval --tasks`` scores. A T5 model scores the continuation as the span after
  the context (:mod:`evaluation.seq2seq`).
- ``loglikelihood_rolling(text)``: the whole text's log-probability, in disjoint windows
  of the model's context length (lm-eval's own windowing), the first after the
  end-of-document token.
- ``generate_until(context, gen_kwargs)``: greedy or sampled continuations
  (:func:`training.inference.decode.generate_ids`) cut at the first ``until`` string.

Requests are scored in batches (longest first, so a batch pads little).

lm-eval 0.4.13 finds model types only in its own registry, not through package entry
points, so the name ``megalith`` exists once this module is imported. Run lm-eval
through ``megalith-lm-eval`` (lm-eval's own command line with the model registered and
the shipped tasks included)::

    megalith-lm-eval run --model megalith --model_args package=runs/demo/model \\
        --tasks sample_facts

or from Python: ``import evaluation.lm_eval_adapter`` and then
``lm_eval.simple_evaluate(model="megalith", model_args={"package": ...})``.
``megalith eval --lm-eval-tasks`` runs tasks through :func:`run_tasks` on the model it
already loaded. Shipped task YAMLs live in :data:`TASKS_DIR` (``sample_facts``).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from evaluation import EvaluationError
from evaluation.seq2seq import span_prompt, span_rows
from evaluation.tasks import IGNORE_INDEX, TASKS_DIR, choice_tokens, padded_rows
from megalith import safe_read
from preprocessing.tokenizer import Tokenizer, load_tokenizer, sentinel_ids
from training.families import model_family
from training.inference.decode import (
    SampledToken,
    SamplingConfig,
    continuation_text,
    prompt_ids,
)
from training.inference.runtime import AUTOCAST_DTYPES, autocast, model_device, resolve_precision
from training.models.package import load_model_package
from training.runtime.device import resolve_device

try:
    import lm_eval
    import lm_eval.models  # noqa: F401 - lm-eval's own model types, registered lazily
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager, get_task_dict
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # an optional extra: say how to get it
    raise EvaluationError(
        f"lm-evaluation-harness is not installed ({error.msg}): pip install 'megalith[eval]'"
    ) from None

MODEL_NAME = "megalith"
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
METRIC_PREFIX = "lm_eval"
MAX_TASK_YAML_BYTES = 1 << 20
MAX_TARGET_CHARS = 200  # longer targets (whole documents) are left out of the report
_TASK_LINE = re.compile(r"^task:[ \t]*(\S+)[ \t]*$", re.MULTILINE)
_UNSAFE_METRIC_CHARS = re.compile(r"[^\w\-. /]")  # what MLflow accepts in a metric name


class _Row(NamedTuple):
    """One generation request: its prompt ids, sampling settings and stop strings."""

    prompt: list[int]
    sampling: SamplingConfig
    until: list[str]


@register_model(MODEL_NAME)
class MegalithLM(LM):
    """A loaded Megalith model (GPT or T5) behind lm-eval's ``LM`` interface.

    From lm-eval's command line: ``--model megalith --model_args package=DIR[,precision=
    fp32|bf16|fp16][,max_gen_toks=N]``; ``--batch_size`` and ``--device`` apply as usual.
    """

    def __init__(
        self,
        package: str | None = None,
        device: str | None = None,
        precision: str = "auto",
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS,
        max_batch_size: int | None = None,  # lm-eval's, for --batch_size auto: unused
    ) -> None:
        super().__init__()
        if package is None:
            raise EvaluationError("the megalith model type needs --model_args package=DIR")
        torch_device = resolve_device(device or "auto")
        model, _config, tokenizer_path = load_model_package(package, torch_device)
        autocast_dtype = AUTOCAST_DTYPES[resolve_precision(precision, torch_device)]
        tokenizer = load_tokenizer(str(tokenizer_path))
        self._setup(model, tokenizer, autocast_dtype, batch_size, max_gen_toks)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        *,
        autocast_dtype: torch.dtype | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
    ) -> MegalithLM:
        """The adapter over a model already loaded (``megalith eval`` loads it once)."""
        lm = cls.__new__(cls)
        LM.__init__(lm)
        lm._setup(model, tokenizer, autocast_dtype, batch_size, max_gen_toks)
        return lm

    def _setup(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        autocast_dtype: torch.dtype | None,
        batch_size: int | str | None,
        max_gen_toks: int | str,
    ) -> None:
        self.model, self.tokenizer, self.autocast_dtype = model, tokenizer, autocast_dtype
        self.family = LM_EVAL_FAMILIES[model.config.family]
        self.generator = model_family(model.config).generator
        self.max_positions = model.config.max_position_embeddings
        self.batch_size = _positive_int(batch_size, "batch_size", DEFAULT_BATCH_SIZE)
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks", DEFAULT_MAX_GEN_TOKS)

    @property
    def tokenizer_name(self) -> str:
        return f"megalith-{self.tokenizer.id[:16]}"

    # --- lm-eval's three requests ----------------------------------------------------

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """``(summed log-probability, is greedy)`` of each request's continuation."""
        sequences = [self._pair(*request.args) for request in requests]
        return self._scores(sequences)

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        """Each text's summed log-probability over disjoint windows of the model's length."""
        windows: list[tuple[list[int], int]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            tokens = self.tokenizer.encode(request.args[0])
            for context, target in map(
                make_disjoint_window,
                get_rolling_token_windows(tokens, self.tokenizer.eod_id, self.max_positions, 1),
            ):
                windows.append(([*context, *target], len(target)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (loglik, _) in zip(owners, self._scores(windows), strict=True):
            totals[owner] += loglik
        return totals

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Each context's continuation, cut before the first of its ``until`` strings."""
        rows = [self._generation_row(*request.args) for request in requests]
        order = sorted(range(len(rows)), key=lambda r: len(rows[r][0]))
        texts: dict[int, str] = {}
        for first in range(0, len(order), self.batch_size):
            batch = order[first : first + self.batch_size]
            texts.update(zip(batch, self._generate([rows[r] for r in batch]), strict=True))
        return [texts[r] for r in range(len(rows))]

    # --- scoring -----------------------------------------------------------------------

    def _pair(self, context: str, continuation: str) -> tuple[list[int], int]:
        """``(context and continuation tokens, number of continuation tokens)``, cut to fit."""
        if not continuation:
            raise EvaluationError(f"an empty continuation to score after {context[-40:]!r}")
        context_ids, tokens = choice_tokens(self.tokenizer, context, continuation)
        if len(tokens) > self.max_positions:
            raise EvaluationError(
                f"a continuation of {len(tokens)} tokens is longer than the model's "
                f"{self.max_positions} positions"
            )
        return (context_ids + tokens)[-(self.max_positions + 1) :], len(tokens)

    def _scores(self, sequences: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        order = sorted(range(len(sequences)), key=lambda r: -len(sequences[r][0]))
        scores: dict[int, tuple[float, bool]] = {}
        for first in range(0, len(order), self.batch_size):
            batch = order[first : first + self.batch_size]
            chosen = [sequences[r] for r in batch]
            values = self.family.scores(self.model, self.tokenizer, chosen, self.autocast_dtype)
            scores.update(zip(batch, values, strict=True))
        return [scores[r] for r in range(len(sequences))]

    # --- generation --------------------------------------------------------------------

    def _generation_row(self, context: str, gen_kwargs: dict[str, Any]) -> _Row:
        """lm-eval's ``gen_kwargs``: ``until``, ``max_gen_toks``, ``do_sample`` (greedy
        unless true), ``temperature``, ``top_k``, ``top_p``, ``seed``."""
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = _positive_int(
            gen_kwargs.get("max_gen_toks", self.max_gen_toks), "max_gen_toks", 1
        )
        temperature = float(gen_kwargs.get("temperature", 1.0))
        sampled = bool(gen_kwargs.get("do_sample", False)) and temperature > 0
        sampling = SamplingConfig(
            max_new_tokens=min(max_new, self.max_positions - 1),
            temperature=temperature if sampled else 0.0,
            top_k=gen_kwargs.get("top_k") or None,
            top_p=gen_kwargs.get("top_p"),
            seed=int(gen_kwargs.get("seed", 1234)),
        )
        return _Row(self.family.prompt(self.tokenizer, context), sampling, until)

    def _generate(self, rows: Sequence[_Row]) -> list[str]:
        prompts = [row.prompt for row in rows]
        new: list[list[int]] = [[] for _ in rows]

        def on_token(row: int, token: SampledToken) -> None:
            new[row].append(token.id)

        def stop(row: int) -> str | None:
            text = self._text(prompts[row], new[row])
            return None if _cut(text, rows[row].until) is None else "stop"

        self.generator.generate_batch(
            self.model,
            self.tokenizer,
            prompts,
            [row.sampling for row in rows],
            autocast_dtype=self.autocast_dtype,
            on_token=on_token,
            stop=stop,
        )
        texts = []
        for row, (prompt, _, until) in enumerate(rows):
            text = self._text(prompt, new[row])
            cut = _cut(text, until)
            texts.append(text if cut is None else cut)
        return texts

    def _text(self, prompt: list[int], new: list[int]) -> str:
        return self.family.text(self.tokenizer, prompt, new)


def _cut(text: str, until: Sequence[str]) -> str | None:
    """``text`` before the first of the ``until`` strings it holds, or ``None``."""
    ends = [text.find(s) for s in until if s and s in text]
    return text[: min(ends)] if ends else None


def _positive_int(value: Any, name: str, default: int) -> int:
    """lm-eval passes numbers from its command line as strings, and ``auto`` sizes."""
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise EvaluationError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise EvaluationError(f"{name} must be a positive integer, got {value!r}")
    return number


# --- scores with lm-eval's greedy flag ------------------------------------------------


@torch.no_grad()
def sequence_scores(
    model: torch.nn.Module,
    sequences: Sequence[tuple[list[int], int]],
    autocast_dtype: torch.dtype | None = None,
    vocab_size: int | None = None,
) -> list[tuple[float, bool]]:
    """For each ``(tokens, n)`` of a GPT model: the summed log-probability of its last
    ``n`` tokens and whether each of them is the most likely next token (among the first
    ``vocab_size`` ids: greedy generation never picks the vocabulary's padding)."""
    device = model_device(model)
    inputs, labels = padded_rows(sequences)
    with autocast(device, autocast_dtype):
        logits = model(inputs.to(device))
    return _label_scores(logits, labels.to(device), vocab_size)


@torch.no_grad()
def span_scores(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    sequences: Sequence[tuple[list[int], int]],
    autocast_dtype: torch.dtype | None = None,
) -> list[tuple[float, bool]]:
    """:func:`sequence_scores` for a T5 model: the last ``n`` tokens as the span after
    the others (:func:`evaluation.seq2seq.span_logliks`)."""
    device = model_device(model)
    encoder, decoder, labels, mask = span_rows(tokenizer, sequences)
    with autocast(device, autocast_dtype):
        logits = model(encoder.to(device), decoder.to(device), encoder_mask=mask.to(device))
    return _label_scores(logits, labels.to(device), tokenizer.vocab_size)


def _label_scores(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None
) -> list[tuple[float, bool]]:
    """Per row: the summed log-probability of its labels and whether each is the argmax
    among the first ``vocab_size`` ids (the padding of the vocabulary is never generated).
    Only the scored positions are normalised (a ``[B, T, V]`` copy in float64 would not fit
    at real vocabulary sizes)."""
    scored = labels != IGNORE_INDEX
    rows = scored.nonzero()[:, 0]
    chosen, targets = logits[scored].float(), labels[scored]
    logprobs = chosen.log_softmax(dim=-1).gather(-1, targets[:, None])[:, 0].double()
    sums = torch.zeros(len(labels), dtype=torch.float64, device=logits.device)
    sums.index_add_(0, rows, logprobs)
    greedy = torch.ones(len(labels), dtype=torch.bool, device=logits.device)
    greedy[rows[chosen[:, :vocab_size].argmax(dim=-1) != targets]] = False
    return list(zip(sums.tolist(), greedy.tolist(), strict=True))


# --- per model.family ------------------------------------------------------------


def _span_prompt(tokenizer: Tokenizer, context: str) -> list[int]:
    return span_prompt(tokenizer, tokenizer.encode(context))[0]


def _span_text(tokenizer: Tokenizer, prompt: list[int], new: list[int]) -> str:
    """The decoder names the span it fills with sentinels: leave them out."""
    sentinels = set(sentinel_ids(tokenizer))
    return tokenizer.decode([t for t in new if t not in sentinels])


class LMEvalFamily(NamedTuple):
    """What lm-eval's requests do per model family (the generation itself is the family's
    generator): score ``(tokens, n)`` sequences, a generation's prompt tokens and the text
    of its new tokens."""

    scores: Callable[..., list[tuple[float, bool]]]
    prompt: Callable[[Tokenizer, str], list[int]]
    text: Callable[[Tokenizer, list[int], list[int]], str]


# By the model.family names training.families registers: GPT continues the context, T5
# fills the span after it.
LM_EVAL_FAMILIES: dict[str, LMEvalFamily] = {
    "gpt": LMEvalFamily(
        scores=lambda model, tokenizer, sequences, dtype: sequence_scores(
            model, sequences, dtype, tokenizer.vocab_size
        ),
        prompt=prompt_ids,
        text=continuation_text,
    ),
    "t5": LMEvalFamily(scores=span_scores, prompt=_span_prompt, text=_span_text),
}


# --- running tasks --------------------------------------------------------------------


def run_tasks(
    lm: MegalithLM,
    tasks: Sequence[str] | CheckedTasks,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
) -> dict[str, Any]:
    """Run lm-eval tasks (names lm-eval knows, the shipped ones in :data:`TASKS_DIR`, or
    task YAML files) on ``lm``; returns ``{"version", "tasks": {name: {metric: value}},
    "samples": {name: [per-item results]}, "metrics": {flat MLflow-safe name: value}}``."""
    manager, names = tasks if isinstance(tasks, CheckedTasks) else check_tasks(tasks)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=True,
        bootstrap_iters=0,
    )
    if results is None:  # only on ranks other than 0, which megalith eval never has
        raise EvaluationError("lm-eval returned no results")
    per_task = {task: _numbers(values) for task, values in results["results"].items()}
    return {
        "version": lm_eval.__version__,
        "tasks": per_task,
        "samples": {task: [_sample(s) for s in rows] for task, rows in results["samples"].items()},
        "metrics": flat_metrics(per_task),
    }


class CheckedTasks(NamedTuple):
    """Tasks lm-eval can load: its index over them, and their names."""

    manager: TaskManager
    names: list[str]


def check_tasks(tasks: Sequence[str]) -> CheckedTasks:
    """lm-eval's task index and the task names; an unknown name, or a task file lm-eval
    cannot read, is an error (``megalith eval`` checks before it loads the model).

    The shipped tasks and the folders of task YAML files given by path are indexed
    first; lm-eval's own few thousand task files (a few seconds to index) only when a
    name is not among them."""
    files = _task_files(tasks)
    names = [files.get(task, task) for task in tasks]
    local = [str(TASKS_DIR), *sorted({str(Path(path).resolve().parent) for path in files})]
    manager = TaskManager(include_path=local, include_defaults=False)
    unread = [f"{path} (task {name})" for path, name in files.items() if not _has(manager, name)]
    if unread:
        raise EvaluationError(f"lm-eval could not index {', '.join(unread)}: is it valid YAML?")
    if not all(_has(manager, name) for name in names):
        manager = TaskManager(include_path=local)
    unknown = [name for name in names if not _has(manager, name)]
    if unknown:
        raise EvaluationError(
            f"lm-eval knows no task {', '.join(unknown)} (shipped: "
            f"{', '.join(shipped_tasks())}; or give a task YAML file's path)"
        )
    try:  # lm-eval builds tasks from user files: say which failed, not its traceback
        get_task_dict(names, manager)
    except Exception as error:  # whatever a third-party loader raises on a bad file
        raise EvaluationError(
            f"lm-eval could not load task {', '.join(names)}: {type(error).__name__}: "
            f"{safe_read.clip(str(error), 200)}"
        ) from None
    return CheckedTasks(manager, names)


def _has(manager: TaskManager, name: str) -> bool:
    return bool(manager.match_tasks([name]))


def shipped_tasks() -> list[str]:
    return sorted(path.stem for path in TASKS_DIR.glob("*.yaml"))


def _task_files(tasks: Sequence[str]) -> dict[str, str]:
    """``{path: task name}`` for the tasks given as YAML files (lm-eval finds a task by its
    ``task:`` name in an included folder)."""
    files = {}
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            files[task] = _yaml_task_name(path)
    return files


def _yaml_task_name(path: Path) -> str:
    """The top-level ``task:`` name of an lm-eval task YAML (read as text: lm-eval's YAMLs
    carry tags such as ``!function`` that a safe YAML loader refuses)."""
    text = safe_read.read_bytes_bounded(path, MAX_TASK_YAML_BYTES).decode("utf-8", "replace")
    match = _TASK_LINE.search(text)
    if match is None:
        raise EvaluationError(f"{path}: an lm-eval task YAML needs a 'task: NAME' line")
    return match.group(1).strip("'\"")


def flat_metrics(per_task: dict[str, dict[str, float]]) -> dict[str, float]:
    """``lm_eval.<task>.<metric>`` for each finite number (``acc,none`` → ``acc``; another
    filter is kept: ``exact_match.strict-match``): names MLflow accepts and promotion rules
    (``promotion.rules[].metric``) can name."""
    flat = {}
    for task, values in per_task.items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name in ("", "none") else f"{metric}.{filter_name}"
            if math.isfinite(value):
                flat[_UNSAFE_METRIC_CHARS.sub("_", f"{METRIC_PREFIX}.{task}.{name}")] = value
    return flat


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """A task's metric values (lm-eval also reports its item count, ``sample_len``)."""
    return {
        key: float(value)
        for key, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "sample_len"
    }


def _sample(sample: dict[str, Any]) -> dict[str, Any]:
    """One item's record: its index, target and the model's filtered responses (for a
    multiple-choice item, one ``[log-likelihood, is greedy]`` per choice)."""
    target = sample.get("target")
    if isinstance(target, str) and len(target) > MAX_TARGET_CHARS:  # a rolling task's document
        target = None
    return {
        "doc_id": sample.get("doc_id"),
        "target": _plain(target),
        "responses": _plain(sample.get("filtered_resps")),
        **{key: _plain(sample[key]) for key in ("acc", "acc_norm") if key in sample},
    }


def _plain(value: Any) -> Any:
    """JSON-ready copies of lm-eval's values (tuples, numpy numbers)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | bool | int | float) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)


# --- lm-eval's command line with the megalith model type -------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """``megalith-lm-eval``: lm-eval's command line with ``--model megalith`` registered
    and, unless ``--include_path`` names another folder, the shipped tasks included."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and "--include_path" not in argv:
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["megalith-lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
