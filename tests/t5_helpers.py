"""Shared by the T5 tests: the sample corpus as shards whose tokenizer has sentinels,
built once per pytest session, and span un-corruption (the inverse of the dataset)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
T5_RECIPE = REPO / "configs" / "t5-tiny-cpu.yaml"
CHAT = REPO / "preprocessing" / "sample_corpus" / "chat.jsonl"
SENTINELS = 16


def t5_shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus as shards with a 1024-piece tokenizer holding 16 sentinels."""
    from parallel_helpers import tiny_shard_set

    return tiny_shard_set(
        tmp_path_factory, "megalith-t5-shards", (f"tokenizer.sentinel_tokens={SENTINELS}",)
    )


def uncorrupt(encoder: np.ndarray, targets: np.ndarray, sentinels: list[int]) -> np.ndarray:
    """The raw window back from an encoder input and its targets (EOS and padding cut)."""
    spans: dict[int, list[int]] = {}
    current = None
    for token in targets.tolist():
        if token in sentinels:
            current = sentinels.index(token)
            spans[current] = []
        else:
            spans[current].append(token)
    out: list[int] = []
    for token in encoder.tolist():
        out.extend(spans[sentinels.index(token)] if token in sentinels else [token])
    return np.asarray(out, dtype=np.int64)


def t5_settings(shards: Path, values: dict | None = None) -> dict:
    """configs/t5-tiny-cpu.yaml shrunk: 2+2 layers, hidden 32, 32 encoder tokens, 4 steps
    with a checkpoint every 2 and validation every 2; fp32 on CPU; AdamW eps 1e-6; tracking off."""
    from parallel_helpers import DEVICE, RESUME_STEP, STEPS

    return {
        "data.output": str(shards),
        "data.seq_length": 32,
        "model.num_layers": 2,
        "model.num_decoder_layers": 2,
        "model.hidden_size": 32,
        "model.num_attention_heads": 4,
        "model.ffn_hidden_size": 64,
        "training.micro_batch_size": 2,
        "training.global_batch_size": 8,
        "training.train_iters": STEPS,
        "training.eval_interval": 2,
        "training.eval_iters": 2,
        "training.device": DEVICE,
        "mixed_precision.dtype": "fp32",
        "scheduler.warmup_iters": 1,
        # Above fp32 rounding: AdamW would otherwise normalize gradients of ~1e-9 (an
        # embedding row whose gradient cancels to rounding noise) into full-size steps,
        # and layouts that only sum in another order would differ by 1e-5 after 4 steps.
        "optimizer.eps": 1e-6,
        "checkpoint.interval": RESUME_STEP,
        "checkpoint.keep_last": 3,
        "checkpoint.async_save": "false",
        "logging.mlflow": "false",
        **(values or {}),
    }


def t5_config(settings: dict):
    from megalith.config import load_config

    return load_config(T5_RECIPE, [f"{k}={v}" for k, v in settings.items()])


def t5_chat_shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped chat sample as a chat shard set (90/10 split) with a 512-piece tokenizer
    trained on its contents (<|pad|> and the chat template's tokens: the defaults), built
    once per session."""
    import fcntl

    from megalith.config import DataConfig, TokenizerConfig
    from preprocessing.chat import conversation_contents
    from preprocessing.corpus import Corpus
    from preprocessing.prepare import prepare_dataset
    from preprocessing.tokenizer import train_tokenizer

    root = tmp_path_factory.getbasetemp() / "megalith-t5-chat-shards"
    root.mkdir(exist_ok=True)
    output = root / "shards"
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (output / "manifest.json").exists():
            corpus = Corpus.open(DataConfig(inputs=[str(CHAT)], format="chat"))
            texts = list(conversation_contents(corpus.documents()))
            tokenizer = train_tokenizer(
                texts, TokenizerConfig(vocab_size=512), str(root / "tokenizer")
            )
            data = DataConfig(
                inputs=[str(CHAT)], output=str(output), format="chat", workers=1,
                split=[0.9, 0.1, 0.0],
            )  # fmt: skip
            prepare_dataset(data, tokenizer, show_progress=False)
    return output
