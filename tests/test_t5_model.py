"""The T5 encoder-decoder: config keys, masks and positions, checkpointing, tensor and
sequence parallelism, model packages, the Hugging Face export and seq2seq generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from megalith.config import MegalithConfig, ModelConfig
from training.models import GPTModel, T5Model, build_model

REPO = Path(__file__).resolve().parents[1]
VOCAB = 64
PAD = 0


def tiny_t5(**overrides) -> ModelConfig:
    values = {
        "family": "t5",
        "num_layers": 2,
        "num_decoder_layers": 3,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "backend": "torch",
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
    }
    return ModelConfig(**{**values, **overrides})


def build(config: ModelConfig, seed: int = 0) -> T5Model:
    torch.manual_seed(seed)
    return build_model(config)


def ids(batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


POSITIONS = ["relative", "rope"]


def test_config_defaults_and_refusals():
    config = ModelConfig(family="t5")
    assert (config.normalization, config.activation, config.position_embedding) == (
        "rmsnorm",
        "geglu",
        "relative",
    )
    assert (config.bias, config.tie_embeddings, config.decoder_layers) == (False, False, 2)
    assert ModelConfig(family="t5", num_decoder_layers=5).decoder_layers == 5
    assert ModelConfig().family == "gpt" and ModelConfig().activation == "swiglu"
    refused = [
        ({"family": "t5", "num_experts": 4}, "model.num_experts"),
        ({"family": "t5", "position_embedding": "learned"}, "model.position_embedding"),
        ({"family": "t5", "tie_embeddings": True}, "model.tie_embeddings"),
        ({"position_embedding": "relative"}, "model.position_embedding"),
        ({"activation": "geglu"}, "model.activation"),
        ({"num_decoder_layers": 2}, "model.num_decoder_layers"),
    ]
    for values, key in refused:
        with pytest.raises(ValidationError, match=key):
            ModelConfig(**values)
    MegalithConfig(model={"family": "t5"}, parallel={"context": 2})  # context-parallel T5 runs
    assert isinstance(build_model(tiny_t5()), T5Model)
    assert isinstance(
        build_model(ModelConfig(vocab_size=VOCAB, max_position_embeddings=8)), GPTModel
    )


@pytest.mark.parametrize("position", POSITIONS)
def test_loss_is_cross_entropy_of_logits(position):
    model = build(tiny_t5(position_embedding=position))
    enc, dec, labels = ids(2, 9, 1), ids(2, 6, 2), ids(2, 6, 3)
    labels[1, 4:] = -100
    logits = model(enc, dec)
    assert logits.shape == (2, 6, VOCAB) and logits.dtype == torch.float32
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(model(enc, dec, labels), expected)
    per_token = model(enc, dec, labels, loss_reduction="none")
    assert per_token.shape == (2, 6) and per_token[1, 4:].eq(0).all()


@pytest.mark.parametrize("position", POSITIONS)
def test_encoder_padding_is_never_read(position):
    """Logits with a padded encoder equal those of the unpadded prompt, whatever the
    padded positions hold: the encoder's self-attention and the cross-attention skip them."""
    model = build(tiny_t5(position_embedding=position)).eval()
    enc, dec = ids(2, 10, 4), ids(2, 5, 5)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    other = enc.clone()
    other[1, 6:] = ids(1, 4, 6)
    with torch.no_grad():
        padded = model(enc, dec, encoder_mask=mask)
        refilled = model(other, dec, encoder_mask=mask)
        alone = model(enc[1:, :6], dec[1:])
        unmasked = model(enc, dec)
    torch.testing.assert_close(padded, refilled, rtol=0, atol=0)
    torch.testing.assert_close(padded[1:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[:1], unmasked[:1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(padded[1:], unmasked[1:], atol=1e-4)


@pytest.mark.parametrize("position", POSITIONS)
def test_decoder_is_causal_and_encoder_bidirectional(position):
    model = build(tiny_t5(position_embedding=position)).eval()
    enc, dec = ids(1, 8, 7), ids(1, 6, 8)
    with torch.no_grad():
        base = model(enc, dec)
        later_dec = dec.clone()
        later_dec[0, 4] = (dec[0, 4] + 1) % VOCAB
        changed = model(enc, later_dec)
        later_enc = enc.clone()
        later_enc[0, 7] = (enc[0, 7] + 1) % VOCAB
        changed_enc = model(later_enc, dec)
    torch.testing.assert_close(changed[:, :4], base[:, :4], rtol=0, atol=0)
    assert not torch.allclose(changed[:, 4:], base[:, 4:], atol=1e-4)
    assert not torch.allclose(changed_enc[:, 0], base[:, 0], atol=1e-5)


def _loss_and_grads(model: T5Model, enc, dec, labels, mask):
    model.zero_grad()
    loss = model(enc, dec, labels, encoder_mask=mask)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_and_gradients(mode):
    config = tiny_t5(dropout=0.1)
    enc, dec, labels = ids(2, 8, 9), ids(2, 6, 10), ids(2, 6, 11)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:] = False
    plain = build(config)
    torch.manual_seed(3)
    expected = _loss_and_grads(plain, enc, dec, labels, mask)
    checkpointed = build(tiny_t5(dropout=0.1, activation_checkpointing=mode))
    torch.manual_seed(3)
    loss, grads = _loss_and_grads(checkpointed, enc, dec, labels, mask)
    torch.testing.assert_close(loss, expected[0])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], msg=name)
    assert grads["encoder.relative_bias.weight"].abs().sum() > 0
    assert grads["decoder.relative_bias.weight"].abs().sum() > 0


