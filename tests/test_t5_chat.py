"""Chat fine-tuning of a T5 (``model.family: t5``, ``data.format: chat``): one sample per
assistant turn (the conversation before it to the encoder, the turn to the decoder), the
loss weighed per answer token across the step, a real Trainer run on the shipped chat
sample, and its package answering chats through ``megalith serve`` and the OpenAI client.
Data- and pipeline-parallel parity: tests/test_t5_training.py (``chat-dp2``, ``chat-pp2``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from t5_helpers import t5_chat_shard_set

from megalith.config import DataConfig, load_config
from preprocessing.chat import conversation_from_record, generation_prompt, render
from preprocessing.prepare import prepare_dataset
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from training.data.t5_chat_dataset import (
    T5ChatDataset,
    assistant_turns,
    build_t5_chat_datasets,
    chat_lengths,
)
from training.data.t5_dataset import IGNORE_INDEX
from training.metrics.run_logger import read_metrics
from training.objectives.t5 import chat_micro_batch_loss
from training.trainer import train

REPO = Path(__file__).resolve().parents[1]
T5_RECIPE = REPO / "configs" / "t5-tiny-cpu.yaml"
T5_CHAT_RECIPE = REPO / "configs" / "t5-sft-tiny-cpu.yaml"

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is one plus one?"},
            {"role": "assistant", "content": "One plus one is two."},
            {"role": "user", "content": "And two plus two?"},
            {"role": "assistant", "content": "Four."},
        ]
    },
    {"prompt": "What color is a banana?", "response": "A banana is yellow."},
    {
        "messages": [
            {"role": "user", "content": "Say nothing."},
            {"role": "assistant", "content": ""},  # the turn is its <|end|> alone
        ]
    },
]


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped chat sample as chat shards (t5_helpers, shared with test_t5_training)."""
    return t5_chat_shard_set(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(chat_shards: Path) -> Tokenizer:
    """Their 512-piece tokenizer (with <|pad|> and the chat template's tokens)."""
    return load_tokenizer(str(chat_shards.parent / "tokenizer.model"))


def prepare(inputs: list[Path], output: Path, tokenizer: Tokenizer, **values) -> Path:
    data = DataConfig(
        inputs=[str(p) for p in inputs], output=str(output), format="chat", workers=1, **values
    )
    prepare_dataset(data, tokenizer, show_progress=False)
    return output


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """CONVERSATIONS as a chat shard set, every conversation in the train split."""
    folder = tmp_path_factory.mktemp("t5-tiny-chat")
    records = folder / "chat.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    return prepare([records], folder / "shards", tokenizer, split=[1.0, 0.0, 0.0])


def chat_data(shards: Path, seq_length: int = 64, **lengths: int) -> DataConfig:
    return DataConfig(
        output=str(shards),
        format="chat",
        seq_length=seq_length,
        span_corruption={**lengths},
    )


def expected_turns(tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(encoder input, targets) of every assistant turn, from the template itself: the
    generation prompt of the messages before the turn, then EOS; the turn's content and
    its <|end|>."""
    turns = []
    for record in CONVERSATIONS:
        messages = conversation_from_record(record)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, end = generation_prompt(tokenizer, messages[:k])
            answer = [*tokenizer.encode(message["content"]), end]
            turns.append(([*prompt, tokenizer.eod_id], answer))
    return turns


def unpadded(item: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    encoder = item["encoder_tokens"][item["encoder_mask"]].tolist()
    labels = item["labels"][item["labels"] != IGNORE_INDEX].tolist()
    return encoder, labels


def test_loss_mask_runs_are_the_assistant_turns(tokenizer: Tokenizer) -> None:
    messages = conversation_from_record(CONVERSATIONS[0])
    tokens, mask = render(tokenizer, messages)
    spans = assistant_turns(np.asarray(mask, dtype=np.uint8))
    answers = [[*tokenizer.encode(m["content"]), tokens[-1]] for m in messages[2::2]]
    assert [tokens[a:b] for a, b in spans.tolist()] == answers
    assert assistant_turns(np.zeros(4, dtype=np.uint8)).shape == (0, 2)


def test_each_sample_is_one_assistant_turn_after_its_conversation(
    tiny_chat: Path, tokenizer: Tokenizer
) -> None:
    """An epoch holds every assistant turn once: the encoder reads what a served chat
    prompt holds (template, <|assistant|>, EOS), the decoder predicts the turn and its
    <|end|> behind the pad id; the loss mask marks exactly the labels."""
    turns = expected_turns(tokenizer)
    train_split, _, _ = build_t5_chat_datasets(chat_data(tiny_chat), (2 * len(turns), 0, 0))
    assert isinstance(train_split, T5ChatDataset)
    items = [train_split[i] for i in range(2 * len(turns))]
    for epoch in (items[: len(turns)], items[len(turns) :]):
        assert sorted(unpadded(item) for item in epoch) == sorted(turns)
    assert [unpadded(i) for i in items[: len(turns)]] != [unpadded(i) for i in items[len(turns) :]]
    for item in items:
        labels = item["labels"]
        answer = labels[labels != IGNORE_INDEX]
        decoder = item["decoder_tokens"]
        assert decoder[0] == tokenizer.pad_id and torch.equal(
            decoder[1 : answer.numel()], answer[:-1]
        )
        assert torch.equal(item["loss_mask"], (labels != IGNORE_INDEX).float())
        assert item["encoder_tokens"].shape == (64,) and labels.shape == (64,)
    again, _, _ = build_t5_chat_datasets(chat_data(tiny_chat), (2 * len(turns), 0, 0))
    for index in (0, len(turns) + 1):
        assert all(torch.equal(again[index][k], items[index][k]) for k in items[index])


def test_long_contexts_keep_their_end_and_long_answers_their_start(
    tiny_chat: Path, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """S = 8, T = 3: a context keeps its last 7 tokens (so the turn's <|assistant|> stays
    next to EOS), an answer its first 3; both counts are logged."""
    turns = expected_turns(tokenizer)
    data = chat_data(tiny_chat, encoder_length=8, decoder_length=3)
    assert chat_lengths(data).encoder == 8 and chat_lengths(data).decoder == 3
    with caplog.at_level("WARNING"):
        dataset = build_t5_chat_datasets(data, (len(turns), 0, 0))[0]
    assert "have more context than the encoder's 7 tokens" in caplog.text
    cut = sorted(([*e[:-1][-7:], e[-1]], t[:3]) for e, t in turns)
    assert sorted(unpadded(dataset[i]) for i in range(len(turns))) == cut


def test_the_loss_weighs_every_answer_token_the_same(tiny_chat: Path) -> None:
    """With the step's token weight the micro-batch loss is its target-token losses'
    sum times the weight; without, their mean: not the mean of per-sample means."""
    from training.models import T5Model

    dataset = build_t5_chat_datasets(chat_data(tiny_chat, seq_length=32), (4, 0, 0))[0]
    batch = {k: torch.stack([dataset[i][k] for i in range(4)]) for k in dataset[0]}
    config = load_config(
        T5_RECIPE,
        ["model.num_layers=1", "model.num_decoder_layers=1", "model.hidden_size=32",
         "model.num_attention_heads=2", "model.ffn_hidden_size=64", "model.vocab_size=512"],
    ).model  # fmt: skip
    torch.manual_seed(0)
    model = T5Model(config)
    labels = batch["labels"]
    per_token = model(
        batch["encoder_tokens"], batch["decoder_tokens"], labels,
        encoder_mask=batch["encoder_mask"], loss_reduction="none",
    )  # fmt: skip
    scored = labels != IGNORE_INDEX
    mean = per_token[scored].mean()
    got = chat_micro_batch_loss(model, batch, torch.device("cpu"), None)
    torch.testing.assert_close(got, mean)
    per_sample = torch.stack([per_token[i][scored[i]].mean() for i in range(4)]).mean()
    assert abs(per_sample - mean) > 1e-3  # answers differ in length: the choice matters
    weight = torch.tensor(0.25)
    weighed = chat_micro_batch_loss(model, batch, torch.device("cpu"), weight)
    torch.testing.assert_close(weighed, per_token[scored].sum() * weight)


def t5_chat_settings(shards: Path) -> dict:
    """configs/t5-sft-tiny-cpu.yaml for 30 steps on 64-token contexts (validation at 15
    and 30), no tracking."""
    return {
        "data.output": str(shards),
        "data.seq_length": 64,
        "training.train_iters": 30,
        "training.eval_interval": 15,
        "training.log_interval": 1,
        "checkpoint.interval": 0,
        "logging.mlflow": "false",
    }


def test_a_t5_chat_fine_tune_learns_and_its_package_answers_chats(
    chat_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """30 steps of the T5 chat recipe on the shipped chat sample lower the answer-token loss (train and
    validation); the package then answers ``/v1/chat`` and the OpenAI client's chat
    completions with what the model generates for the templated prompt and EOS, stopping
    at <|end|>."""
    import httpx
    import openai
    from test_serving import megalith_serve

    from training.inference.decode import SamplingConfig
    from training.inference.decode_t5 import generate_seq2seq_ids
    from training.inference.loading import load_served_model

    folder = tmp_path_factory.mktemp("t5-chat-run")
    settings = t5_chat_settings(chat_shards)
    config = load_config(T5_CHAT_RECIPE, [f"{k}={v}" for k, v in settings.items()])
    result = train(config, folder / "run", show_progress=False)
    metrics = read_metrics(folder / "run" / "metrics.jsonl")
    loss = [r["loss"] for r in metrics]
    assert len(loss) == 30 and all(math.isfinite(v) for v in loss)
    assert loss[0] == pytest.approx(math.log(512), abs=0.7)  # uniform guesses at first
    assert sum(loss[-5:]) / 5 < loss[0] - 2.0
    val = [r["val_loss"] for r in metrics if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0] and result.val_loss == val[-1]

    served = load_served_model(str(folder / "run" / "model"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt, end = generation_prompt(served.tokenizer, messages)
    [(ids, _)] = generate_seq2seq_ids(
        served.model,
        [[*prompt, served.tokenizer.eod_id]],
        SamplingConfig(max_new_tokens=16, temperature=0.0, stop_ids=(end,)),
        pad_id=served.tokenizer.pad_id,
        eod_id=served.tokenizer.eod_id,
        vocab_size=served.tokenizer.vocab_size,
    )
    expected = served.tokenizer.decode(ids)
    assert expected.strip()  # the fine-tune answers something
    with megalith_serve(folder / "run" / "model", "127.0.0.1", None, folder / "serve.log") as url:
        body = {"messages": messages, "max_tokens": 16, "temperature": 0}
        with httpx.Client(base_url=url, timeout=60) as client:
            answer = client.post("/v1/chat", json=body).json()
        assert answer["text"] == expected
        assert answer["prompt_tokens"] == len(prompt) + 1
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
            completion = client.chat.completions.create(model="model", **body)
        assert completion.choices[0].message.content == expected
