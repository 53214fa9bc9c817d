"""T5 in the trainer: span-corruption batches, the loss, FLOPs, resume and data parallelism
(real torchrun + gloo, DDP and the distributed optimizer, against one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parallel_helpers import (
    BACKEND,
    DEVICE,
    RESUME_STEP,
    STEPS,
    assert_metrics_match,
    assert_resume_exact,
    assert_whole_checkpoint,
    metrics,
    run_torchrun_worker,
)
from t5_helpers import REPO, T5_RECIPE, t5_chat_shard_set, t5_config, t5_settings, t5_shard_set
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megalith.config import ModelConfig
from preprocessing.manifest import read_manifest
from training.data.t5_dataset import span_corruption_lengths
from training.finetune.lora import is_adapter_param
from training.models import T5Model, build_model
from training.models.flops import encoder_decoder_flops
from training.models.package import load_model_package, model_tensors
from training.trainer import Trainer

WORLD = 2
LORA = {"finetune.lora.rank": 4, "finetune.lora.alpha": 8, "finetune.lora.dropout": 0.0}
DP_CASES = {
    "dp2-ddp": {"parallel.data_parallel_mode": "ddp"},
    "dp2-distributed-optimizer": {"parallel.data_parallel_mode": "distributed_optimizer"},
    "dp2-fsdp": {"parallel.data_parallel_mode": "fsdp"},
    "tp2": {"parallel.tensor": 2},  # the trainer's T5 path under tensor parallelism too
    # Encoder, decoder and cross-attention over gathered keys, relative bias by global
    # position (S 32 and T 8 are multiples of 2 · CP).
    "cp2": {"parallel.context": 2},
}
# Chat fine-tuning: answers differ in length, so only the step-wide count of answer tokens
# gives one process's losses (a per-rank or per-micro-batch mean would not).
CHAT = {"data.format": "chat", "data.span_corruption.decoder_length": 16}
CHAT_CASES = {
    "chat-dp2": {},
    "chat-cp2": {"parallel.context": 2},
    "chat-pp2": {"parallel.pipeline": 2},
}


@pytest.fixture(scope="module")
def t5_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return t5_shard_set(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(t5_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process: fit STEPS steps, then resume a copy of the RESUME_STEP checkpoint."""
    out = tmp_path_factory.mktemp("t5-reference")
    Trainer(t5_config(t5_settings(t5_shards)), out / "run").fit(show_progress=False)
    return out / "run"


def test_encoder_decoder_flops_match_a_flop_counter() -> None:
    """6 FLOPs per weight and token, 12·H per attention (query, key) pair: exactly what
    torch's FlopCounter counts for a training step of the real model (math SDPA)."""
    for position in ("relative", "rope"):
        config = ModelConfig(
            family="t5", num_layers=2, num_decoder_layers=3, hidden_size=32,
            num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, vocab_size=256,
            backend="torch", position_embedding=position, max_position_embeddings=64,
        )  # fmt: skip
        model = build_model(config)
        encoder, decoder = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 8))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(encoder, decoder, decoder).backward()
        assert counter.get_total_flops() == 2 * encoder_decoder_flops(config, 24, 8), position


def test_trainer_trains_t5_on_span_corruption(t5_shards: Path, reference: Path) -> None:
    config = t5_config(t5_settings(t5_shards))
    trainer = Trainer(config, reference.parent / "inspect")
    assert isinstance(trainer.model, T5Model)
    # The vocabulary comes from the data, sentinels included; positions cover S and T.
    manifest = read_manifest(str(t5_shards))
    lengths = span_corruption_lengths(config.data)
    assert trainer.model_config.vocab_size == manifest.tokenizer.padded_vocab_size
    assert trainer.model_config.max_position_embeddings == max(lengths.encoder, lengths.decoder)
    assert trainer.tokens_per_sample == lengths.encoder + lengths.decoder
    per_sample = encoder_decoder_flops(trainer.model_config, lengths.encoder, lengths.decoder)
    assert trainer.flops_per_token * trainer.tokens_per_sample == pytest.approx(per_sample)
    # The step's loss is the mean over the batch's target tokens, recomputed by hand.
    batch = next(trainer.train_batches())
    with torch.no_grad():
        logits = trainer.model(batch["encoder_tokens"], batch["decoder_tokens"],
                               encoder_mask=batch["encoder_mask"])  # fmt: skip
        want = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
        )
        assert trainer._micro_batch_loss(batch).item() == pytest.approx(want.item(), rel=1e-5)

    records = metrics(reference)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    package = json.loads((reference / "model" / "config.json").read_text())
    assert package["model"]["family"] == "t5"


