"""Hugging Face interop: export to transformers and import back, with matching logits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file

from megalith.config import DEFAULT_SPECIAL_TOKENS, ModelConfig, TokenizerConfig
from pipelines.cli import main
from preprocessing.tokenizer import load_tokenizer, train_tokenizer
from training.inference.decode_t5 import encoder_ids
from training.interop.export import export_hf
from training.interop.hf import HFInteropError, fast_tokenizer_json, import_hf
from training.models import build_model
from training.models.gpt import GPTModel
from training.models.package import load_model_package, model_tensors, save_model_package

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
VOCAB = 448  # 400 SentencePiece pieces padded to a multiple of 64
ATOL = 1e-4
SEQUENCE = 32  # every position the tiny models have
CASES = {
    "llama-gqa": {"style": "llama", "num_query_groups": 2},
    "llama-tied-mqa-bias": {
        "style": "llama",
        "num_query_groups": 1,
        "tie_embeddings": True,
        "bias": True,
    },
    "gpt2": {"style": "gpt2"},
    "gpt2-untied": {"style": "gpt2", "tie_embeddings": False},
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = (REPO / "preprocessing/sample_corpus/stories.jsonl").read_text().splitlines()
    docs = [json.loads(line)["text"] for line in lines[:300]]
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    config = TokenizerConfig(vocab_size=400, pad_vocab_multiple=64, max_training_documents=300)
    tokenizer = train_tokenizer(docs, config, str(prefix))
    assert tokenizer.padded_vocab_size == VOCAB
    return Path(f"{prefix}.model")


def tiny_model(
    case: str, seed: int = 0, init_std: float = 0.2, norm_noise: float = 0.3
) -> GPTModel:
    """Weights large enough (std 0.2, not the 0.02 default) that attention is far from
    uniform, so a position or norm bug changes the outputs by nats, not by 1e-4."""
    config = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=SEQUENCE,
        init_std=init_std,
        **CASES[case],
    )
    torch.manual_seed(seed)
    model = GPTModel(config)
    with torch.no_grad():  # norms and biases well away from 1 and 0: their mapping matters
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(norm_noise * torch.randn_like(param))
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(seed))


def token_logliks(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """log p(x[t+1] | x[:t+1]) for every position: what a user's evaluation compares."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    return logprobs.gather(-1, x[:, 1:, None]).squeeze(-1)