# --- tensor and sequence parallelism (torchrun, gloo, 2 ranks) ---------------------------

# fp32; TP sums partial products in another order. Measured worst cases are in the report.
TP_TOL = {"rtol": 1e-5, "atol": 1e-5}
TP_GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
TP_LAYOUTS = {
    "tp2": {"sequence_parallel": False, "config": {}},
    "tp2+sp": {"sequence_parallel": True, "config": {}},
    "tp2+sp rope selective-ckpt": {
        "sequence_parallel": True,
        "config": {"position_embedding": "rope", "activation_checkpointing": "selective"},
    },
}


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict[str, list[str]]]:
    from parallel_helpers import run_torchrun_worker

    out = tmp_path_factory.mktemp("t5_tp")
    config = tiny_t5().model_dump(
        include={
            "family", "num_layers", "num_decoder_layers", "hidden_size", "num_attention_heads",
            "vocab_size", "max_position_embeddings", "relative_attention_num_buckets",
            "relative_attention_max_distance",
        }
    )  # fmt: skip
    spec = {
        "config": config,
        "layouts": [{"id": name, **layout} for name, layout in TP_LAYOUTS.items()],
        "tol": TP_TOL,
        "grad_tol": TP_GRAD_TOL,
        "out": str(out),
    }
    run_torchrun_worker("t5_tp_worker.py", spec, out, 2, "T5 tensor parallel")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tensor_parallel_matches_one_process(tp_results, layout):
    """Logits, losses, every gradient and the gathered weights of a TP=2 (and +SP) T5
    equal the single-process model's (on each rank: its slice of split parameters)."""
    problems = [line for by_layout in tp_results for line in by_layout[layout]]
    assert not problems, "\n".join(problems)


def test_trainer_tensor_parallel_helpers_build_and_gather_t5(tp_results):
    """training.parallel.tensor_parallel_training: build_model shards a seeded T5 (TP=2,
    SP) with the one-device loss; full_model gathers the whole T5 exactly on rank 0."""
    problems = [line for by_layout in tp_results for line in by_layout["trainer helpers"]]
    assert not problems, "\n".join(problems)


# --- model package and Hugging Face export -------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 400-piece SentencePiece model with <|eod|>, <|pad|> and two sentinels."""
    from megalith.config import DEFAULT_SPECIAL_TOKENS, TokenizerConfig
    from preprocessing.tokenizer import train_tokenizer

    lines = (REPO / "preprocessing/sample_corpus/stories.jsonl").read_text().splitlines()
    docs = [json.loads(line)["text"] for line in lines[:300]]
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    specials = [*DEFAULT_SPECIAL_TOKENS, "<extra_id_0>", "<extra_id_1>"]
    config = TokenizerConfig(
        vocab_size=400, pad_vocab_multiple=64, max_training_documents=300, special_tokens=specials
    )
    train_tokenizer(docs, config, str(prefix))
    return Path(f"{prefix}.model")


