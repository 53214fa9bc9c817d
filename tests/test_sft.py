"""Supervised fine-tuning data and loss: chat records, the template and its loss mask,
``data prepare --format chat`` (mask shards, resume), packing with per-document attention
and positions, the assistant-only loss, and a real Trainer run on the shipped chat sample.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from parallel_helpers import init_gloo

from megalith.config import DataConfig, ModelConfig, TokenizerConfig, load_config
from megalith.errors import MegalithError
from preprocessing.chat import RESERVED, generation_prompt, render
from preprocessing.chat_generator import write_chat_corpus
from preprocessing.indexed_dataset import IndexedDatasetReader
from preprocessing.manifest import read_manifest
from preprocessing.prepare import prepare_dataset
from preprocessing.readers import BadRecordError
from preprocessing.tokenizer import Tokenizer, train_tokenizer
from preprocessing.verify import verify_shard_set
from training.data import build_gpt_datasets
from training.data.sft_dataset import SFTDataset
from training.data.shard_set import ShardSetError, open_shard_set
from training.metrics.run_logger import read_metrics
from training.models import GPTModel, TorchBackend
from training.models.packing import document_positions
from training.models.tp_backend import TensorParallelBackend
from training.objectives.sft import micro_batch_loss
from training.parallel.groups import ParallelSizes
from training.parallel.support import check_trainer_support
from training.parallel.tensor_parallel import shard_full_state_dict
from training.trainer import train

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "preprocessing" / "sample_corpus" / "chat.jsonl"
RECIPE = REPO / "configs" / "sft-tiny-cpu.yaml"
SEQ = 128

TINY_CHAT = [
    {
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is one plus one?"},
            {"role": "assistant", "content": "One plus one is two."},
            {"role": "user", "content": "And two plus two?"},
            {"role": "assistant", "content": "Four."},
        ]
    },
    {"prompt": "What color is a banana?", "response": "A banana is yellow.", "system": "Teach."},
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """512 pieces trained on the shipped chat sample's contents."""
    from preprocessing.chat import conversation_contents
    from preprocessing.corpus import Corpus

    corpus = Corpus.open(DataConfig(inputs=[str(CHAT)], format="chat"))
    texts = list(conversation_contents(corpus.documents()))
    prefix = tmp_path_factory.mktemp("tokenizer") / "chat"
    return train_tokenizer(texts, TokenizerConfig(vocab_size=512), str(prefix))


def prepare(inputs: list[Path], output: Path, tokenizer: Tokenizer, **values):
    data = DataConfig(
        inputs=[str(p) for p in inputs], output=str(output), format="chat", workers=1, **values
    )
    return prepare_dataset(data, tokenizer, show_progress=False)


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    """The shipped chat sample as a chat shard set (2 shards)."""
    output = tmp_path_factory.mktemp("chat") / "shards"
    prepare([CHAT], output, tokenizer, shards=2)
    return output


# --- records and template ---------------------------------------------------------------


def test_template_masks_exactly_the_assistant_turns(tmp_path: Path, tokenizer: Tokenizer) -> None:
    source = write_jsonl(tmp_path / "tiny.jsonl", TINY_CHAT)
    report = prepare([source], tmp_path / "out", tokenizer)
    manifest = report.manifest
    assert manifest.data_format == "chat" and manifest.documents == 3
    assert set(manifest.shards[0].files) == {
        "shard-00000.bin",
        "shard-00000.idx",
        "shard-00000.mask.bin",
        "shard-00000.mask.idx",
    }
    tokens = IndexedDatasetReader(str(tmp_path / "out" / "shard-00000"))
    masks = IndexedDatasetReader(str(tmp_path / "out" / "shard-00000.mask"))
    assert masks.dtype == np.uint8
    end = tokenizer.special_ids["<|end|>"]
    for index, record in enumerate(TINY_CHAT):
        messages = record.get("messages") or [
            {"role": "system", "content": record["system"]},
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        ids, mask = tokens[index].tolist(), masks[index].tolist()
        assert (ids, mask) == render(tokenizer, messages)
        # What the loss sees: each answer followed by <|end|>, nothing else.
        learned = [t for t, m in zip(ids, mask, strict=True) if m]
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        expected = [t for a in answers for t in [*tokenizer.encode(a), end]]
        assert learned == expected
        turns = np.split(np.asarray(learned), np.flatnonzero(np.asarray(learned) == end) + 1)
        assert [tokenizer.decode(t[:-1].tolist()) for t in turns[:-1]] == answers
        # Every turn opens with its role token and closes with <|end|>.
        roles = [tokenizer.id_to_piece(t) for t in ids if tokenizer.id_to_piece(t) in RESERVED]
        assert roles == [p for m in messages for p in (f"<|{m['role']}|>", "<|end|>")]


def test_a_generation_prompt_ends_with_the_assistant_marker(tokenizer: Tokenizer) -> None:
    messages = TINY_CHAT[1]["messages"][:4]  # ends with a user turn
    prompt, stop = generation_prompt(tokenizer, messages)
    full, _ = render(tokenizer, [*messages, {"role": "assistant", "content": "Four."}])
    assert full[: len(prompt)] == prompt  # training rendered the answer right after it
    assert full[-1] == stop == tokenizer.special_ids["<|end|>"]


BAD_LINES = [
    ({"messages": []}, "messages: is empty", "empty_text"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role: is 'bot'", "invalid_chat"),
    (
        {"messages": [{"role": "user", "content": "x"}]},
        "messages: has no assistant turn",
        "invalid_chat",
    ),
    (
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 7}]},
        "messages[1].content: is a number, not a string",
        "not_a_string",
    ),
    ({"prompt": "q"}, "response: is missing", "missing_field"),
    (
        {"prompt": "q <|user|> x", "response": "a"},
        "prompt: contains the reserved token '<|user|>'",
        "invalid_chat",
    ),
    ("{not json", "malformed JSON", "malformed_json"),
]


