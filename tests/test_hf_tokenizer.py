"""Hugging Face ``tokenizers`` tokenizers beside SentencePiece: a byte-level BPE trained
here and a GPT-2-style vocab.json + merges.txt pair, through prepare, training, serving,
and the HF export and import (the tokenizer.json kept byte for byte)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from parallel_helpers import CORPUS, config_of, fit_one_process, tiny_settings
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

from megalith.config import load_config
from preprocessing.stage import run_tokenize_stage
from preprocessing.tokenizer import TokenizerError, load_tokenizer
from preprocessing.verify import decode_samples, verify_shard_set
from training.inference.decode import SamplingConfig, generate
from training.inference.loading import load_served_model
from training.interop.export import export_hf
from training.interop.hf import hf_tokenizer_file, import_hf
from training.models.gpt import GPTModel
from training.models.package import load_model_package, save_model_package

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|pad|>"]
TEXT = "Once upon a time,\n  a dragon said «héllo» 🐉 <|endoftext|> and left."


def stories(count: int) -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:count]]


def train_byte_level_bpe(vocab_size: int = 384) -> HFBackend:
    tokenizer = HFBackend(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stories(300), trainer)
    return tokenizer


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer.json trained by ``tokenizers`` on the sample stories."""
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_byte_level_bpe().save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2-style ``gpt2-vocab.json`` + ``gpt2-merges.txt`` (Megatron-LM's names)."""
    folder = tmp_path_factory.mktemp("gpt2")
    train_byte_level_bpe(320).model.save(str(folder), "gpt2")
    assert (folder / "gpt2-merges.txt").is_file()
    return folder / "gpt2-vocab.json"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in stories(200)))
    return path


def prepare(tokenizer: Path, corpus: Path, output: Path, *extra: str):
    return prepare_trained(corpus, output, f"tokenizer.model={tokenizer}", *extra)


def test_both_kinds_encode_losslessly_with_their_own_specials(
    bpe_json: Path, gpt2_pair: Path
) -> None:
    for path in (bpe_json, gpt2_pair):
        tokenizer = load_tokenizer(str(path))
        assert tokenizer.kind == "hf" and tokenizer.file_name == "tokenizer.json"
        eod = tokenizer.special_ids["<|endoftext|>"]
        # No <|eod|> token: the eos separates documents, with either data.eod.
        assert tokenizer.eod_id == tokenizer.eos_id == eod
        ids = tokenizer.encode(TEXT)
        assert eod in ids and ids[0] != eod  # the text alone: nothing added in front
        assert tokenizer.decode(ids) == TEXT
        assert max(ids) < tokenizer.vocab_size <= tokenizer.padded_vocab_size
        # Each token's bytes (what OpenAI logprobs show) put back together are the text.
        assert b"".join(map(tokenizer.token_bytes, ids)) == TEXT.encode()
        assert tokenizer.token_bytes(tokenizer.encode(" the")[0]).startswith(b" ")
        rebuilt = copy.deepcopy(tokenizer)  # from its bytes, as prepare's workers get it
        assert rebuilt.encode_batch([TEXT, "x"]) == [ids, tokenizer.encode("x")]
    pair = load_tokenizer(str(gpt2_pair))
    assert pair.pad_id == pair.special_ids["<|pad|>"] and pair.vocab_size == 320
    # The pair is built into a tokenizer.json the same way every time: the same id.
    assert load_tokenizer(str(gpt2_pair)).model_bytes == pair.model_bytes
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFBackend.from_str(
        pair.model_bytes.decode()
    ))  # fmt: skip
    assert hf.encode(TEXT) == pair.encode(TEXT)