def packaged_t5(tokenizer_file: Path, out: Path, **overrides) -> tuple[T5Model, Path]:
    """A T5 with hidden 64 / 4 heads (head_dim 16: the exported 1/4 query scale is exact),
    norms moved away from 1 so their mapping is tested, saved as a package."""
    from training.models.package import save_model_package

    pieces = spm.SentencePieceProcessor(model_file=str(tokenizer_file)).get_piece_size()
    config = tiny_t5(hidden_size=64, vocab_size=-(-pieces // 64) * 64, **overrides)
    model = build(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    save_model_package(model, config, tokenizer_file, out)
    return model.eval(), out


def test_package_round_trip(tokenizer_file, tmp_path):
    from training.models.package import load_model_package, read_package_model_config

    model, package = packaged_t5(tokenizer_file, tmp_path / "pkg")
    loaded, config, _ = load_model_package(package)
    assert isinstance(loaded, T5Model) and read_package_model_config(package).family == "t5"
    enc, dec = ids(2, 9, 12), ids(2, 5, 13)
    with torch.no_grad():
        torch.testing.assert_close(loaded(enc, dec), model(enc, dec), rtol=0, atol=0)


def test_hf_export_logits_match_transformers(tokenizer_file, tmp_path):
    """``megalith export hf`` on a T5 package; T5ForConditionalGeneration's fp32 logits
    equal ours (padded encoder, encoder longer than relative_attention_max_distance)."""
    transformers = pytest.importorskip("transformers")
    from pipelines.cli import main

    model, package = packaged_t5(tokenizer_file, tmp_path / "pkg")
    out = tmp_path / "hf"
    assert main(["export", "hf", str(package), str(out)]) == 0
    hf_config = json.loads((out / "config.json").read_text())
    pad = spm.SentencePieceProcessor(model_file=str(tokenizer_file)).piece_to_id("<|pad|>")
    assert hf_config["decoder_start_token_id"] == hf_config["pad_token_id"] == pad
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["additional_special_tokens"] == ["<extra_id_0>", "<extra_id_1>"]
    hf = transformers.T5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() != hf.shared.weight.data_ptr()

    enc, dec = ids(2, 20, 14), ids(2, 7, 15)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    with torch.no_grad():
        ours = model(enc, dec, encoder_mask=mask)
        theirs = hf(input_ids=enc, attention_mask=mask.long(), decoder_input_ids=dec).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_hf_export_refuses_rope_t5(tokenizer_file, tmp_path):
    from training.interop.export import export_hf
    from training.interop.hf import HFInteropError

    _, package = packaged_t5(tokenizer_file, tmp_path / "pkg", position_embedding="rope")
    with pytest.raises(HFInteropError, match="position_embedding is 'rope'"):
        export_hf(package, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --- seq2seq generation ------------------------------------------------------------------


def _argmax_by_full_forwards(model: T5Model, prompt: list[int], steps: int) -> list[int]:
    """The reference: each step runs the whole decoder input through ``forward``."""
    encoder = torch.tensor([prompt])
    decoder = [PAD]
    for _ in range(steps):
        logits = model(encoder, torch.tensor([decoder]))
        decoder.append(int(logits[0, -1].argmax()))
    return decoder[1:]


@pytest.mark.parametrize("position", POSITIONS)
def test_greedy_generation_equals_argmax_of_full_forwards(position):
    """Encode once, decode with the KV cache, a batch of right-padded prompts: the same
    ids as a full forward per step for each prompt alone."""
    from training.inference.decode import SamplingConfig
    from training.inference.decode_t5 import generate_seq2seq_ids

    model = build(tiny_t5(position_embedding=position)).eval()
    prompts = [ids(1, 11, 20)[0].tolist(), ids(1, 6, 21)[0].tolist()]
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_at_eod=False)
    results = generate_seq2seq_ids(model, prompts, greedy, pad_id=PAD, eod_id=1)
    with torch.no_grad():
        for prompt, (new_ids, reason) in zip(prompts, results, strict=True):
            assert reason == "length"
            assert new_ids == _argmax_by_full_forwards(model, prompt, 8)

    first = results[0][0]
    stop = first[4]
    stopped = SamplingConfig(8, temperature=0.0, stop_at_eod=False, stop_ids=(stop,))
    new_ids, reason = generate_seq2seq_ids(model, prompts[:1], stopped, pad_id=PAD, eod_id=1)[0]
    assert (new_ids, reason) == (first[: first.index(stop)], "stop")


def test_generate_seq2seq_texts(tokenizer_file, tmp_path):
    """The text-level API: prompt + EOS into the encoder, EOD ends a row, seeded sampling
    gives a prompt the same output whatever batch it is in."""
    from preprocessing.tokenizer import load_tokenizer
    from training.inference.decode import SamplingConfig
    from training.inference.decode_t5 import generate_seq2seq

    model, _ = packaged_t5(tokenizer_file, tmp_path / "pkg")
    tokenizer = load_tokenizer(str(tokenizer_file))
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=3)
    prompts = ["Once upon a time", "The cat sat <extra_id_0> mat."]
    together = generate_seq2seq(model, tokenizer, prompts, sampling)
    alone = generate_seq2seq(
        model, tokenizer, prompts[1:], SamplingConfig(**{**sampling.to_dict(), "seed": 4})
    )
    assert [g.prompt for g in together.generations] == prompts
    assert together.generations[1].token_ids == alone.generations[0].token_ids
    for generation, prompt in zip(together.generations, prompts, strict=True):
        assert generation.prompt_tokens == len(tokenizer.encode(prompt)) + 1
        assert generation.finish_reason in ("eod", "length") and generation.new_tokens <= 5
        assert generation.text == tokenizer.decode(generation.token_ids)


def test_transformer_engine_backend_builds_t5():
    """Under the TE backend (a CPU stand-in for transformer_engine) T5 has the torch
    backend's parameters and outputs: masked attention falls back to SDPA."""
    from test_te_backend import stand_in_backend

    config = tiny_t5()
    plain = build(config)
    torch.manual_seed(0)
    te = T5Model(config, stand_in_backend())
    assert list(plain.state_dict()) == list(te.state_dict())
    enc, dec, labels = ids(2, 8, 30), ids(2, 6, 31), ids(2, 6, 32)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 6:] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [model(enc, dec, labels, encoder_mask=mask) for model in (plain, te)]
    torch.testing.assert_close(losses[1], losses[0])