def test_t5_resumes_exactly(t5_shards: Path, reference: Path, tmp_path: Path) -> None:
    first = reference / "checkpoints" / f"step-{RESUME_STEP:08d}"
    (tmp_path / "checkpoints").mkdir()
    import shutil

    shutil.copytree(first, tmp_path / "checkpoints" / first.name)
    config = t5_config(t5_settings(t5_shards, {"checkpoint.directory": tmp_path / "checkpoints"}))
    trainer = Trainer(config, tmp_path / "run")
    assert trainer.resume() and trainer.step == RESUME_STEP
    trainer.fit(show_progress=False)
    assert_resume_exact(reference, tmp_path / "run", "T5 one process")


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return t5_chat_shard_set(tmp_path_factory)


@pytest.fixture(scope="module")
def chat_reference(chat_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat fine-tune in one process (fit, then the RESUME_STEP checkpoint resumed)."""
    out = tmp_path_factory.mktemp("t5-chat-reference")
    Trainer(t5_config(t5_settings(chat_shards, CHAT)), out / "run").fit(show_progress=False)
    return out / "run"


@pytest.fixture(scope="module")
def dp_runs(t5_shards: Path, chat_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three data-parallel modes, TP=2 and CP=2, and the chat fine-tune's DP, CP and PP, in
    one torchrun job of 2 gloo ranks (fit, then resume)."""
    out = tmp_path_factory.mktemp("t5-dp")
    cases = {name: t5_settings(t5_shards, extra) for name, extra in DP_CASES.items()}
    for name, extra in CHAT_CASES.items():
        cases[name] = t5_settings(chat_shards, {**CHAT, **extra})
    spec = {
        "recipe": str(T5_RECIPE),
        "device": DEVICE,
        "cases": cases,
        "resume_step": RESUME_STEP,
        "out": str(out),
    }
    return run_torchrun_worker("tp_trainer_worker.py", spec, out, WORLD, "T5 data parallel")


@pytest.mark.parametrize("case", DP_CASES)
def test_parallel_trainer_matches_one_process(case: str, dp_runs: Path, reference: Path) -> None:
    """Losses (train and validation) within 1e-5 and grad norms within 1e-4 relative of one
    process at every step; the last checkpoint's weights and AdamW moments within 1e-4
    relative / 1e-5 absolute; a resume repeats the run's losses exactly."""
    layout = f"T5 {case} ({BACKEND}, {WORLD} processes)"
    got = metrics(dp_runs / case)
    assert_metrics_match(got, metrics(reference), layout)
    assert_whole_checkpoint(dp_runs / case, reference, layout)
    assert_resume_exact(dp_runs / case, dp_runs / f"{case}-resumed", layout)


@pytest.mark.parametrize("case", CHAT_CASES)
def test_parallel_chat_fine_tune_matches_one_process(
    case: str, dp_runs: Path, chat_reference: Path
) -> None:
    """A T5 chat fine-tune (one sample per assistant turn) under DP=2, CP=2 and PP=2: the
    same per-step losses, validation losses and grad norms as one process, the same last
    checkpoint, and an exact resume."""
    layout = f"T5 {case} ({BACKEND}, {WORLD} processes)"
    assert_metrics_match(metrics(dp_runs / case), metrics(chat_reference), layout)
    assert_whole_checkpoint(dp_runs / case, chat_reference, layout)
    assert_resume_exact(dp_runs / case, dp_runs / f"{case}-resumed", layout)


def test_t5_fine_tunes_from_its_package_fully_and_with_lora(
    t5_shards: Path, reference: Path, tmp_path: Path
) -> None:
    """``finetune.base`` with a T5 package: the model starts as the base (its weights, and
    the same first-step loss whether every weight trains or only LoRA adapters); the full
    fine-tune moves the weights, the LoRA one only its adapters, and both packages load."""
    base, _, _ = load_model_package(reference / "model")
    base_tensors = model_tensors(base)
    runs = {}
    for name, extra in {"full": {}, "lora": LORA}.items():
        settings = t5_settings(t5_shards, {"finetune.base": str(reference / "model"), **extra})
        trainer = Trainer(t5_config(settings), tmp_path / name)
        start = {n: t.clone() for n, t in model_tensors(trainer.model).items()}
        for tensor_name, tensor in base_tensors.items():
            assert torch.equal(start[tensor_name], tensor), (
                f"{name}: {tensor_name} is not the base's"
            )
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        runs[name] = (trainer.fit(show_progress=False).metrics, trainable)
        package, config, _ = load_model_package(tmp_path / name / "model")
        assert config.family == "t5" and isinstance(package, T5Model)
        moved = [n for n, t in model_tensors(trainer.model).items() if not torch.equal(t, start[n])]
        if name == "full":
            assert set(moved) == set(base_tensors), set(base_tensors) - set(moved)
        else:
            assert moved and all(is_adapter_param(n) for n in moved), moved
            assert trainable == {n for n in start if is_adapter_param(n)}
            assert (tmp_path / name / "adapter").is_dir()
    (full, _), (lora, _) = runs["full"], runs["lora"]
    assert full[0]["loss"] == pytest.approx(lora[0]["loss"], abs=1e-6)
    assert len(full) == len(lora) == STEPS


@pytest.mark.slow
def test_parallel_t5_lora_fine_tunes_match_one_process(
    t5_shards: Path, reference: Path, tmp_path: Path
) -> None:
    """A T5 LoRA fine-tune under DP=2, TP=2 and PP=2 (encoder and decoder stages; each reads
    only its layers of the base) against the same fine-tune in one process: losses,
    validation losses and grad norms step by step, and an exact resume."""
    settings = t5_settings(t5_shards, {"finetune.base": str(reference / "model"), **LORA})
    one = tmp_path / "one"
    Trainer(t5_config(settings), one).fit(show_progress=False)
    cases = {
        "lora-dp2": settings,
        "lora-tp2": {**settings, "parallel.tensor": 2},
        "lora-pp2": {**settings, "parallel.pipeline": 2},
    }
    spec = {
        "recipe": str(T5_RECIPE),
        "device": DEVICE,
        "cases": cases,
        "resume_step": RESUME_STEP,
        "out": str(tmp_path),
    }
    runs = run_torchrun_worker("tp_trainer_worker.py", spec, tmp_path, WORLD, "T5 LoRA")
    for case in cases:
        layout = f"T5 {case} ({BACKEND}, {WORLD} processes)"
        assert_metrics_match(metrics(runs / case), metrics(one), layout)
        assert_resume_exact(runs / case, runs / f"{case}-resumed", layout)


# --- evaluation ----------------------------------------------------------------------------


def test_perplexity_scores_the_trainers_validation_targets(t5_shards: Path, reference: Path):
    """evaluate_perplexity on the package reads the samples the trainer validated on: its
    loss equals the last logged val_loss (every sample has as many targets)."""
    from evaluation.perplexity import evaluate_perplexity
    from training.models.package import load_model_package

    model, config, _ = load_model_package(reference / "model")
    assert isinstance(model, T5Model)
    data = t5_config(t5_settings(t5_shards)).data
    result = evaluate_perplexity(model, data, max_samples=4, batch_size=3)
    lengths = span_corruption_lengths(data)
    assert result.samples == 4 and result.tokens == 4 * lengths.targets_used
    assert result.loss == pytest.approx(metrics(reference)[-1]["val_loss"], abs=1e-5)


def test_task_choices_are_scored_as_the_span_after_the_context(reference: Path) -> None:
    """span_logliks: ``context <extra_id_0> EOS`` in, ``<extra_id_0> choice`` scored; a
    batch of different lengths (padded, masked) gives each row's single-row value, and
    that is the log-softmax of the choice tokens read off the logits."""
    from evaluation.seq2seq import span_logliks, span_prompt
    from preprocessing.tokenizer import load_tokenizer, sentinel_ids
    from training.models.package import load_model_package

    model, _, tokenizer_path = load_model_package(reference / "model")
    tokenizer = load_tokenizer(str(tokenizer_path))
    sequences = [
        (tokenizer.encode("Once upon a time, a fox"), 3),
        (tokenizer.encode("The capital of Valdoria is Mirelle."), 5),
    ]  # fmt: skip
    batched = span_logliks(model, tokenizer, sequences)
    for (tokens, n), value in zip(sequences, batched, strict=True):
        encoder, start = span_prompt(tokenizer, tokens[:-n])
        assert encoder[-2:] == [sentinel_ids(tokenizer)[0], tokenizer.eod_id]
        assert start == [tokenizer.pad_id, sentinel_ids(tokenizer)[0]]
        with torch.no_grad():
            logits = model(torch.tensor([encoder]), torch.tensor([start + tokens[-n:-1]]))
        logprobs = logits.log_softmax(-1)[0, len(start) - 1 :]
        want = logprobs.gather(1, torch.tensor(tokens[-n:])[:, None]).sum().item()
        assert value == pytest.approx(want, abs=1e-4)
        assert span_logliks(model, tokenizer, [(tokens, n)])[0] == pytest.approx(value, abs=1e-4)


# --- the end-to-end flow, selected by model.family -----------------------------------------


@pytest.mark.slow
def test_end_to_end_flow_trains_evaluates_and_registers_a_t5(
    prefect_api, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """configs/t5-tiny-cpu.yaml shrunk, through the same end-to-end flow as GPT: tokenizer
    with sentinels → shards → train → eval (span perplexity, tasks, seq2seq generation) →
    register; the registered model loads back as a T5."""
    from megalith.config import load_config
    from pipelines.flows import end_to_end
    from pipelines.recipes import sample_corpus
    from preprocessing.tokenizer import load_tokenizer, sentinel_ids
    from training.mlflow_store.registered import load_registered_model
    from training.mlflow_store.runs import ensure_tracking_store
    from training.models.package import load_model_package

    root = tmp_path_factory.mktemp("t5-e2e")
    lines = sample_corpus().read_text().splitlines()[:300]
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    ensure_tracking_store(tracking_uri)
    config = load_config(
        T5_RECIPE,
        [
            "tokenizer.vocab_size=640", "tokenizer.sentinel_tokens=8", "data.workers=1",
            "data.seq_length=48", "model.num_layers=1", "model.num_decoder_layers=1",
            "model.hidden_size=32", "model.ffn_hidden_size=64", "training.train_iters=3",
            "training.eval_interval=3", "training.eval_iters=1", "training.log_interval=1",
            "logging.registered_model=t5-e2e",
        ],
        {"data.inputs": [str(root / "corpus.jsonl")], "data.output": str(root / "shards")},
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
        patch.setenv("OMP_NUM_THREADS", "1")
        result = end_to_end(config, str(root))

    assert result["training"]["steps"] == 3
    evaluation = result["evaluation"]["metrics"]
    assert evaluation["valid_perplexity"] > 1.0 and 0.0 <= evaluation["sample_facts_acc"] <= 1.0
    generations = result["evaluation"]["generations"]
    assert [g["prompt"] for g in generations] == ["Once upon a time,<extra_id_0>",
                                                  "The capital of<extra_id_0>"]  # fmt: skip
    assert result["registration"]["version"] == 1
    package = load_registered_model("models:/t5-e2e@candidate", root / "loaded",
                                    tracking_uri=tracking_uri)  # fmt: skip
    model, model_config, tokenizer_path = load_model_package(package)
    assert isinstance(model, T5Model) and model_config.family == "t5"
    assert len(sentinel_ids(load_tokenizer(str(tokenizer_path)))) == 8


def test_t5_base_recipe_has_the_t5_v1_1_base_shape() -> None:
    """configs/t5-base.yaml has as many parameters as transformers' T5 v1.1 base
    (google/t5-v1_1-base's config: d_model 768, d_ff 2048, 12+12 layers, 12 heads, gated
    GELU, vocab 32128, untied head), both counted on the meta device, and T5's
    512 -> 114 span-corruption lengths."""
    from transformers import T5Config, T5ForConditionalGeneration

    from megalith.config import load_config

    config = load_config(REPO / "configs" / "t5-base.yaml")
    hf_config = T5Config(
        vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
        num_heads=12, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = build_model(config.model)
        hf = T5ForConditionalGeneration(hf_config)
    hf_params = sum(p.numel() for p in hf.parameters())
    if hf.lm_head.weight is hf.shared.weight:  # transformers 5 ties at init; v1.1 is untied
        hf_params += hf.lm_head.weight.numel()
    assert sum(p.numel() for p in model.parameters()) == hf_params
    lengths = span_corruption_lengths(config.data)
    assert (lengths.raw, lengths.encoder, lengths.decoder, lengths.spans) == (568, 512, 114, 28)
    assert config.tokenizer.sentinel_tokens >= lengths.spans


def test_a_t5_package_is_served_like_seq2seq_generation(reference: Path, tmp_path: Path) -> None:
    """``megalith serve`` takes a T5 package: one batch of requests with their own settings
    gives each the output of ``generate_seq2seq`` alone, and so does HTTP, through the
    server's own API and the OpenAI client (completions; a chat as its template)."""
    import time
    from dataclasses import replace

    import httpx
    import openai
    from test_serving import Collector, megalith_serve

    from deploy.engine import BatchingEngine, Finished, PendingRequest
    from preprocessing.chat import generation_prompt
    from registry.mlflow_pyfunc import MegalithPyfunc
    from training.inference.decode import SamplingConfig
    from training.inference.decode_t5 import generate_seq2seq
    from training.inference.loading import load_served_model

    served = load_served_model(str(reference / "model"))
    tokenizer = served.tokenizer
    prompts = ["Once upon a time", "The cat sat <extra_id_0> mat.", "Five"]
    settings = [
        {"max_new_tokens": 6, "temperature": 0.0},
        {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.9, "seed": 5},
        {"max_new_tokens": 8, "temperature": 0.7, "top_k": 20, "seed": 9},
    ]
    engine = BatchingEngine(served, max_batch_size=8)
    sinks = [Collector() for _ in prompts]
    for prompt, setting, sink in zip(prompts, settings, sinks, strict=True):
        ids = [*tokenizer.encode(prompt), tokenizer.eod_id]
        deadline = time.monotonic() + 60
        request = PendingRequest(
            ids, SamplingConfig(**setting), deadline, sink.on_token, sink.on_done
        )
        engine.submit(request)
    engine.start()
    for prompt, setting, sink in zip(prompts, settings, sinks, strict=True):
        assert sink.done.wait(60) and isinstance(sink.result, Finished)
        alone = generate_seq2seq(served.model, tokenizer, [prompt], SamplingConfig(**setting))
        expected = alone.generations[0]
        assert sink.result.token_ids == sink.tokens == expected.token_ids, prompt
        assert sink.result.finish_reason == expected.finish_reason
    assert (engine.stats.batches, engine.stats.largest_batch) == (1, len(prompts))
    engine.retire()
    assert engine.join(30)

    greedy = generate_seq2seq(served.model, tokenizer, prompts[:1], SamplingConfig(6, 0.0))
    sampled = SamplingConfig(5, 1.0, top_p=1.0, seed=21)
    samples = [generate_seq2seq(served.model, tokenizer, prompts[1:2], sampled)]
    samples.append(
        generate_seq2seq(served.model, tokenizer, prompts[1:2], replace(sampled, seed=22))
    )
    log = tmp_path / "serve.log"
    with megalith_serve(reference / "model", "127.0.0.1", None, log) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            body = {"prompt": prompts[0], "max_tokens": 6, "temperature": 0}
            answer = client.post("/v1/generate", json=body).json()
            assert answer["text"] == greedy.generations[0].text != ""
            assert answer["prompt_tokens"] == len(tokenizer.encode(prompts[0])) + 1
            # A chat reaches the encoder as its template and EOS (a chat fine-tune's
            # input, tests/test_t5_chat.py); this pretrained T5 answers it all the same.
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answered = client.post("/v1/chat", json=chat)
            assert answered.status_code == 200, answered.text
            templated, _ = generation_prompt(tokenizer, chat["messages"])
            assert answered.json()["prompt_tokens"] == len(templated) + 1
        # The OpenAI client: a package is named by its directory's name.
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
            [model] = client.models.list().data
            assert model.id == "model"
            completion = client.completions.create(model="model", **body)
            assert completion.choices[0].text == greedy.generations[0].text
            assert completion.usage.prompt_tokens == answer["prompt_tokens"]
            stream = client.completions.create(model="model", **body, stream=True)
            assert "".join(c.choices[0].text for c in stream) == greedy.generations[0].text
            two = client.completions.create(
                model="model", prompt=prompts[1], max_tokens=5, temperature=1.0, seed=21, n=2
            )
            assert [c.text for c in two.choices] == [s.generations[0].text for s in samples]
            reply = client.chat.completions.create(model="model", **chat, temperature=0)
            assert reply.usage.prompt_tokens == len(templated) + 1
        metrics = httpx.get(f"{url}/metrics", timeout=60).text  # a static engine: no KV blocks
        assert "megalith_generation_tokens_total" in metrics and "megalith_kv_" not in metrics

    # MLflow's pyfunc flavour (what `mlflow models serve` calls) generates seq2seq too.
    pyfunc = MegalithPyfunc(served)
    texts = pyfunc.predict([prompts[0]], {"max_tokens": 6, "temperature": 0.0})
    assert texts == [greedy.generations[0].text]
