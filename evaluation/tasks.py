"""Zero-shot multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness does.

A task file is jsonl, one item per line (blank lines are skipped)::

    {"context": "The capital of Valdoria is", "choices": [" Mirelle", " Pellan"], "answer": 0}

optionally with ``"kind": str`` to break accuracy down by kind. The scored text is
``context + choice`` verbatim, so a choice carries its own leading space. Each
choice's score is the sum of the log-probabilities of its tokens given the context
(which is preceded by the end-of-document token, the way every training document
starts). ``acc`` picks the choice with the highest sum; ``acc_norm`` divides by the
choice's length in characters (lm-eval's ``acc_norm``); ``acc_per_token`` by its
number of tokens.

``python -m evaluation.tasks --write-sample`` regenerates the shipped
``tasks/sample_facts.jsonl`` from the sample corpus's facts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from evaluation import EvaluationError
from evaluation.seq2seq import span_logliks
from evaluation.task_files import (  # noqa: F401 - TASKS_DIR: re-exported, as before
    SAMPLE_TASK,
    TASKS_DIR,
    TaskFileError,
    resolve_task_file,
)
from megalith.storage import atomic_write_bytes
from preprocessing.corpus_generator import multiple_choice_items
from preprocessing.tokenizer import Tokenizer
from training.inference.runtime import autocast, model_device
from training.models.gpt import GPTModel

REQUIRED_KEYS = ("context", "choices", "answer")
OPTIONAL_KEYS = ("kind",)
MAX_REPORTED_ERRORS = 10
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    answer: int
    kind: str | None = None


@dataclass(frozen=True)
class ChoiceScore:
    loglik: float  # sum of the choice tokens' log-probabilities
    tokens: int
    chars: int


@dataclass(frozen=True)
class TaskResult:
    name: str
    file: str
    items: int
    acc: float
    acc_norm: float
    acc_per_token: float
    by_kind: dict[str, dict[str, float]]
    seconds: float
    per_item: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "items": self.items,
            "acc": self.acc,
            "acc_norm": self.acc_norm,
            "acc_per_token": self.acc_per_token,
            "by_kind": self.by_kind,
            "seconds": self.seconds,
            "per_item": list(self.per_item),
        }


# --- task files ---------------------------------------------------------------------


def load_task(path: str | Path) -> list[Item]:
    """Parse and validate a task file; every problem is reported as ``file:line: problem``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"{path}: cannot read task file: {exc}") from None
    items, errors = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            items.append(parse_item(line))
        except ValueError as exc:
            errors.append(f"{path}:{number}: {exc}")
    if errors:
        shown = errors[:MAX_REPORTED_ERRORS]
        more = len(errors) - len(shown)
        raise TaskFileError("\n".join(shown + ([f"... and {more} more"] if more else [])))
    if not items:
        raise TaskFileError(f"{path}: no items")
    return items


