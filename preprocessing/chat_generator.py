"""Deterministic generator for the shipped chat sample (``sample_corpus/chat.jsonl``).

Short question-and-answer conversations over the same fixed world as the stories corpus
(:mod:`preprocessing.corpus_generator`: capitals, colors of things, animal sounds, pets,
small sums), for supervised fine-tuning tests and demos. Every answer follows one fixed
pattern per question kind, so a tiny model learns to answer within a few dozen steps.
Some conversations have a system turn, some several user/assistant rounds, some use the
``{"prompt", "response"}`` shorthand.

    python -m preprocessing.chat_generator --output preprocessing/sample_corpus/chat.jsonl --seed 0

Same seed and ``--conversations``, same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from preprocessing.corpus_generator import (
    ANIMAL_SOUNDS,
    CHARACTERS,
    COUNTRIES,
    OBJECT_COLORS,
    addition_facts,
    cap,
    indefinite,
    number_word,
)

DEFAULT_CONVERSATIONS = 400
SYSTEM_PROMPTS = (
    "You are a helpful assistant who answers in one short sentence.",
    "You are a friendly teacher. Answer briefly.",
)


def _capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(COUNTRIES)
    return (
        f"What is the capital of {country.name}?",
        f"The capital of {country.name} is {country.capital}.",
    )


def _color(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(sorted(OBJECT_COLORS))
    return (
        f"What color is {indefinite(thing)}?",
        f"{cap(indefinite(thing))} is {OBJECT_COLORS[thing]}.",
    )


def _sound(rng: random.Random) -> tuple[str, str]:
    animal = rng.choice(sorted(ANIMAL_SOUNDS))
    return f"What does the {animal} say?", f"The {animal} says {ANIMAL_SOUNDS[animal]}."


def _pet(rng: random.Random) -> tuple[str, str]:
    person = rng.choice(CHARACTERS)
    return (
        f"What pet does {person.name} have?",
        f"{person.name} has {indefinite(person.pet)} named {person.pet_name}.",
    )


def _sum(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.choice(addition_facts())
    return (
        f"What is {number_word(a)} plus {number_word(b)}?",
        f"{cap(number_word(a))} plus {number_word(b)} is {number_word(c)}.",
    )


QUESTIONS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _capital,
    _color,
    _sound,
    _pet,
    _sum,
)


def conversation(rng: random.Random) -> dict:
    """One record: 1-3 rounds, maybe a system turn; a fifth use the prompt/response shorthand."""
    rounds = rng.choice((1, 1, 2, 3))
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.4 else None
    pairs = [rng.choice(QUESTIONS)(rng) for _ in range(rounds)]
    if rounds == 1 and rng.random() < 0.2:
        record = {"prompt": pairs[0][0], "response": pairs[0][1]}
        if system:
            record["system"] = system
        return record
    messages = [{"role": "system", "content": system}] if system else []
    for question, answer in pairs:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return {"messages": messages}


def write_chat_corpus(
    output: str | Path, seed: int = 0, conversations: int = DEFAULT_CONVERSATIONS
) -> int:
    """Write the jsonl (to a temporary name, then renamed); returns its size in bytes."""
    rng = random.Random(seed)
    lines = [json.dumps(conversation(rng), sort_keys=True) for _ in range(conversations)]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    path = Path(output)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="Where the jsonl goes.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS)
    args = parser.parse_args(argv)
    size = write_chat_corpus(args.output, args.seed, args.conversations)
    print(f"wrote {args.conversations} conversations, {size} bytes to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
