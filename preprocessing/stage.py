"""The tokenize stage as plain functions: what ``megalith data prepare`` and the
``tokenize-corpus`` flow both run."""

from __future__ import annotations

from megalith import safe_read
from megalith.config import ConfigError, MegalithConfig
from megalith.errors import MegalithError
from megalith.storage import atomic_write_json, join
from preprocessing.corpus import Corpus, train_tokenizer_on_corpus
from preprocessing.prepare import PrepareReport, input_fingerprint, prepare_dataset
from preprocessing.tokenizer import Tokenizer, load_tokenizer, trained_tokenizer_url


def tokenizer_prefix(config: MegalithConfig) -> str:
    if config.tokenizer.output_prefix:
        return config.tokenizer.output_prefix
    if not config.data.output:
        raise ConfigError("set tokenizer.output_prefix or data.output: the tokenizer needs a home")
    return join(config.data.output, "tokenizer")


def ensure_tokenizer(config: MegalithConfig) -> Tokenizer:
    """Load ``tokenizer.model`` (any tokenizer file) if given, else train one on the corpus (reusing a previous
    training with the same inputs and settings)."""
    settings = config.tokenizer
    options = config.data.storage_options
    if settings.model:
        return load_tokenizer(settings.model, settings.pad_vocab_multiple, options)
    corpus = Corpus.open(config.data)
    prefix = tokenizer_prefix(config)
    key = {
        "inputs": input_fingerprint(corpus),
        "tokenizer": settings.model_dump(mode="json", exclude={"model", "output_prefix"}),
    }
    record_url = f"{prefix}.train.json"
    try:
        record = safe_read.read_json(record_url, storage_options=options, expect=dict)
        if record.get("key") == key:
            url = trained_tokenizer_url(prefix, settings)
            tokenizer = load_tokenizer(url, settings.pad_vocab_multiple, options)
            if tokenizer.id == record.get("id"):
                return tokenizer
    except (FileNotFoundError, ValueError, OSError, MegalithError):
        pass
    tokenizer = train_tokenizer_on_corpus(corpus, settings, prefix)
    atomic_write_json(record_url, {"key": key, "id": tokenizer.id}, options)
    return tokenizer


def run_tokenize_stage(config: MegalithConfig, show_progress: bool = True) -> PrepareReport:
    tokenizer = ensure_tokenizer(config)
    return prepare_dataset(config.data, tokenizer, config.tokenizer, show_progress=show_progress)
