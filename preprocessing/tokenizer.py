"""SentencePiece tokenizers: train one on a corpus sample, or load an existing ``.model``.

A tokenizer's identity is the sha256 of its ``.model`` bytes; every manifest and
checkpoint records it, so training must be deterministic: the same documents and
config give a byte-identical model. To that end the model is trained in memory
(no temporary paths end up in its trainer spec), on an explicit document sample
(no SentencePiece-side shuffling) with a fixed thread count, and only then written.

Text is kept lossless (identity normalization, spaces preserved, byte fallback), so
``decode(encode(text)) == text``. Newlines are not in the learned vocabulary (training
sees one line at a time) and encode as the byte piece ``<0x0A>`` (as ``<unk>``
without byte fallback).
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sentencepiece as spm
from google.protobuf.message import DecodeError

from megalith import safe_read
from megalith.config import TokenizerConfig
from megalith.errors import MegalithError
from megalith.storage import atomic_write_bytes, sha256_of_bytes

EOD_TOKEN = "<|eod|>"
PAD_TOKEN = "<|pad|>"
SENTINEL_FORMAT = "<extra_id_{}>"  # T5's span-corruption sentinels, <extra_id_0> first

# Unigram training sums EM statistics per thread, so the float results (and the
# model bytes) depend on the thread count. Fixing it keeps the id machine-independent.
TRAIN_THREADS = 4
# A path read from a manifest may name /dev/zero or a huge file: SentencePiece models are
# a few MB even at 256k pieces.
MAX_MODEL_BYTES = 256 << 20

_TOO_LARGE = re.compile(
    r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)"
)


class TokenizerError(MegalithError):
    """A tokenizer file that cannot be read, or settings that cannot train one."""


@dataclass(frozen=True)
class Tokenizer:
    model_path: str
    id: str  # sha256 of the .model bytes: the tokenizer's identity in every manifest
    vocab_size: int
    padded_vocab_size: int
    eod_id: int
    pad_id: int | None
    special_ids: dict[str, int]
    model_bytes: bytes = field(repr=False)
    _processor: spm.SentencePieceProcessor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_processor", _processor_from_bytes(self.model_bytes, self.model_path)
        )

    # Pickling (e.g. to worker processes) sends the model bytes, not the C++ object.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_processor"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(
            self, "_processor", _processor_from_bytes(self.model_bytes, self.model_path)
        )

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._processor.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(int(token_id))


def with_eod(tokenizer: Tokenizer, eod: str) -> Tokenizer:
    """The tokenizer with EOD = its own ``</s>`` when ``eod`` is ``"eos"``, else unchanged."""
    if eod == "token":
        return tokenizer
    eos_id = tokenizer._processor.eos_id()
    if eos_id < 0:
        raise TokenizerError(f"{tokenizer.model_path}: data.eod is 'eos' but it has no eos id")
    return replace(tokenizer, eod_id=eos_id)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round up to a multiple (embedding tables split evenly and run faster)."""
    if multiple < 1:
        raise ValueError(f"pad_vocab_multiple must be >= 1, got {multiple}")
    return -(-vocab_size // multiple) * multiple


def _processor_from_bytes(model_bytes: bytes, name: str) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model_bytes)
    except (RuntimeError, OSError, TypeError, ValueError):  # ValueError: a piece not UTF-8
        raise TokenizerError(f"{name}: not a SentencePiece model file") from None
    if processor.get_piece_size() == 0:
        raise TokenizerError(f"{name}: not a SentencePiece model (no pieces)")
    for piece_id in range(processor.get_piece_size()):
        try:  # a piece that is not UTF-8 loads, then fails every decode that meets it
            processor.id_to_piece(piece_id)
        except UnicodeDecodeError:
            raise TokenizerError(f"{name}: piece {piece_id} is not UTF-8 text") from None
    return processor