def parse_item(line: str) -> Item:
    """One jsonl line → an :class:`Item`; raises ``ValueError`` naming the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in obj]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    unknown = sorted(set(obj) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        allowed = ", ".join(REQUIRED_KEYS + OPTIONAL_KEYS)
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (allowed: {allowed})")
    context, choices, answer = obj["context"], obj["choices"], obj["answer"]
    if not isinstance(context, str):
        raise ValueError(f"context must be a string, got {type(context).__name__}")
    if not isinstance(choices, list) or len(choices) < 2:
        raise ValueError("choices must be a list of at least 2 strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("every choice must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise ValueError(f"answer must be an integer index, got {answer!r}")
    if not 0 <= answer < len(choices):
        raise ValueError(f"answer {answer} is out of range for {len(choices)} choices")
    kind = obj.get("kind")
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"kind must be a string, got {type(kind).__name__}")
    return Item(context, tuple(choices), answer, kind)


# --- scoring --------------------------------------------------------------------------


def choice_tokens(tokenizer: Tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    """``(context tokens, choice tokens)`` that together encode ``context + choice``.

    The pair is cut where ``encode(context + choice)`` stops agreeing with
    ``encode(context)``, so the choice is scored as the model sees it in running text
    (SentencePiece would encode a lone " Mirelle" with an extra leading space piece).
    """
    whole = tokenizer.encode(context + choice)
    alone = tokenizer.encode(context)
    common = 0
    while common < min(len(whole), len(alone)) and whole[common] == alone[common]:
        common += 1
    common = min(common, len(whole) - 1)  # at least one choice token
    return [tokenizer.eod_id, *whole[:common]], whole[common:]


def score_choices(
    model: GPTModel,
    tokenizer: Tokenizer,
    items: Sequence[Item],
    *,
    batch_size: int = 32,
    autocast_dtype: torch.dtype | None = None,
) -> list[list[ChoiceScore]]:
    """Log-likelihood of every choice of every item, in batches of ``batch_size`` sequences."""
    requests = [(i, c) for i, item in enumerate(items) for c in range(len(item.choices))]
    sequences = [
        _choice_sequence(tokenizer, items[i], c, model.config.max_position_embeddings)
        for i, c in requests
    ]
    # Longest first, so each batch holds sequences of similar length (little padding).
    order = sorted(range(len(requests)), key=lambda r: -len(sequences[r][0]))
    logliks: dict[int, float] = {}
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        chosen = [sequences[r] for r in batch]
        values = CHOICE_LOGLIKS[model.config.family](model, tokenizer, chosen, autocast_dtype)
        logliks.update(zip(batch, values, strict=True))

    scores: list[list[ChoiceScore]] = [[] for _ in items]
    for r, (i, c) in enumerate(requests):
        scores[i].append(ChoiceScore(logliks[r], sequences[r][1], len(items[i].choices[c])))
    return scores


def _choice_sequence(
    tokenizer: Tokenizer, item: Item, choice: int, max_positions: int
) -> tuple[list[int], int]:
    """``(context and choice tokens, number of choice tokens)``, cut to fit the model."""
    context, tokens = choice_tokens(tokenizer, item.context, item.choices[choice])
    if len(tokens) > max_positions:
        raise EvaluationError(
            f"choice {choice} of {item.context[:40]!r} has {len(tokens)} tokens, more than "
            f"the model's {max_positions} positions"
        )
    # The model sees all but the last token: keep at most max_positions + 1, oldest dropped.
    return (context + tokens)[-(max_positions + 1) :], len(tokens)


@torch.no_grad()
def sequence_logliks(
    model: GPTModel,
    sequences: Sequence[tuple[list[int], int]],
    autocast_dtype: torch.dtype | None = None,
) -> list[float]:
    """For each ``(tokens, n)``: the summed log-probability of its last ``n`` tokens.

    Sequences are right-padded; causal attention keeps padding from affecting them.
    """
    device = model_device(model)
    inputs, labels = padded_rows(sequences)
    with autocast(device, autocast_dtype):
        losses = model(inputs.to(device), labels.to(device), loss_reduction="none")
    return (-losses.double().sum(dim=1)).tolist()


# Each choice's log-likelihood by model.family (the names training.families registers):
# GPT reads it as the continuation of the context, T5 as the span after it.
CHOICE_LOGLIKS: dict[
    str,
    Callable[
        [nn.Module, Tokenizer, Sequence[tuple[list[int], int]], torch.dtype | None], list[float]
    ],
] = {
    "gpt": lambda model, tokenizer, sequences, dtype: sequence_logliks(model, sequences, dtype),
    "t5": span_logliks,
}


def padded_rows(sequences: Sequence[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` of right-padded rows: each sequence but its last token, and its
    last ``n`` tokens as labels at the positions that predict them (``IGNORE_INDEX`` elsewhere)."""
    width = max(len(tokens) for tokens, _ in sequences)
    inputs = torch.zeros(len(sequences), width - 1, dtype=torch.long)
    labels = torch.full_like(inputs, IGNORE_INDEX)
    for row, (tokens, n) in enumerate(sequences):
        length = len(tokens)
        inputs[row, : length - 1] = torch.tensor(tokens[:-1])
        labels[row, length - 1 - n : length - 1] = torch.tensor(tokens[-n:])
    return inputs, labels


