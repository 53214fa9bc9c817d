"""Write the Megatron-LM-made shards under tests/data/megatron_preprocess/ with Megatron's own tool.

``tests/test_prepare.py`` checks that ``megalith data prepare`` with ``eod: eos`` writes the
same ``.bin``/``.idx`` bytes as these. The corpus (``corpus.jsonl``) and the SentencePiece
model (``tokenizer.model``, trained by ``megalith``'s trainer) are written here first, then
Megatron-LM's ``tools/preprocess_data.py`` at tag ``core_v0.16.1`` (commit
55ac7082517c3878ae653c07c09c534b8aed49f6, the version of the pip ``megatron-core`` in the
test extra, used as ``megatron.core``) tokenizes the corpus. Regenerate with::

    mkdir -p /tmp/mlm && git --git-dir=MEGATRON_LM.git archive core_v0.16.1 \\
        tools/preprocess_data.py megatron/training megatron/legacy | tar -x -C /tmp/mlm
    MEGATRON_LM=/tmp/mlm python tests/data/megatron_preprocess/make_shards.py

which runs, in ``tests/data/megatron_preprocess/``::

    python /tmp/mlm/tools/preprocess_data.py --input corpus.jsonl --output-prefix megatron \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model \\
        --append-eod --workers 1

(``megatron_text_document.bin``/``.idx``). ``megatron/training/__init__.py`` imports the
training loop, which needs triton (absent on CPU machines): the tool runs with
``megatron.training`` as a bare package whose ``get_*`` accessors come from its own
``global_vars`` (what that ``__init__`` re-exports); the tokenizer and argument code are
Megatron's, unchanged.
"""

import importlib
import json
import os
import random
import runpy
import sys
import types
from pathlib import Path

from megalith.config import TokenizerConfig
from preprocessing.tokenizer import train_tokenizer

HERE = Path(__file__).resolve().parent
WORDS = [
    "the",
    "a",
    "model",
    "token",
    "shard",
    "corpus",
    "tensor",
    "layer",
    "gradient",
    "optimizer",
    "data",
    "batch",
    "learning",
    "rate",
    "warmup",
    "cosine",
    "schedule",
    "attention",
    "head",
    "embedding",
    "vocabulary",
    "byte",
    "merge",
    "piece",
    "café",
    "naïve",
    "東京",
    "数据",
    "Ω",
    "≈",
    "42",
    "3.14",
    "--",
    "(parenthesis)",
    "«quote»",
    "emoji",
    "🙂",
]


def documents() -> list[str]:
    rng = random.Random(0)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))).capitalize() + "."
        for _ in range(60)
    ]


def main() -> None:
    texts = documents()
    with open(HERE / "corpus.jsonl", "w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    config = TokenizerConfig(vocab_size=400, pad_vocab_multiple=64)
    train_tokenizer(texts, config, str(HERE / "tokenizer"))
    (HERE / "tokenizer.vocab").unlink()

    megatron = os.environ["MEGATRON_LM"]
    sys.path.insert(0, megatron)
    training = types.ModuleType("megatron.training")
    training.__path__ = [os.path.join(megatron, "megatron", "training")]
    sys.modules["megatron.training"] = training
    global_vars = importlib.import_module("megatron.training.global_vars")
    for name in dir(global_vars):
        if name.startswith("get_"):
            setattr(training, name, getattr(global_vars, name))
    os.chdir(HERE)
    sys.argv = [
        "preprocess_data.py",
        *("--input", "corpus.jsonl", "--output-prefix", "megatron"),
        *("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "tokenizer.model"),
        *("--append-eod", "--workers", "1"),
    ]
    runpy.run_path(os.path.join(megatron, "tools", "preprocess_data.py"), run_name="__main__")


if __name__ == "__main__":
    main()