@pytest.mark.parametrize(("record", "message", "reason"), BAD_LINES)
def test_a_bad_record_names_the_file_line_and_key(
    tmp_path: Path, tokenizer: Tokenizer, record, message: str, reason: str
) -> None:
    source = write_jsonl(tmp_path / "chat.jsonl", [TINY_CHAT[0], TINY_CHAT[2], record])
    with pytest.raises(BadRecordError) as failure:
        prepare([source], tmp_path / "fail", tokenizer)
    assert str(failure.value).startswith(f"{source}:3: ")
    assert message in str(failure.value)
    skipped = prepare([source], tmp_path / "skip", tokenizer, on_bad_record="skip").manifest
    assert skipped.documents == 2
    assert skipped.rejected.counts == {reason: 1}
    assert skipped.rejected.examples[0]["location"] == f"{source}:3"


def test_a_tokenizer_without_role_tokens_is_refused(tmp_path: Path) -> None:
    texts = [m["content"] for r in TINY_CHAT[:2] for m in r["messages"]] * 20
    bare = train_tokenizer(
        texts, TokenizerConfig(vocab_size=300, special_tokens=["<|eod|>"]), str(tmp_path / "t")
    )
    with pytest.raises(MegalithError, match=r"lacks the chat template tokens"):
        prepare([write_jsonl(tmp_path / "c.jsonl", TINY_CHAT)], tmp_path / "out", bare)


# --- preprocessing: resumable and atomic -------------------------------------------------


def test_prepare_resumes_and_redoes_a_shard_whose_mask_changed(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    output = tmp_path / "shards"
    first = prepare([CHAT], output, tokenizer, shards=2)
    assert first.written == ["shard-00000", "shard-00001"]
    hashes = {n: f.sha256 for s in first.manifest.shards for n, f in s.files.items()}
    again = prepare([CHAT], output, tokenizer, shards=2)
    assert again.skipped == ["shard-00000", "shard-00001"] and again.written == []

    # A damaged mask file makes its shard incomplete: the rerun rewrites it alone.
    mask = output / "shard-00001.mask.bin"
    mask.write_bytes(b"\x01" * mask.stat().st_size)
    third = prepare([CHAT], output, tokenizer, shards=2)
    assert third.skipped == ["shard-00000"] and third.written == ["shard-00001"]
    rewritten = {n: f.sha256 for s in third.manifest.shards for n, f in s.files.items()}
    assert rewritten == hashes
    assert verify_shard_set(str(output)) == []
    # Nothing half-written is left beside the shards (they are renamed into place).
    assert sorted(p.name for p in output.iterdir() if p.is_file()) == sorted(
        [*hashes, "manifest.json"]
    )


def test_shipped_chat_sample_matches_its_generator(tmp_path: Path) -> None:
    size = write_chat_corpus(tmp_path / "chat.jsonl", seed=0)
    assert (tmp_path / "chat.jsonl").read_bytes() == CHAT.read_bytes()
    assert size < 300_000
    assert sum(1 for _ in CHAT.open()) >= 300


# --- packing, attention and positions ------------------------------------------------------


def tiny_model_config(style: str) -> ModelConfig:
    return ModelConfig(
        style=style,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2 if style == "llama" else None,
        vocab_size=96,
        max_position_embeddings=32,
    )


def test_positions_restart_at_every_document() -> None:
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 3]])
    expected = [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 0, 1, 0]]
    assert document_positions(documents).tolist() == expected


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_a_packed_row_gives_the_logits_of_each_document_alone(style: str) -> None:
    torch.manual_seed(0)
    model = GPTModel(tiny_model_config(style)).eval()
    lengths = [[5, 9, 2], [12, 4]]
    rows, document_ids, alone = [], [], []
    for row_lengths in lengths:
        parts = [torch.randint(0, 96, (1, n)) for n in row_lengths]
        rows.append(torch.cat(parts, dim=1))
        document_ids.append(torch.cat([torch.full((n,), i) for i, n in enumerate(row_lengths)]))
        with torch.no_grad():
            alone.append(torch.cat([model(part) for part in parts], dim=1))
    with torch.no_grad():
        packed = model(torch.cat(rows), document_ids=torch.stack(document_ids))
        plain = model(torch.cat(rows))
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
    assert not torch.allclose(plain, torch.cat(alone), atol=1e-3)  # without ids, they mix


