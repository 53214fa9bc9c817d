"""A corpus: the resolved input files of a ``DataConfig`` read as one document stream."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from megalith.config import ConfigError, DataConfig, TokenizerConfig
from preprocessing.chat import conversation_contents
from preprocessing.readers import InputFile, RejectLog, TextBatch, iter_text_batches, resolve_inputs
from preprocessing.tokenizer import Tokenizer, sample_documents, train_tokenizer


@dataclass
class Corpus:
    """The inputs of one preprocessing job, checked to exist before any work starts."""

    config: DataConfig
    files: list[InputFile] = field(default_factory=list)

    @classmethod
    def open(cls, config: DataConfig) -> Corpus:
        if not config.inputs:
            raise ConfigError("data.inputs is empty: give at least one --input file, glob or URL")
        files = resolve_inputs(config.inputs, config.input_format, config.storage_options)
        return cls(config=config, files=files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def text_bytes_hint(self) -> int:
        """Stored size when it equals the text bytes the readers report (0: unknown)."""
        plain = all(f.compression is None and f.format != "parquet" for f in self.files)
        return self.total_bytes if plain else 0

    def file_batches(self, index: int, rejects: RejectLog) -> Iterator[TextBatch]:
        """Batches of valid documents from one input file, bad records handled by policy."""
        return iter_text_batches(
            self.files[index],
            json_key=self.config.json_key,
            text_mode=self.config.text_mode,
            on_bad_record=self.config.on_bad_record,
            rejects=rejects,
            batch_size=self.config.batch_documents,
            storage_options=self.config.storage_options,
            chat=self.config.format == "chat",
        )

    def batches(self, rejects: RejectLog) -> Iterator[tuple[int, TextBatch]]:
        """Yield ``(file_index, batch)`` over every file in order."""
        for index in range(len(self.files)):
            for batch in self.file_batches(index, rejects):
                yield index, batch

    def documents(self, rejects: RejectLog | None = None) -> Iterator[str]:
        rejects = rejects or RejectLog(max_examples=self.config.max_bad_examples)
        for _, batch in self.batches(rejects):
            yield from batch.texts


def train_tokenizer_on_corpus(
    corpus: Corpus, config: TokenizerConfig, output_prefix: str
) -> Tokenizer:
    """Train SentencePiece on a seeded sample of at most ``max_training_documents`` documents."""
    documents = corpus.documents()
    if corpus.config.format == "chat":  # train on what the messages say, not on their JSON
        documents = conversation_contents(documents)
    sample = sample_documents(documents, config.max_training_documents, config.seed)
    if not sample:
        raise ConfigError(f"no usable documents in {corpus.config.inputs}: nothing to train on")
    return train_tokenizer(sample, config, output_prefix, corpus.config.storage_options)