def _special_ids(model_bytes: bytes, name: str) -> dict[str, int]:
    """Control, unknown and user-defined pieces (the processor API cannot tell the last apart)."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(model_bytes)
    except DecodeError:  # bytes SentencePiece's own parser let through
        raise TokenizerError(f"{name}: not a SentencePiece model file (corrupt protobuf)") from None
    special = {
        sentencepiece_model_pb2.ModelProto.SentencePiece.UNKNOWN,
        sentencepiece_model_pb2.ModelProto.SentencePiece.CONTROL,
        sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED,
    }
    return {piece.piece: i for i, piece in enumerate(model.pieces) if piece.type in special}


def tokenizer_from_bytes(
    model_bytes: bytes, model_path: str, pad_vocab_multiple: int = 128
) -> Tokenizer:
    """Build a ``Tokenizer`` from serialized model bytes; ``model_path`` is where they live."""
    processor = _processor_from_bytes(model_bytes, model_path)
    special_ids = _special_ids(model_bytes, model_path)
    if EOD_TOKEN in special_ids:
        eod_id = special_ids[EOD_TOKEN]
    elif processor.eos_id() >= 0:
        eod_id = processor.eos_id()
    else:
        raise TokenizerError(f"{model_path}: has neither a {EOD_TOKEN} token nor an eos id")
    vocab_size = processor.get_piece_size()
    return Tokenizer(
        model_path=model_path,
        id=sha256_of_bytes(model_bytes),
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, pad_vocab_multiple),
        eod_id=eod_id,
        pad_id=special_ids.get(PAD_TOKEN),
        special_ids=special_ids,
        model_bytes=model_bytes,
    )


def load_tokenizer(
    url: str, pad_vocab_multiple: int = 128, storage_options: dict[str, Any] | None = None
) -> Tokenizer:
    """Load a SentencePiece ``.model`` from a local path or any fsspec URL."""
    try:
        model_bytes = safe_read.read_bytes_bounded(url, MAX_MODEL_BYTES, storage_options)
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer model not found: {url}") from None
    except IsADirectoryError:
        raise TokenizerError(
            f"tokenizer model {url} is a directory, expected a .model file"
        ) from None
    return tokenizer_from_bytes(model_bytes, url, pad_vocab_multiple)


def sample_documents(texts: Iterable[str], limit: int, seed: int) -> list[str]:
    """At most ``limit`` documents, chosen uniformly by seeded reservoir sampling.

    One pass and O(limit) memory for any corpus size. The sample keeps corpus order,
    and a corpus of ``limit`` documents or fewer is returned whole.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for index, text in enumerate(texts):
        if index < limit:
            reservoir.append((index, text))
            continue
        slot = rng.randrange(index + 1)
        if slot < limit:
            reservoir[slot] = (index, text)
    reservoir.sort(key=lambda item: item[0])
    return [text for _, text in reservoir]


def split_for_training(text: str, max_bytes: int) -> Iterator[str]:
    """Lines of ``text``, with any line longer than ``max_bytes`` (UTF-8) cut at spaces.

    SentencePiece silently skips longer sentences, and newlines are not part of
    its training sentences anyway (they encode through byte fallback).
    """
    for line in text.splitlines():
        if not line.strip():
            continue
        if len(line.encode("utf-8")) <= max_bytes:
            yield line
            continue
        yield from _chunks(line, max_bytes)


def _chunks(line: str, max_bytes: int) -> Iterator[str]:
    chunk, size = [], 0
    for word in re.findall(r"\s*\S+", line):
        length = len(word.encode("utf-8"))
        if length > max_bytes:
            if chunk:
                yield "".join(chunk)
                chunk, size = [], 0
            yield from _cut_bytes(word, max_bytes)
            continue
        if size + length > max_bytes:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(word)
        size += length
    if chunk:
        yield "".join(chunk)


def _cut_bytes(word: str, max_bytes: int) -> Iterator[str]:
    """Cut one very long word into pieces of at most ``max_bytes``, between characters."""
    piece, size = [], 0
    for char in word:
        length = len(char.encode("utf-8"))
        if size + length > max_bytes:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(char)
        size += length
    if piece:
        yield "".join(piece)


def trainer_options(config: TokenizerConfig, verbose: bool = False) -> dict[str, Any]:
    """The SentencePiece trainer settings; everything that shapes the model is here."""
    return {
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "character_coverage": config.character_coverage,
        "byte_fallback": config.byte_fallback,
        "user_defined_symbols": list(config.special_tokens)
        + sentinel_names(config.sentinel_tokens),
        "max_sentence_length": config.max_sentence_length,
        # Lossless text: no NFKC, keep runs of spaces, so decode(encode(x)) == x.
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "allow_whitespace_only_pieces": True,
        "split_digits": True,
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": -1,
        # We sample documents ourselves; SentencePiece must use all it is given, in order.
        "input_sentence_size": 0,
        "shuffle_input_sentence": False,
        "num_threads": TRAIN_THREADS,
        "minloglevel": 0 if verbose else 2,
    }