def _tensor_parallel_worker(rank: int, world: int, out_dir: str) -> None:
    """Per-token losses of packed rows: TP (with and without SP) against one process."""
    init_gloo(rank, world, out_dir)
    differences = {}
    try:
        for style, sequence_parallel in (("llama", True), ("gpt2", False)):
            torch.manual_seed(0)
            config = tiny_model_config(style)
            full = GPTModel(config, TorchBackend())
            tp = GPTModel(config, TensorParallelBackend(dist.group.WORLD, sequence_parallel))
            tp.load_state_dict(shard_full_state_dict(full.state_dict(), config, rank, world))
            tokens = torch.randint(0, 96, (2, 17))
            ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 12 + [1] * 4])
            args = (tokens[:, :-1],)
            kwargs = {"labels": tokens[:, 1:], "loss_reduction": "none", "document_ids": ids}
            with torch.no_grad():
                difference = (full(*args, **kwargs) - tp(*args, **kwargs)).abs().max()
            differences[f"{style} sp={sequence_parallel}"] = difference.item()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(differences))


def test_tensor_parallel_layers_take_the_document_ids(tmp_path: Path) -> None:
    mp.spawn(_tensor_parallel_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        differences = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(differences) == 2
        assert all(d < 1e-5 for d in differences.values()), (rank, differences)


def sft_dataset(shards: Path, num_samples: int, seed: int = 7) -> SFTDataset:
    shard_set = open_shard_set(str(shards))
    documents = range(0, shard_set.num_documents)
    return SFTDataset(shard_set, "train", documents, num_samples, SEQ, seed, shards / "cache")


def test_packed_samples_hold_whole_conversations_and_their_masks(chat_shards: Path) -> None:
    dataset = sft_dataset(chat_shards, 40)
    shard_set = dataset.shard_set
    seen = []
    for index in range(len(dataset)):
        item = dataset[index]
        tokens, mask, ids = item["tokens"], item["loss_mask"], item["document_ids"]
        assert tokens.shape == (SEQ + 1,) and mask.shape == ids.shape == (SEQ,)
        first, last = dataset.sample_bounds[index : index + 2]
        at = 0
        for number, document in enumerate(dataset.document_index[first:last].tolist()):
            length = min(int(shard_set.document_lengths[document]), SEQ + 1)  # truncated
            whole = shard_set.document_tokens(document, 0, length)
            assert tokens[at : at + length].tolist() == whole.tolist()  # never cut
            assert (ids[at : min(at + length, SEQ)] == number).all()
            labels_mask = shard_set.document_loss_mask(document, 1, length)
            assert mask[at : at + length - 1].tolist() == labels_mask.astype(float).tolist()
            seen.append(document)
            at += length
        assert not mask[at:].any()  # padding, and the label after each document's last token
    # Samples take the documents in packing order; an epoch is a permutation of them all.
    assert seen == dataset.document_index[: len(seen)].tolist()
    everything = list(range(shard_set.num_documents))
    assert sorted(dataset.document_index[: shard_set.num_documents].tolist()) == everything

    # Deterministic and resumable: more samples later extend the same sequence.
    longer = sft_dataset(chat_shards, 90)
    for index in (0, 17, 39):
        for key in ("tokens", "loss_mask", "document_ids"):
            assert torch.equal(longer[index][key], dataset[index][key])
    assert not torch.equal(sft_dataset(chat_shards, 40, seed=8)[0]["tokens"], dataset[0]["tokens"])


def assistant_loss_by_hand(
    model: GPTModel, samples: list[dict[str, torch.Tensor]]
) -> tuple[float, int]:
    """Each conversation of each packed sample alone: summed cross-entropy on its masked
    label positions, and their number."""
    total, count = 0.0, 0
    for sample in samples:
        tokens, mask, ids = (sample[k] for k in ("tokens", "loss_mask", "document_ids"))
        for document in ids.unique().tolist():
            where = (ids == document).nonzero().flatten()
            start, stop = int(where[0]), int(where[-1]) + 1
            logits = model(tokens[start:stop].unsqueeze(0))[0]
            losses = F.cross_entropy(logits, tokens[start + 1 : stop + 1], reduction="none")
            total += (losses * mask[start:stop]).sum().item()
            count += int(mask[start:stop].sum())
    return total, count


def test_loss_counts_assistant_tokens_only(chat_shards: Path) -> None:
    dataset = sft_dataset(chat_shards, 4)
    batch = {key: torch.stack([dataset[i][key] for i in range(4)]) for key in dataset[0]}
    torch.manual_seed(0)
    model = GPTModel(
        ModelConfig(num_layers=1, hidden_size=32, vocab_size=512, max_position_embeddings=SEQ)
    )
    loss = micro_batch_loss(model, batch, torch.device("cpu"), None)

    total, count = assistant_loss_by_hand(model, [dataset[i] for i in range(4)])
    assert count > 0
    assert loss.item() == pytest.approx(total / count, rel=1e-5)

    # The training form: the sum weighted by 1 / (the step's count of loss tokens).
    weighted = micro_batch_loss(model, batch, torch.device("cpu"), torch.tensor(1.0 / count))
    assert weighted.item() == pytest.approx(total / count, rel=1e-5)


def test_evaluation_scores_the_assistant_tokens_of_whole_conversations(chat_shards: Path) -> None:
    """The eval report's perplexity on chat data is the fine-tune's own loss: each
    conversation alone, assistant tokens only (what a promotion gate should compare)."""
    from evaluation.perplexity import evaluate_perplexity

    data = DataConfig(output=str(chat_shards), format="chat", seq_length=SEQ, split=(50, 50, 0))
    torch.manual_seed(0)
    model = GPTModel(
        ModelConfig(num_layers=1, hidden_size=32, vocab_size=512, max_position_embeddings=SEQ)
    ).eval()
    result = evaluate_perplexity(model, data, split="valid", max_samples=4, batch_size=2)

    valid = build_gpt_datasets(data, (0, 4, 0))[1]
    with torch.no_grad():
        total, count = assistant_loss_by_hand(model, [valid[i] for i in range(4)])
    assert (result.samples, result.tokens, result.scored) == (4, count, "assistant tokens")
    assert result.loss == pytest.approx(total / count, rel=1e-5)


# --- config, trainer -----------------------------------------------------------------------


def test_chat_training_takes_every_layout_and_refuses_a_pretrain_shard_set(
    chat_shards: Path, shards: Path
) -> None:
    config = load_config(RECIPE, [f"data.output={chat_shards}"])
    check_trainer_support(config, ParallelSizes(tp=2, dp=2))  # TP and DP are fine
    check_trainer_support(config, ParallelSizes(pp=2))  # and pipeline stages
    check_trainer_support(config, ParallelSizes(cp=2, pp=2))  # and context parallelism
    pretrain_shards = load_config(RECIPE, [f"data.output={shards}"])
    with pytest.raises(ShardSetError, match=r"prepared with data.format=pretrain"):
        build_gpt_datasets(pretrain_shards.data, (8, 0, 0))
    assert read_manifest(str(chat_shards)).data_format == "chat"


def test_a_short_sft_run_lowers_the_assistant_token_loss(chat_shards: Path, tmp_path: Path) -> None:
    settings = {
        "data.output": chat_shards,
        "data.seq_length": SEQ,
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.ffn_hidden_size": 128,
        "model.max_position_embeddings": SEQ,
        "training.micro_batch_size": 4,
        "training.global_batch_size": 8,  # two micro-batches: the global token mean
        "training.train_iters": 30,
        "training.eval_interval": 15,
        "training.log_interval": 1,
        "scheduler.warmup_iters": 3,
        "checkpoint.interval": 0,
        "logging.mlflow": "false",
    }
    config = load_config(RECIPE, [f"{k}={v}" for k, v in settings.items()])
    result = train(config, tmp_path, show_progress=False)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    loss = [r["loss"] for r in metrics]
    assert len(loss) == 30 and all(math.isfinite(v) for v in loss)
    assert loss[0] == pytest.approx(math.log(512), abs=0.5)  # uniform guesses at first
    assert sum(loss[-5:]) / 5 < loss[0] - 2.0
    val = [r["val_loss"] for r in metrics if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0]
    assert result.val_loss == val[-1]


def test_parallel_fine_tuning_matches_one_process_and_resumes_exactly(
    chat_shards: Path, tmp_path: Path
) -> None:
    """One torchrun job of 2 processes (gloo) and one of 4 (PP=2 x CP=2, and PP=2 x DP=2
    with FSDP over the stages), each layout
    through ``Trainer.fit`` for STEPS steps against one process: DP=2 (DDP and ZeRO-1),
    CP=2, where each rank's
    micro-batches hold different numbers of assistant tokens, so only the step-wide count
    gives one process's losses and gradients (a per-rank mean would not); and TP=2 with
    and without sequence parallelism (packed rows with document ids, the masked loss over
    a vocab-parallel softmax). Per step: losses, validation losses and grad norms within
    LOSS_ATOL / 1e-4 relative; the final checkpoint's whole weights and AdamW moments
    within rtol 1e-4 and atol 1e-5 (DP) or 1e-4 (TP: its partial sums in another order
    give last-bit gradient differences that Adam's m / sqrt(v) turns into up to ~1e-5
    on near-zero-gradient embedding rows; 1e-4 is 3% of one step's lr 3e-3). Each layout
    stopped at RESUME_STEP and resumed repeats its uninterrupted run step by step: equal
    losses and bit-equal final weights and moments."""
    from parallel_helpers import (
        RESUME_STEP,
        STEPS,
        assert_close_tensors,
        assert_metrics_match,
        assert_resume_exact,
        fit_one_process,
        last_checkpoint_state,
        metrics,
        run_trainer_worker,
        trainer_settings,
    )

    from training.checkpoint.sharded_reader import read_global_tensors

    settings = trainer_settings(
        chat_shards,
        {"data.format": "chat", "data.seq_length": 64, "model.max_position_embeddings": 64},
    )
    reference = fit_one_process(settings, tmp_path / "one")
    cases = {
        "ddp": settings,
        "zero1": {**settings, "parallel.data_parallel_mode": "distributed_optimizer"},
        "tp2": {**settings, "parallel.tensor": 2},
        "tp2-sp": {**settings, "parallel.tensor": 2, "parallel.sequence_parallel": "true"},
        "pp2": {**settings, "parallel.pipeline": 2},
        "cp2": {**settings, "parallel.context": 2},
    }
    run_trainer_worker(tmp_path, cases, world=2, label="SFT, 2 processes")
    four = {
        "pp2-cp2": {**settings, "parallel.pipeline": 2, "parallel.context": 2},
        "pp2-dp2-fsdp": {
            **settings,
            "parallel.pipeline": 2,
            "parallel.data_parallel_mode": "fsdp",
        },
    }
    run_trainer_worker(tmp_path, four, world=4, label="SFT, 4 processes")
    cases.update(four)
    last = f"checkpoints/step-{STEPS:08d}"
    for layout in cases:
        name = f"SFT {layout}"
        run, resumed = tmp_path / layout, tmp_path / f"{layout}-resumed"
        assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
        assert_metrics_match(metrics(run), metrics(reference), name)
        assert_close_tensors(
            read_global_tensors(run / last),
            read_global_tensors(reference / last),
            f"{name} step {STEPS} checkpoint",
            atol=1e-4 if "parallel.tensor" in cases[layout] else 1e-5,
        )
        layout_of_run = last_checkpoint_state(run)["layout"]
        want = [
            cases[layout].get(f"parallel.{key}", 1) for key in ("tensor", "pipeline", "context")
        ]
        got = [
            layout_of_run[f"parallel.{key}"] for key in ("tensor", "pipeline", "context", "data")
        ]
        world = 4 if layout in four else 2
        assert got == [*want, world // math.prod(want)], f"{name} ran as {got}"
        assert_resume_exact(run, resumed, f"{name} resumed at step {RESUME_STEP}")
        assert_close_tensors(
            read_global_tensors(resumed / last),
            read_global_tensors(run / last),
            f"{name} resumed at step {RESUME_STEP}, step {STEPS} checkpoint",
            rtol=0,
            atol=0,
        )