def accuracies(items: Sequence[Item], scores: Sequence[Sequence[ChoiceScore]]) -> dict[str, float]:
    """``acc`` (sum), ``acc_norm`` (per character) and ``acc_per_token``; ties go to the first."""
    correct = {"acc": 0, "acc_norm": 0, "acc_per_token": 0}
    for item, choices in zip(items, scores, strict=True):
        for name, pick in picks(choices).items():
            correct[name] += pick == item.answer
    return {name: count / len(items) for name, count in correct.items()}


def picks(choices: Sequence[ChoiceScore]) -> dict[str, int]:
    """The choice each accuracy picks: the highest sum, per character, per token."""
    ranked = {
        "acc": [s.loglik for s in choices],
        "acc_norm": [s.loglik / s.chars for s in choices],
        "acc_per_token": [s.loglik / s.tokens for s in choices],
    }
    return {name: values.index(max(values)) for name, values in ranked.items()}


def item_results(
    items: Sequence[Item], scores: Sequence[Sequence[ChoiceScore]]
) -> tuple[dict[str, Any], ...]:
    """Per item: each choice's log-likelihood, tokens and characters, the answer and the
    pick of each accuracy, so the numbers can be compared with another tool's."""
    return tuple(
        {
            "index": index,
            "kind": item.kind,
            "answer": item.answer,
            "choices": [
                {"loglik": s.loglik, "tokens": s.tokens, "chars": s.chars} for s in choices
            ],
            "pick": picks(choices),
        }
        for index, (item, choices) in enumerate(zip(items, scores, strict=True))
    )


def evaluate_task(
    model: GPTModel,
    tokenizer: Tokenizer,
    path: str | Path,
    *,
    batch_size: int = 32,
    autocast_dtype: torch.dtype | None = None,
) -> TaskResult:
    """Load, score and summarise one task file (its name is the file's stem)."""
    path = resolve_task_file(path)
    items = load_task(path)
    start = time.perf_counter()
    scores = score_choices(
        model, tokenizer, items, batch_size=batch_size, autocast_dtype=autocast_dtype
    )
    by_kind = {}
    for kind in sorted({item.kind for item in items if item.kind is not None}):
        chosen = [(it, sc) for it, sc in zip(items, scores, strict=True) if it.kind == kind]
        kind_items, kind_scores = zip(*chosen, strict=True)
        by_kind[kind] = {"items": len(chosen), **accuracies(kind_items, kind_scores)}
    return TaskResult(
        name=path.stem,
        file=str(path),
        items=len(items),
        **accuracies(items, scores),
        by_kind=by_kind,
        seconds=time.perf_counter() - start,
        per_item=item_results(items, scores),
    )


# --- the shipped sample task ----------------------------------------------------------


def sample_task_lines(seed: int = 0, per_kind: int = 20) -> list[str]:
    """The sample corpus's fact questions as task-file lines (deterministic)."""
    lines = []
    for raw in multiple_choice_items(seed=seed, per_kind=per_kind):
        item = {
            "kind": raw["kind"],
            "context": raw["query"],
            "choices": [" " + choice for choice in raw["choices"]],
            "answer": raw["answer"],
        }
        lines.append(json.dumps(item, ensure_ascii=False))
    return lines


def write_sample_task(path: str | Path = SAMPLE_TASK) -> int:
    """Regenerate the shipped sample task file; returns the number of items."""
    lines = sample_task_lines()
    atomic_write_bytes(str(path), ("\n".join(lines) + "\n").encode("utf-8"))
    return len(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m evaluation.tasks", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--write-sample", action="store_true", help=f"regenerate {SAMPLE_TASK.name}"
    )
    parser.add_argument("--output", default=str(SAMPLE_TASK), help="where to write it")
    args = parser.parse_args(argv)
    if not args.write_sample:
        parser.print_help()
        return 2
    count = write_sample_task(args.output)
    print(f"wrote {count} items to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
