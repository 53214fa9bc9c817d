"""Evaluation: perplexity, multiple-choice scoring, generation with a KV cache, the CLI.

A tiny model (random weights) and a tiny shard set, prepared from a slice of the
sample corpus with its own 512-piece tokenizer, are built once per module.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dtype_probe import module_output_dtypes
from torch import nn

from evaluation import EvaluationError
from evaluation import cli as eval_cli
from evaluation.perplexity import evaluate_perplexity, split_capacity
from evaluation.tasks import (
    SAMPLE_TASK,
    ChoiceScore,
    Item,
    TaskFileError,
    accuracies,
    load_task,
    sample_task_lines,
    score_choices,
)
from megalith.config import DataConfig, ModelConfig, load_config
from preprocessing import corpus_generator
from preprocessing.stage import run_tokenize_stage
from preprocessing.tokenizer import Tokenizer, load_tokenizer
from training.data import build_gpt_datasets
from training.inference.decode import (
    RowStream,
    SamplingConfig,
    exponential_noise,
    exponential_of_bits,
    filter_logits,
    generate,
    next_tokens,
    stream_bits,
)
from training.models.gpt import GPTModel
from training.models.package import save_model_package

CORPUS = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"
SEQ = 32
MAX_POSITIONS = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    root = tmp_path_factory.mktemp("eval-data")
    corpus = root / "stories.jsonl"
    corpus.write_text("".join(CORPUS.read_text(encoding="utf-8").splitlines(True)[:200]))
    config = load_config(
        None,
        [],
        {
            "data.inputs": [str(corpus)],
            "data.output": str(root / "shards"),
            "data.workers": 1,
            "data.split": [0.8, 0.1, 0.1],
            "data.seq_length": SEQ,
            "tokenizer.vocab_size": 512,
        },
    )
    run_tokenize_stage(config, show_progress=False)
    return config.data


@pytest.fixture(scope="module")
def tokenizer(shards: DataConfig) -> Tokenizer:
    return load_tokenizer(str(Path(shards.output) / "tokenizer.model"))


def tiny_model(tokenizer: Tokenizer, style: str = "llama", seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    config = ModelConfig(
        style=style,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=tokenizer.padded_vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        init_std=0.3,  # peaked next-token distributions: no near-ties for greedy decoding
        backend="torch",
    )
    return GPTModel(config).eval()


@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> GPTModel:
    return tiny_model(tokenizer)


@pytest.fixture(scope="module")
def package(
    model: GPTModel, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("eval-package") / "model"
    return save_model_package(model, model.config, tokenizer.model_path, out)


# --- perplexity -----------------------------------------------------------------------


def test_perplexity_is_exp_of_mean_token_cross_entropy(model: GPTModel, shards: DataConfig) -> None:
    result = evaluate_perplexity(model, shards, split="valid", max_samples=5, batch_size=2)
    _, valid, _ = build_gpt_datasets(shards, (0, 5, 0))
    tokens = torch.stack([valid[i]["tokens"] for i in range(5)])
    with torch.no_grad():
        logits = model(tokens[:, :-1]).double()
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    assert (result.samples, result.tokens) == (5, 5 * SEQ)
    assert result.loss == pytest.approx(expected.item(), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected.item()), rel=1e-5)


def test_perplexity_reads_at_most_one_epoch_of_the_split(
    model: GPTModel, shards: DataConfig
) -> None:
    capacity = split_capacity(shards, "test")
    result = evaluate_perplexity(model, shards, split="test", max_samples=10_000, batch_size=16)
    assert 1 < result.samples == capacity < 10_000


def test_perplexity_refuses_data_from_another_tokenizer(
    model: GPTModel, shards: DataConfig
) -> None:
    with pytest.raises(EvaluationError, match="tokenized with tokenizer"):
        evaluate_perplexity(model, shards, tokenizer_id="0" * 64)
    too_long = shards.model_copy(update={"seq_length": MAX_POSITIONS + 1})
    with pytest.raises(EvaluationError, match="max_position_embeddings"):
        evaluate_perplexity(model, too_long)


# --- multiple choice ------------------------------------------------------------------

ITEMS = [
    Item("The capital of Valdoria is", (" Mirelle", " Pellan", " Quillon"), 0),
    Item("The horse says", (" neigh", " moo"), 1),
    Item("Five plus one is", (" six", " seven", " four", " five"), 2),
    Item("Tara has", (" a frog named Pebble", " a cat"), 0),
]


def brute_force_logliks(model: GPTModel, tokenizer: Tokenizer, item: Item) -> list[float]:
    """One unbatched forward per choice, log-softmax by hand."""
    context = tokenizer.encode(item.context)
    values = []
    for choice in item.choices:
        whole = tokenizer.encode(item.context + choice)
        assert whole[: len(context)] == context  # these contexts tokenize stably
        tokens = torch.tensor([[tokenizer.eod_id, *whole]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(tokens[:, :-1]).double(), dim=-1)[0]
        targets = tokens[0, 1:]
        per_token = logprobs[torch.arange(targets.numel()), targets]
        values.append(per_token[len(context) :].sum().item())
    return values


def test_choice_scores_match_one_forward_per_choice(model: GPTModel, tokenizer: Tokenizer) -> None:
    scores = score_choices(model, tokenizer, ITEMS, batch_size=3)  # batches mix lengths
    for item, item_scores in zip(ITEMS, scores, strict=True):
        expected = brute_force_logliks(model, tokenizer, item)
        assert [s.loglik for s in item_scores] == pytest.approx(expected, abs=1e-4)
        assert [s.chars for s in item_scores] == [len(c) for c in item.choices]


def test_accuracy_follows_the_highest_loglikelihood(model: GPTModel, tokenizer: Tokenizer) -> None:
    logliks = [brute_force_logliks(model, tokenizer, it) for it in ITEMS]
    best = [values.index(max(values)) for values in logliks]
    worst = [values.index(min(values)) for values in logliks]
    right = [Item(it.context, it.choices, b) for it, b in zip(ITEMS, best, strict=True)]
    wrong = [Item(it.context, it.choices, w) for it, w in zip(ITEMS, worst, strict=True)]
    mixed = right[:1] + wrong[1:]
    assert accuracies(right, score_choices(model, tokenizer, right))["acc"] == 1.0
    assert accuracies(wrong, score_choices(model, tokenizer, wrong))["acc"] == 0.0
    assert accuracies(mixed, score_choices(model, tokenizer, mixed))["acc"] == 0.25


def test_acc_norm_divides_by_characters_and_acc_per_token_by_tokens() -> None:
    items = [Item("q", (" a", " bbbbbbbb"), 1), Item("q", (" a", " bb"), 0)]
    scores = [
        # sum prefers " a"; per character " bbbbbbbb" (-0.33 vs -1); per token " a" (-2 vs -3)
        [ChoiceScore(-2.0, tokens=1, chars=2), ChoiceScore(-3.0, tokens=1, chars=9)],
        # a tie on the sum goes to the first choice; per character and per token the second
        [ChoiceScore(-4.0, tokens=1, chars=2), ChoiceScore(-4.0, tokens=2, chars=3)],
    ]
    assert accuracies(items, scores) == {"acc": 0.5, "acc_norm": 0.5, "acc_per_token": 0.0}


def test_task_file_errors_name_file_and_line(tmp_path: Path) -> None:
    good = {"context": "The horse says", "choices": [" neigh", " moo"], "answer": 0}
    lines = [
        json.dumps(good),
        "{not json",
        "",
        json.dumps({**good, "answer": 2}),
        json.dumps({"context": "x", "choices": [" a", " b"]}),
        json.dumps({**good, "choices": [" only"]}),
        json.dumps({**good, "answer": True}),
        json.dumps({**good, "label": 1}),
        json.dumps([1, 2]),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskFileError) as error:
        load_task(path)
    message = str(error.value)
    for line, problem in [
        (2, "not valid JSON"),
        (4, "answer 2 is out of range for 2 choices"),
        (5, "missing key(s) answer"),
        (6, "choices must be a list of at least 2 strings"),
        (7, "answer must be an integer"),
        (8, "unknown key(s) label"),
        (9, "expected a JSON object"),
    ]:
        assert f"{path}:{line}: {problem}" in message
    assert f"{path}:1:" not in message and f"{path}:3:" not in message

    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskFileError, match="no items"):
        load_task(tmp_path / "empty.jsonl")


def test_shipped_task_file_is_valid_and_regenerates_identically() -> None:
    items = load_task(SAMPLE_TASK)
    assert 90 <= len(items) <= 110
    assert {item.kind for item in items} == {"capital", "color", "sound", "pet", "arithmetic"}
    assert all(choice.startswith(" ") for item in items for choice in item.choices)
    assert SAMPLE_TASK.read_text(encoding="utf-8") == "\n".join(sample_task_lines()) + "\n"


# --- generation -----------------------------------------------------------------------

PROMPTS = ["Once upon a time", "The capital of Valdoria is", "Tara", ""]


def greedy_without_cache(
    model: nn.Module, tokenizer: Tokenizer, prompt: str, steps: int
) -> list[int]:
    tokens = [tokenizer.eod_id, *tokenizer.encode(prompt)]
    new = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0, -1, : tokenizer.vocab_size]
        token = int(logits.argmax())
        if token == tokenizer.eod_id:
            break
        tokens.append(token)
        new.append(token)
    return new


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_greedy_with_kv_cache_equals_repeated_full_forwards(
    tokenizer: Tokenizer, style: str
) -> None:
    model = tiny_model(tokenizer, style)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    result = generate(model, tokenizer, PROMPTS, sampling, batch_size=3)
    for prompt, generation in zip(PROMPTS, result.generations, strict=True):
        assert generation.prompt == prompt
        assert generation.token_ids == greedy_without_cache(model, tokenizer, prompt, 12)
        decoded = tokenizer.decode([*tokenizer.encode(prompt), *generation.token_ids])
        assert (prompt + generation.text).strip() == decoded.strip()
    assert result.tokens_per_s > 0


def test_top_k_1_equals_greedy(model: GPTModel, tokenizer: Tokenizer) -> None:
    greedy = generate(model, tokenizer, PROMPTS, SamplingConfig(max_new_tokens=10, temperature=0))
    top1 = generate(
        model,
        tokenizer,
        PROMPTS,
        SamplingConfig(max_new_tokens=10, temperature=1.5, top_k=1, top_p=None),
    )
    assert [g.token_ids for g in top1.generations] == [g.token_ids for g in greedy.generations]


def test_sampling_is_reproducible_and_independent_of_batching(
    model: GPTModel, tokenizer: Tokenizer
) -> None:
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7)

    def texts(seed_sampling: SamplingConfig, batch_size: int) -> list[list[int]]:
        result = generate(model, tokenizer, PROMPTS, seed_sampling, batch_size=batch_size)
        return [g.token_ids for g in result.generations]

    first = texts(sampling, 4)
    assert texts(sampling, 4) == first
    assert texts(sampling, 1) == first
    other = SamplingConfig(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=8)
    assert texts(other, 4) != first


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Reference: the most likely tokens, in order, until their mass reaches top_p."""
    probs = torch.softmax(logits.double(), dim=-1)
    kept, mass = set(), 0.0
    for index in torch.argsort(probs, descending=True).tolist():
        kept.add(index)
        mass += probs[index].item()
        if mass >= top_p:
            break
    return kept