def hf_logits(hf_dir: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(x).logits


@pytest.fixture(scope="module")
def exported(tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per case: (our model, its package, its HF export)."""
    root = tmp_path_factory.mktemp("exported")
    out = {}
    for case in CASES:
        model = tiny_model(case)
        package = save_model_package(model, model.config, tokenizer_file, root / f"pkg-{case}")
        out[case] = (model, package, export_hf(package, root / f"hf-{case}"))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_matching_logits(exported: dict, case: str) -> None:
    """Per-token log-likelihoods of 2 x 32 tokens agree within ATOL (1e-4 nats); measured:
    the export agrees within 8e-7, while breaking it moves them far beyond ATOL:
    RoPE base x10 in the exported config (a position bug): 0.76-2.7 nats (llama cases);
    GPT-2 position table shifted by one: 1.4-2.1 nats; every norm weight left at 1:
    1.5-2.6 nats (all cases). With the former weights (init std 0.02, norm noise 0.1, 16
    tokens) the same RoPE bug moved them by 4e-6-1.3e-4, inside the tolerance."""
    model, _, hf_dir = exported[case]
    assert sorted(p.name for p in hf_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
    ]  # fmt: skip
    x = tokens()
    with torch.no_grad():
        ours = model(x)
    theirs = hf_logits(hf_dir, x)
    assert (token_logliks(ours, x) - token_logliks(theirs, x)).abs().max().item() < ATOL
    assert (ours - theirs).abs().max().item() < ATOL
    config = json.loads((hf_dir / "config.json").read_text())
    arch = "GPT2LMHeadModel" if case.startswith("gpt2") else "LlamaForCausalLM"
    assert config["architectures"] == [arch]
    assert config["tie_word_embeddings"] == model.config.tie_embeddings
    if arch == "LlamaForCausalLM":
        c = model.config
        assert (config["hidden_size"], config["intermediate_size"]) == (32, 48)
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (
            4,
            c.num_query_groups,
        )
        assert config["rms_norm_eps"] == c.norm_eps and config["rope_theta"] == c.rope_base
        assert (config["vocab_size"], config["max_position_embeddings"]) == (VOCAB, 32)


def test_a_position_or_norm_bug_in_the_export_would_exceed_the_tolerance(
    exported: dict, tmp_path: Path
) -> None:
    """The comparison above can see the bugs it exists for: the export with a wrong RoPE
    base, or with its norm weights left at 1, moves log-likelihoods by > 1000 x ATOL."""
    model, _, hf_dir = exported["llama-gqa"]
    x = tokens()
    with torch.no_grad():
        ours = token_logliks(model(x), x)
    rope = _copy(hf_dir, tmp_path / "rope")
    config = json.loads((rope / "config.json").read_text())
    theta = config["rope_theta"] * 10
    config.update(
        rope_theta=theta, rope_parameters={**config["rope_parameters"], "rope_theta": theta}
    )
    (rope / "config.json").write_text(json.dumps(config))
    norm = _copy(hf_dir, tmp_path / "norm")
    weights = load_file(norm / "model.safetensors")
    ones = {k: torch.ones_like(v) for k, v in weights.items() if k.endswith("norm.weight")}
    assert len(ones) == 5  # two per layer and the final one
    save_file({**weights, **ones}, norm / "model.safetensors", metadata={"format": "pt"})
    for broken in (rope, norm):
        moved = (ours - token_logliks(hf_logits(broken, x), x)).abs().max().item()
        assert moved > 1000 * ATOL, (broken.name, moved)


@pytest.mark.parametrize("case", list(CASES))
def test_import_of_export_round_trips_exactly(exported: dict, case: str, tmp_path: Path) -> None:
    model, _, hf_dir = exported[case]
    package = import_hf(hf_dir, tmp_path / "back")
    loaded, config, tokenizer = load_model_package(package)
    assert config == model.config
    ours, back = model_tensors(model), model_tensors(loaded)
    assert ours.keys() == back.keys()
    assert all(torch.equal(ours[name], back[name]) for name in ours)
    x = tokens()
    assert torch.equal(loaded(x), model(x))
    assert tokenizer.read_bytes() == (hf_dir / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "llama3_rope", "gpt2_erf"])
def test_import_of_a_transformers_model_matches_its_logits(
    kind: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    """A model made and saved by transformers itself (sharded, with an index) imports with
    the same logits."""
    torch.manual_seed(0)
    # llama3_rope: Llama 3.x's rope_scaling, with a short original context so that it
    # changes the frequencies of a 32-position model; gpt2_erf: exact GELU ("gelu").
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    if kind.startswith("llama"):
        hf_config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rms_norm_eps=1e-6, rope_theta=500.0,
            rope_scaling={**scaling, "rope_theta": 500.0} if kind == "llama3_rope" else None,
        )  # fmt: skip
        hf_model = transformers.LlamaForCausalLM(hf_config)
    else:
        hf_config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, n_inner=40,
            activation_function="gelu" if kind == "gpt2_erf" else "gelu_new",
        )  # fmt: skip
        hf_model = transformers.GPT2LMHeadModel(hf_config)
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir, max_shard_size="50KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    shutil.copyfile(tokenizer_file, hf_dir / "tokenizer.model")
    x = tokens()
    with torch.no_grad():
        theirs = hf_model.eval()(x).logits
    model, config, _ = load_model_package(import_hf(hf_dir, tmp_path / "pkg"))
    assert config.ffn_hidden_size == 40 and config.style == kind.split("_")[0].removesuffix("3")
    if kind.startswith("llama"):
        assert (config.rope_base, config.norm_eps, config.num_query_groups) == (500.0, 1e-6, 2)
    assert (config.rope_scaling is not None) == (kind == "llama3_rope")
    assert config.gelu_approximation == ("none" if kind == "gpt2_erf" else "tanh")
    assert (model(x) - theirs).abs().max().item() < ATOL
    if kind in ("llama3_rope", "gpt2_erf"):  # and back: transformers reads the same model
        again = transformers.AutoModelForCausalLM.from_pretrained(
            export_hf(tmp_path / "pkg", tmp_path / "again"), dtype=torch.float32
        )
        with torch.no_grad():
            assert (again.eval()(x).logits - theirs).abs().max().item() < ATOL


def test_tokenizer_loads_in_transformers(exported: dict, tokenizer_file: Path) -> None:
    hf_dir = exported["llama-gqa"][2]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_file))
    eod, pad = sp.piece_to_id("<|eod|>"), sp.piece_to_id("<|pad|>")
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (
        eod,
        eod,
        pad,
    )
    for text in ["Teacher: Good afternoon, class.", "What color is a blueberry?"]:
        assert tokenizer(text)["input_ids"] == [eod, *sp.encode(text)]
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": pad}


# A fresh environment: importing sentencepiece or google.protobuf fails, as where they are
# not installed; AutoTokenizer must load the export from its tokenizer.json alone.
NO_SENTENCEPIECE = """
import json, sys
sys.modules["sentencepiece"] = None
sys.modules["google.protobuf"] = None
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.loads(sys.argv[2])
ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
print(json.dumps({"ids": ids, "decoded": [tokenizer.decode(i) for i in ids],
                  "with_specials": [tokenizer(text)["input_ids"] for text in texts],
                  "eos_pad": [tokenizer.eos_token_id, tokenizer.pad_token_id]}))
"""
SAMPLE_TEXTS = [
    "Teacher: Good afternoon, class.",
    " a leading space,  two spaces and\ttabs\n\nnew lines  ",
    "Digits 12345, unicode ünïcödé 漢字 🙂 (byte fallback).",
    "",
]


def test_exported_tokenizer_json_loads_without_sentencepiece_or_protobuf(
    exported: dict, tokenizer_file: Path
) -> None:
    hf_dir = exported["llama-gqa"][2]
    command = [sys.executable, "-c", NO_SENTENCEPIECE, str(hf_dir), json.dumps(SAMPLE_TEXTS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_file))
    assert result["ids"] == [sp.encode(text) for text in SAMPLE_TEXTS]
    assert result["decoded"] == SAMPLE_TEXTS
    eod = sp.piece_to_id("<|eod|>")
    assert result["with_specials"] == [[eod, *sp.encode(text)] for text in SAMPLE_TEXTS]


def test_t5_export_tokenizer_json_gives_our_encoder_input_without_sentencepiece(
    tmp_path: Path,
) -> None:
    """The T5 export's tokenizer.json, loaded by AutoTokenizer with sentencepiece and
    protobuf blocked, encodes a text as our T5 encoder input: its pieces, then <|eod|>
    (no BOS), as span-corruption samples and ``generate_seq2seq`` prompts end."""
    lines = (REPO / "preprocessing/sample_corpus/stories.jsonl").read_text().splitlines()
    docs = [json.loads(line)["text"] for line in lines[:300]]
    specials = [*DEFAULT_SPECIAL_TOKENS, "<extra_id_0>", "<extra_id_1>"]
    tok_config = TokenizerConfig(
        vocab_size=400, pad_vocab_multiple=64, max_training_documents=300, special_tokens=specials
    )
    tokenizer = train_tokenizer(docs, tok_config, str(tmp_path / "tok"))
    config = ModelConfig(
        family="t5", num_layers=1, num_decoder_layers=1, hidden_size=32, num_attention_heads=4,
        vocab_size=tokenizer.padded_vocab_size, max_position_embeddings=32,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )  # fmt: skip
    model = build_model(config)
    package = save_model_package(model, config, tmp_path / "tok.model", tmp_path / "pkg")
    hf_dir = export_hf(package, tmp_path / "hf")
    texts = [*SAMPLE_TEXTS, "Once upon a time,<extra_id_0>"]  # the sentinel ends the prompt
    command = [sys.executable, "-c", NO_SENTENCEPIECE, str(hf_dir), json.dumps(texts)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    ours = load_tokenizer(str(tmp_path / "tok.model"))
    assert result["with_specials"] == [encoder_ids(ours, text) for text in texts]
    assert result["eos_pad"] == [ours.eod_id, ours.pad_id]
    assert result["decoded"][:-1] == SAMPLE_TEXTS


def test_tokenizer_json_of_a_unigram_model_encodes_as_sentencepiece(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    lines = (REPO / "preprocessing/sample_corpus/stories.jsonl").read_text().splitlines()
    docs = [json.loads(line)["text"] for line in lines[:200]]
    config = TokenizerConfig(model_type="unigram", vocab_size=600, max_training_documents=200)
    train_tokenizer(docs, config, str(tmp_path / "uni"))
    model_file = tmp_path / "uni.model"
    fast = fast_tokenizer_json(model_file, "<|eod|> $A")
    assert fast["model"]["type"] == "Unigram"
    (tmp_path / "tokenizer.json").write_text(json.dumps(fast), encoding="utf-8")
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    for text in [*SAMPLE_TEXTS, *docs[-5:]]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_export_refuses_a_non_empty_output_unless_overwrite(exported: dict, tmp_path: Path):
    _, package, _ = exported["gpt2"]
    out = tmp_path / "hf"
    out.mkdir()
    export_hf(package, out)  # an empty directory is fine
    with pytest.raises(HFInteropError, match="not empty"):
        export_hf(package, out)
    assert main(["export", "hf", str(package), str(out)]) == 1
    assert main(["export", "hf", str(package), str(out), "--overwrite"]) == 0
    assert not list(tmp_path.glob(".hf.*"))  # no temporary directory left behind


def test_export_refuses_moe(tokenizer_file: Path, tmp_path: Path) -> None:
    config = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, num_experts=2, moe_top_k=1,
    )  # fmt: skip
    package = save_model_package(GPTModel(config), config, tokenizer_file, tmp_path / "pkg")
    with pytest.raises(HFInteropError, match="mixture-of-experts"):
        export_hf(package, tmp_path / "hf")


def _copy(hf_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_dir, tmp_path / "hf"))


def test_import_refuses_torch_bin_unless_allowed(exported: dict, tmp_path: Path) -> None:
    model, _, source = exported["llama-gqa"]
    hf_dir = _copy(source, tmp_path)
    weights = hf_dir / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(weights), hf_dir / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(HFInteropError, match="--allow-torch-bin"):
        import_hf(hf_dir, tmp_path / "pkg")
    assert main(["import", "hf", str(hf_dir), str(tmp_path / "pkg")]) == 1
    loaded, _, _ = load_model_package(import_hf(hf_dir, tmp_path / "pkg", allow_torch_bin=True))
    assert torch.equal(loaded(tokens()), model(tokens()))


class _WritesMarker:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_import_never_unpickles_code_even_with_allow_torch_bin(
    exported: dict, tmp_path: Path
) -> None:
    hf_dir = _copy(exported["llama-gqa"][2], tmp_path)
    (hf_dir / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": _WritesMarker(marker)}, hf_dir / "pytorch_model.bin")
    with pytest.raises(HFInteropError, match="weights_only=True"):
        import_hf(hf_dir, tmp_path / "pkg", allow_torch_bin=True)
    assert not marker.exists()


def test_import_refuses_unknown_model_type_and_missing_tokenizer(
    exported: dict, tmp_path: Path
) -> None:
    hf_dir = _copy(exported["gpt2"][2], tmp_path)
    (hf_dir / "tokenizer.model").unlink()
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(HFInteropError, match="no tokenizer.model, tokenizer.json or vocab.json"):
        import_hf(hf_dir, tmp_path / "pkg")
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(HFInteropError, match="model_type 'mistral' is not supported"):
        import_hf(hf_dir, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_import_names_missing_and_misshapen_tensors(exported: dict, tmp_path: Path) -> None:
    hf_dir = _copy(exported["llama-gqa"][2], tmp_path)
    config_path = hf_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(
        HFInteropError, match=r"config.json: num_hidden_layers is 3, the weights hold 2 numbered"
    ):
        import_hf(hf_dir, tmp_path / "pkg")
    config_path.write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(HFInteropError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        import_hf(hf_dir, tmp_path / "pkg")
    config_path.write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn"}}))
    with pytest.raises(HFInteropError, match="RoPE scaling rope_type 'yarn' is not supported"):
        import_hf(hf_dir, tmp_path / "pkg")


def test_import_reads_original_gpt2_names_and_skips_mask_buffers(
    exported: dict, tmp_path: Path
) -> None:
    """openai-community/gpt2 names tensors without ``transformer.`` and saves the causal
    mask buffers ``h.{i}.attn.bias``."""
    from safetensors.torch import load_file, save_file

    model, _, source = exported["gpt2"]
    hf_dir = _copy(source, tmp_path)
    tensors = {
        k.removeprefix("transformer."): v
        for k, v in load_file(source / "model.safetensors").items()
    }
    for i in range(model.config.num_layers):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32).tril()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    loaded, _, _ = load_model_package(import_hf(hf_dir, tmp_path / "pkg"))
    assert torch.equal(loaded(tokens()), model(tokens()))


def test_bfloat16_export_and_import(tokenizer_file: Path, tmp_path: Path) -> None:
    model = tiny_model("llama-gqa", init_std=0.02, norm_noise=0.1).to(torch.bfloat16)
    package = save_model_package(model, model.config, tokenizer_file, tmp_path / "pkg")
    hf_dir = export_hf(package, tmp_path / "hf")
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "bfloat16"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    x = tokens()
    with torch.no_grad():
        theirs = hf_model.eval()(x).logits.float()
        ours = model(x)
    assert (ours - theirs).abs().max().item() < 2e-2  # bf16 rounding, different op order
    back, _, _ = load_model_package(import_hf(hf_dir, tmp_path / "back"))
    assert back.embedding.word.weight.dtype == torch.bfloat16
    assert torch.equal(back(x), ours)
    fp32, _, _ = load_model_package(import_hf(hf_dir, tmp_path / "fp32", dtype="float32"))
    assert fp32.embedding.word.weight.dtype == torch.float32