def sentinel_names(count: int) -> list[str]:
    """``<extra_id_0>`` .. ``<extra_id_{count-1}>``: T5's sentinels, in the order spans use them."""
    return [SENTINEL_FORMAT.format(i) for i in range(count)]


def sentinel_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of the tokenizer's sentinels ``<extra_id_0>, <extra_id_1>, ...`` (consecutive
    from 0; empty when it has none)."""
    ids = []
    while (name := SENTINEL_FORMAT.format(len(ids))) in tokenizer.special_ids:
        ids.append(tokenizer.special_ids[name])
    return ids


def require_sentinels(tokenizer: Tokenizer, count: int) -> list[int]:
    """The first ``count`` sentinel ids, or an error naming the tokenizer file: a T5 run
    whose samples need more sentinels than the tokenizer was trained with."""
    ids = sentinel_ids(tokenizer)
    if len(ids) < count:
        raise TokenizerError(
            f"{tokenizer.model_path}: has {len(ids)} sentinel tokens (<extra_id_N>) but span "
            f"corruption needs {count}: train the tokenizer with tokenizer.sentinel_tokens >= "
            f"{count} (T5 uses 100) and prepare the data again, or shorten "
            "data.span_corruption.encoder_length"
        )
    return ids[:count]


def _check_config(config: TokenizerConfig) -> None:
    duplicates = {t for t in config.special_tokens if config.special_tokens.count(t) > 1}
    if duplicates:
        raise TokenizerError(f"tokenizer.special_tokens lists {sorted(duplicates)} more than once")
    if any(not t or t.isspace() for t in config.special_tokens):
        raise TokenizerError("tokenizer.special_tokens contains an empty or blank token")
    clashes = set(config.special_tokens) & set(sentinel_names(config.sentinel_tokens))
    if clashes:
        raise TokenizerError(
            f"tokenizer.special_tokens lists {sorted(clashes)}, which tokenizer.sentinel_tokens "
            "adds itself: remove them from special_tokens"
        )


def _train_in_memory(sentences: Sequence[str], config: TokenizerConfig, verbose: bool) -> bytes:
    # In memory, not into a temporary directory: the trainer spec stored inside the
    # model would otherwise record the temporary path, and the id would change each run.
    if not sentences:
        raise TokenizerError("no text to train the tokenizer on (every document was empty)")
    sink = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=sink, **trainer_options(config, verbose)
        )
    except RuntimeError as exc:
        raise _explain_training_error(exc, config) from None
    return sink.getvalue()


def _explain_training_error(exc: RuntimeError, config: TokenizerConfig) -> TokenizerError:
    message = str(exc)
    too_large = _TOO_LARGE.search(message)
    if too_large:
        limit = int(too_large.group(2))
        return TokenizerError(
            f"tokenizer.vocab_size {config.vocab_size} is too large for this corpus: "
            f"SentencePiece can build at most {limit} pieces from it. "
            f"Use a smaller --vocab-size (at most {limit}) or train on more text."
        )
    return TokenizerError(f"SentencePiece training failed: {message}")


def vocab_text(tokenizer: Tokenizer) -> bytes:
    """The ``.vocab`` file SentencePiece writes beside a model: ``piece<TAB>score`` lines."""
    processor = tokenizer._processor
    lines = [
        f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
        for i in range(processor.get_piece_size())
    ]
    return "".join(lines).encode("utf-8")


def train_tokenizer(
    documents: Iterable[str],
    config: TokenizerConfig,
    output_prefix: str,
    storage_options: dict[str, Any] | None = None,
    verbose: bool = False,
) -> Tokenizer:
    """Train SentencePiece and write ``PREFIX.model`` and ``PREFIX.vocab`` atomically.

    At most ``config.max_training_documents`` documents are used (a seeded sample);
    ``output_prefix`` is a local path or any fsspec URL. Same documents and config,
    same model bytes, same tokenizer id.
    """
    _check_config(config)
    sample = sample_documents(documents, config.max_training_documents, config.seed)
    sentences = [
        sentence
        for text in sample
        for sentence in split_for_training(text, config.max_sentence_length)
    ]
    model_bytes = _train_in_memory(sentences, config, verbose)
    model_url = f"{output_prefix}.model"
    tokenizer = tokenizer_from_bytes(model_bytes, model_url, config.pad_vocab_multiple)
    # The vocab first: a complete .model is the signal that training finished.
    atomic_write_bytes(f"{output_prefix}.vocab", vocab_text(tokenizer), storage_options)
    atomic_write_bytes(model_url, model_bytes, storage_options)
    return tokenizer