def test_filter_logits_keeps_top_k_and_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda out: set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == {1, 3}
    assert kept(filter_logits(logits, top_p=0.5)) == {1, 3} == nucleus(logits[0], 0.5)
    assert kept(filter_logits(logits, top_p=0.7)) == {1, 3} == nucleus(logits[0], 0.7)
    assert kept(filter_logits(logits, top_p=0.71)) == {1, 3, 4} == nucleus(logits[0], 0.71)
    assert kept(filter_logits(logits, top_p=0.01)) == {1}
    assert kept(filter_logits(logits, top_k=2, top_p=0.3)) == {1}


def test_sampling_follows_the_probabilities_and_a_row_draws_the_same_in_any_batch() -> None:
    """The exponential race over counter-based streams: 20,000 rows of one distribution
    pick each token at its probability; a row's tokens depend on its seed and draw count
    only, not on the rows beside it; consecutive draws differ."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log().expand(20_000, 4)
    sampling = SamplingConfig(temperature=1.0, top_k=None, top_p=None)
    drawn = next_tokens(logits, sampling, [RowStream(seed) for seed in range(20_000)])
    frequencies = torch.bincount(drawn, minlength=4) / 20_000
    assert torch.allclose(frequencies, probs, atol=0.015), frequencies

    flat = torch.zeros(1, 1000)  # uniform over 1000 tokens: a draw pins down its stream
    alone = [int(next_tokens(flat, sampling, [RowStream(5)])[0])]
    stream = RowStream(5)
    in_batches = []
    for width in (3, 1, 7):
        others = [RowStream(100 + i) for i in range(width - 1)]
        tokens = next_tokens(flat.expand(width, 1000), sampling, [*others, stream])
        in_batches.append(int(tokens[-1]))
    for _ in range(2):
        alone.append(int(next_tokens(flat, sampling, [RowStream(5)])[0]))
    assert alone == [alone[0]] * 3  # a fresh stream of seed 5: its first draw each time
    assert in_batches[0] == alone[0] and stream.draws == 3
    assert len(set(in_batches)) == 3  # draws 0, 1, 2 of one stream differ
    repeat = RowStream(5)
    assert [int(next_tokens(flat, sampling, [repeat])[0]) for _ in range(3)] == in_batches
    # The extreme draws give finite, positive noise: a zero would make p / E NaN where p = 0
    # (tokens past the tokenizer's vocabulary), and argmax would pick one of them.
    extremes = exponential_of_bits(torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1]))
    assert torch.isfinite(extremes).all() and (extremes > 0).all(), extremes
    logits = torch.full((1, 8), float("-inf"))
    logits[0, :2] = 0.0
    masked = torch.softmax(logits, -1) / exponential_of_bits(torch.tensor([[2**24 - 1] * 8]))
    assert int(masked.argmax()) < 2
    # Seeds are any int, taken as the int64 they wrap to.
    assert RowStream(2**64 + 5).seed == 5 and RowStream(2**63).seed == -(2**63)


@pytest.mark.gpu
def test_row_streams_draw_the_same_bits_on_cuda_as_on_cpu() -> None:
    streams = lambda: [RowStream(seed) for seed in (0, 1, 2**62, 2**63 - 1)]  # noqa: E731
    cpu = stream_bits(streams(), 4096, torch.device("cpu"))
    cuda = stream_bits(streams(), 4096, torch.device("cuda"))
    assert torch.equal(cpu, cuda.cpu())
    noise = exponential_noise(streams(), 4096, torch.device("cuda")).cpu()
    assert torch.allclose(noise, exponential_noise(streams(), 4096, torch.device("cpu")))


def test_top_p_sampling_only_picks_tokens_inside_the_nucleus(
    model: GPTModel, tokenizer: Tokenizer
) -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(temperature=1.0, top_p=0.6, top_k=None)
    allowed = nucleus(logits[0], 0.6)
    stream = [RowStream(1)]
    drawn = {int(next_tokens(logits, sampling, stream)[0]) for _ in range(500)}
    assert drawn <= allowed and len(drawn) == len(allowed) > 5

    # Through the model: recompute each step's distribution with a full forward.
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.3, top_p=0.8, top_k=None, seed=3)
    result = generate(model, tokenizer, PROMPTS[:3], sampling)
    steps = 0
    for prompt, generation in zip(PROMPTS[:3], result.generations, strict=True):
        tokens = [tokenizer.eod_id, *tokenizer.encode(prompt)]
        for token in generation.token_ids:
            with torch.no_grad():
                step = model(torch.tensor([tokens]))[0, -1, : tokenizer.vocab_size] / 1.3
            assert token in nucleus(step, 0.8)
            tokens.append(token)
            steps += 1
    assert steps > 20


class EodAfter(nn.Module):
    """A model that predicts EOD from absolute position ``position`` on."""

    def __init__(self, model: GPTModel, eod_id: int, position: int):
        super().__init__()
        self.model, self.eod_id, self.position = model, eod_id, position
        self.config = model.config

    def new_kv_cache(self, batch_size: int, max_length: int, **kwargs):  # noqa: ANN003, ANN201
        return self.model.new_kv_cache(batch_size, max_length, **kwargs)

    def forward(self, tokens: torch.Tensor, kv_cache=None, start_pos: int = 0) -> torch.Tensor:  # noqa: ANN001
        logits = self.model(tokens, kv_cache=kv_cache, start_pos=start_pos)
        positions = torch.arange(start_pos, start_pos + tokens.size(1))
        logits[:, positions >= self.position, self.eod_id] = 1e4
        return logits


def test_generation_stops_at_eod(model: GPTModel, tokenizer: Tokenizer) -> None:
    stopper = EodAfter(model, tokenizer.eod_id, position=16)
    prompts = ["Tara", "Once upon a time"]
    lengths = [1 + len(tokenizer.encode(p)) for p in prompts]
    assert max(lengths) < 16
    for temperature in (0.0, 1.0):
        sampling = SamplingConfig(max_new_tokens=30, temperature=temperature)
        result = generate(stopper, tokenizer, prompts, sampling)
        for length, generation in zip(lengths, result.generations, strict=True):
            # Positions length..16 are generated; the token after position 16 is EOD.
            assert generation.finish_reason == "eod"
            assert generation.new_tokens == 17 - length
            assert tokenizer.eod_id not in generation.token_ids
    no_stop = SamplingConfig(max_new_tokens=15, temperature=0.0, stop_at_eod=False)
    for generation in generate(stopper, tokenizer, prompts, no_stop).generations:
        assert (generation.finish_reason, generation.new_tokens) == ("length", 15)


def test_long_prompts_keep_their_last_tokens(model: GPTModel, tokenizer: Tokenizer) -> None:
    prompt = "Once upon a time " * 30
    result = generate(model, tokenizer, [prompt], SamplingConfig(max_new_tokens=8, temperature=0))
    generation = result.generations[0]
    assert generation.prompt_tokens == MAX_POSITIONS - 8
    assert generation.new_tokens + (generation.finish_reason == "eod") <= 8


# --- report and CLI -------------------------------------------------------------------


def test_cli_prints_a_table_and_writes_a_json_report(
    package: Path, shards: DataConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "The horse says"}) + "\n")
    output = tmp_path / "out" / "report.json"
    parser = argparse.ArgumentParser(prog="megalith")
    eval_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "eval",
            "--model", str(package),
            "--data", shards.output,
            "--set", "data.split=[0.8,0.1,0.1]",
            "--max-samples", "4",
            "--tasks", "sample_facts",
            "--prompts", "Once upon a time", str(prompt_file),
            "--max-new-tokens", "6",
            "--output", str(output),
        ]
    )  # fmt: skip
    assert args.handler(args) == 0

    report = json.loads(output.read_text(encoding="utf-8"))
    assert report["format"] == "megalith-eval-report"
    assert report["perplexity"]["samples"] == 4
    assert report["perplexity"]["tokens"] == 4 * MAX_POSITIONS  # seq_length from the model
    assert report["tasks"]["sample_facts"]["items"] == 96
    assert set(report["tasks"]["sample_facts"]["by_kind"]) == {
        "capital", "color", "sound", "pet", "arithmetic"
    }  # fmt: skip
    samples = report["generation"]["samples"]
    assert [s["prompt"] for s in samples] == ["Once upon a time", "The horse says"]
    assert all(s["new_tokens"] <= 6 for s in samples)
    assert report["metrics"]["valid_perplexity"] == report["perplexity"]["perplexity"]
    assert "sample_facts_acc_norm" in report["metrics"]
    assert [p.name for p in output.parent.iterdir()] == ["report.json"]  # no temp files left

    printed = capsys.readouterr().out
    assert "perplexity" in printed and "sample_facts" in printed and "acc_norm" in printed
    assert '[2] "The horse says" →' in printed
    assert f"wrote {output}" in printed


def test_bf16_autocast_runs_and_stays_close_to_fp32(
    model: GPTModel, tokenizer: Tokenizer, shards: DataConfig
) -> None:
    """Perplexity, scoring and generation each compute their MLP blocks in bf16 (each
    fails if it drops ``autocast_dtype``); the fp32 path computes in fp32."""
    with module_output_dtypes() as dtypes:
        fp32 = evaluate_perplexity(model, shards, max_samples=4)
    assert dtypes["MLP"] == {torch.float32}
    with module_output_dtypes() as dtypes:
        bf16 = evaluate_perplexity(model, shards, max_samples=4, autocast_dtype=torch.bfloat16)
    assert dtypes["MLP"] == {torch.bfloat16}, dict(dtypes)
    assert bf16.loss == pytest.approx(fp32.loss, rel=0.05)
    assert bf16.loss != fp32.loss  # bf16 rounding shows
    with module_output_dtypes() as dtypes:
        scores = score_choices(model, tokenizer, ITEMS, autocast_dtype=torch.bfloat16)
    assert dtypes["MLP"] == {torch.bfloat16}, dict(dtypes)
    assert all(math.isfinite(s.loglik) for item in scores for s in item)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0)
    with module_output_dtypes() as dtypes:
        result = generate(model, tokenizer, PROMPTS, sampling, autocast_dtype=torch.bfloat16)
    assert dtypes["MLP"] == {torch.bfloat16}, dict(dtypes)
    assert all(g.new_tokens + (g.finish_reason == "eod") == 5 for g in result.generations)