def test_malformed_tokenizer_files_are_clear_errors_naming_the_file(
    bpe_json: Path, gpt2_pair: Path, tmp_path: Path
) -> None:
    text = bpe_json.read_text()
    cases = {
        "truncated.json": (text[: len(text) // 2], "not valid JSON"),
        "wrong.json": ('{"model": {"type": "BPE", "vocab": 3}}', "not a Hugging Face tokenizer"),
        "list.json": ("[1, 2]", "expected a JSON object"),
        "binary.json": ("\x00\x01", "not valid JSON"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(TokenizerError, match=f"{tmp_path / name}: {message}"):
            load_tokenizer(str(tmp_path / name))
    no_eos = json.loads(text)
    for token in no_eos["added_tokens"]:
        token["content"] = token["content"].replace("endoftext", "other")
    (tmp_path / "no-eos.json").write_text(json.dumps(no_eos))
    with pytest.raises(TokenizerError, match=r"no-eos.json: has no <\|eod\|> token and none"):
        load_tokenizer(str(tmp_path / "no-eos.json"))
    huge = json.loads(text)
    huge["model"]["vocab"] = {k: v + 2**31 for k, v in huge["model"]["vocab"].items()}
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    with pytest.raises(TokenizerError, match="huge.json: token id 2147"):
        load_tokenizer(str(tmp_path / "huge.json"))
    # A truncation setting would cut documents (this one makes tokenizers panic): ignored.
    cut = json.loads(text)
    cut["truncation"] = {
        "max_length": 1, "stride": 5, "strategy": "LongestFirst", "direction": "Right"
    }  # fmt: skip
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    whole = load_tokenizer(str(bpe_json)).encode(TEXT)
    assert load_tokenizer(str(tmp_path / "cut.json")).encode(TEXT) == whole
    # A vocab.json alone, merges that do not fit it, a vocab.json not named *vocab.json.
    shutil.copy(gpt2_pair, tmp_path / "vocab.json")
    with pytest.raises(TokenizerError, match=f"not found: {tmp_path / 'merges.txt'}"):
        load_tokenizer(str(tmp_path / "vocab.json"))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠt he\nzzz qqq\n")
    with pytest.raises(TokenizerError, match=f"{tmp_path / 'merges.txt'} does not fit"):
        load_tokenizer(str(tmp_path / "vocab.json"))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t h\n")
    with pytest.raises(TokenizerError, match="merges.txt: line 2 is not two tokens"):
        load_tokenizer(str(tmp_path / "vocab.json"))
    shutil.copy(gpt2_pair, tmp_path / "words.json")
    with pytest.raises(TokenizerError, match=r"words.json: not a Hugging Face.*GPT-2 vocab"):
        load_tokenizer(str(tmp_path / "words.json"))


def test_gpt2_pair_prepares_shards_that_verify_and_decode(
    gpt2_pair: Path, corpus: Path, tmp_path: Path
) -> None:
    report = prepare(gpt2_pair, corpus, tmp_path / "shards", "data.eod=eos", "data.shards=1")
    manifest = report.manifest
    tokenizer = load_tokenizer(str(gpt2_pair))
    assert manifest.tokenizer.kind == "hf" and manifest.tokenizer.id == tokenizer.id
    assert manifest.tokenizer.eod_id == tokenizer.special_ids["<|endoftext|>"]
    assert manifest.documents == 200 and manifest.dtype == "uint16"
    assert verify_shard_set(str(tmp_path / "shards")) == []
    decoded = decode_samples(manifest, str(tmp_path / "shards"), tokenizer, 3, max_chars=10**6)
    assert [d.removesuffix("<|endoftext|>") for d in decoded] == stories(3)
    # As Megatron-LM's preprocess_data.py --tokenizer-type GPT2BPETokenizer leaves them: no
    # manifest, the tokenizer and EOD named by the user.
    (tmp_path / "megatron").mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(
            tmp_path / "shards" / f"shard-00000{suffix}", tmp_path / f"megatron/doc{suffix}"
        )
    prefix = str(tmp_path / "megatron/doc")
    assert verify_shard_set(prefix, tokenizer=str(gpt2_pair), eod="eos") == []


def test_tokenizer_json_prepare_train_serve_export_import(
    bpe_json: Path, corpus: Path, tmp_path: Path
) -> None:
    """The Hugging Face user's path end to end: shards, a 2-step run, its package served,
    exported to transformers and imported back, the tokenizer.json byte-identical all along."""
    tokenizer = load_tokenizer(str(bpe_json))
    report = prepare(bpe_json, corpus, tmp_path / "shards", "data.shards=1")
    assert report.manifest.tokenizer.kind == "hf"
    assert verify_shard_set(str(tmp_path / "shards")) == []

    settings = tiny_settings(
        tmp_path / "shards", {"training.train_iters": 2, "training.eval_interval": 0}
    )
    run = fit_one_process(settings, tmp_path / "run")
    package = run / "model"
    assert (package / "tokenizer.json").read_bytes() == bpe_json.read_bytes()
    assert not (package / "tokenizer.model").exists()
    meta = json.loads((package / "config.json").read_text())
    assert meta["tokenizer"] == {"file": "tokenizer.json", "id": tokenizer.id, "kind": "hf"}
    assert meta["model"]["vocab_size"] == tokenizer.padded_vocab_size

    served = load_served_model(str(package))
    assert served.tokenizer.id == tokenizer.id and served.tokenizer.kind == "hf"
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, stop_at_eod=False)
    result = generate(served.model, served.tokenizer, ["Once upon a time"], sampling)
    (generation,) = result.generations
    prompt = served.prompt_ids("Once upon a time")
    assert prompt == [tokenizer.eod_id, *tokenizer.encode("Once upon a time")]
    assert len(generation.token_ids) == 6
    assert generation.text == served.text(prompt, generation.token_ids)
    assert generation.text == tokenizer.decode(generation.token_ids)

    hf_dir = export_hf(package, tmp_path / "hf")
    assert (hf_dir / "tokenizer.json").read_bytes() == bpe_json.read_bytes()
    assert not (hf_dir / "tokenizer.model").exists()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.pad_token == "<|pad|>"
    assert hf_tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    generation_config = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == tokenizer.eod_id

    imported = import_hf(hf_dir, tmp_path / "imported")
    assert (imported / "tokenizer.json").read_bytes() == bpe_json.read_bytes()
    model, _, path = load_model_package(package)
    again, _, path_again = load_model_package(imported)
    assert load_tokenizer(str(path_again)).id == load_tokenizer(str(path)).id
    x = torch.tensor([[tokenizer.eod_id, *tokenizer.encode(TEXT)][:32]])
    with torch.no_grad():
        assert torch.equal(model(x), again(x))


def test_import_takes_a_gpt2_pair_and_refuses_a_directory_without_tokenizer(
    bpe_json: Path, gpt2_pair: Path, tmp_path: Path
) -> None:
    config = load_config(REPO / "configs/tiny-cpu.yaml").model.model_copy(
        update={"vocab_size": 384, "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64}
    )
    hf_dir = export_hf(
        save_model_package(GPTModel(config), config, bpe_json, tmp_path / "pkg"), tmp_path / "hf"
    )
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(Exception, match="no tokenizer.model, tokenizer.json or vocab.json"):
        import_hf(hf_dir, tmp_path / "none")
    shutil.copy(gpt2_pair, hf_dir / "vocab.json")
    shutil.copy(gpt2_pair.with_name("gpt2-merges.txt"), hf_dir / "merges.txt")
    assert hf_tokenizer_file(hf_dir) == hf_dir / "vocab.json"
    package = import_hf(hf_dir, tmp_path / "from-pair")
    stored = load_tokenizer(str(package / "tokenizer.json"))
    assert stored.id == load_tokenizer(str(gpt2_pair)).id
    assert stored.model_bytes == (package / "tokenizer.json").read_bytes()


def test_prepare_trains_a_byte_level_bpe_the_same_every_time(corpus: Path, tmp_path: Path) -> None:
    """``tokenizer.model_type: byte_bpe`` (``megalith data train-tokenizer --model-type
    byte_bpe``): a tokenizers BPE with Megalith's special tokens, so EOD is <|eod|>."""
    reports = [
        prepare_trained(corpus, tmp_path / name, "tokenizer.model_type=byte_bpe")
        for name in ("a", "b")
    ]
    first, second = (tmp_path / name / "tokenizer.json" for name in ("a", "b"))
    assert first.read_bytes() == second.read_bytes()
    tokenizer = load_tokenizer(str(first))
    manifest = reports[0].manifest
    assert manifest.tokenizer.kind == "hf" and manifest.tokenizer.id == tokenizer.id
    assert tokenizer.vocab_size == 512 and tokenizer.eod_id == tokenizer.special_ids["<|eod|>"]
    assert tokenizer.pad_id == tokenizer.special_ids["<|pad|>"]
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert verify_shard_set(str(tmp_path / "a")) == []
    # Its special tokens include the chat template's: chat data prepares with it.
    chat = prepare(first, REPO / "preprocessing/sample_corpus/chat.jsonl", tmp_path / "chat",
                   "data.format=chat")  # fmt: skip
    assert chat.manifest.data_format == "chat" and chat.manifest.documents > 0
    assert verify_shard_set(str(tmp_path / "chat")) == []
    with pytest.raises(TokenizerError, match="vocab_size 100 is too small for a byte-level BPE"):
        prepare_trained(
            corpus, tmp_path / "c", "tokenizer.model_type=byte_bpe", "tokenizer.vocab_size=100"
        )


def prepare_trained(corpus: Path, output: Path, *extra: str):
    config = load_config(
        REPO / "configs/tiny-cpu.yaml",
        [f"data.output={output}", "data.workers=1", "tokenizer.vocab_size=512", *extra],
        {"data.inputs": [str(corpus)]},
    )
    return run_tokenize_stage(config, show_progress=False)


def test_finetune_a_model_whose_vocabulary_is_not_padded(
    gpt2_pair: Path, corpus: Path, tmp_path: Path
) -> None:
    """An imported model's table need not be a multiple of 128 (GPT-2's 50,257 ids): data
    tokenized with its tokenizer fine-tunes it when every id fits."""
    prepare(gpt2_pair, corpus, tmp_path / "shards", "data.shards=1")
    settings = tiny_settings(tmp_path / "shards", {"training.train_iters": 2})
    config = config_of(settings).model.model_copy(update={"vocab_size": 320})
    base = save_model_package(GPTModel(config), config, gpt2_pair, tmp_path / "base")
    settings = {**settings, "finetune.base": str(base), "training.eval_interval": 0}
    package = fit_one_process(settings, tmp_path / "run") / "model"
    meta = json.loads((package / "config.json").read_text())
    assert meta["model"]["vocab_size"] == 320 and meta["tokenizer"]["kind"] == "hf"
    stored = load_tokenizer(str(package / "tokenizer.json"))
    assert stored.id == load_tokenizer(str(gpt2_pair)).id and stored.padded_vocab_size == 384
