"""Tokenizers: SentencePiece (train one on a corpus sample, or load a ``.model``) and
Hugging Face ``tokenizers`` (a ``tokenizer.json``, or a GPT-2 ``vocab.json`` + ``merges.txt``).

Both are a :class:`Tokenizer`: ``encode``/``decode``, the vocabulary size, the EOD, eos, bos
and pad ids, the special tokens, ``kind`` and the serialized bytes a model package stores.
A tokenizer's identity is the sha256 of those bytes (the ``.model``, the ``tokenizer.json``);
every manifest and checkpoint records it, so training must be deterministic: the same documents and
config give a byte-identical model. To that end the model is trained in memory
(no temporary paths end up in its trainer spec), on an explicit document sample
(no SentencePiece-side shuffling) with a fixed thread count, and only then written.

Text is kept lossless (identity normalization, spaces preserved, byte fallback), so
``decode(encode(text)) == text``. Newlines are not in the learned vocabulary (training
sees one line at a time) and encode as the byte piece ``<0x0A>`` (as ``<unk>``
without byte fallback).
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import sentencepiece as spm
from google.protobuf.message import DecodeError
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from megalith import safe_read
from megalith.config import TokenizerConfig
from megalith.errors import MegalithError
from megalith.storage import atomic_write_bytes, sha256_of_bytes

EOD_TOKEN = "<|eod|>"
PAD_TOKEN = "<|pad|>"
SENTINEL_FORMAT = "<extra_id_{}>"  # T5's span-corruption sentinels, <extra_id_0> first
# A Hugging Face tokenizer's eos and bos: the first of these among its added tokens (GPT-2
# and Qwen, Llama 2 and Mistral, Llama 3, Gemma). Its EOD is <|eod|> if present, else the eos.
HF_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
HF_BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_SPECIAL = re.compile(r"<\|[^|\s]+\|>")  # <|endoftext|> in a GPT-2 vocab.json
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback pieces

# Unigram training sums EM statistics per thread, so the float results (and the
# model bytes) depend on the thread count. Fixing it keeps the id machine-independent.
TRAIN_THREADS = 4
# A path read from a manifest may name /dev/zero or a huge file: SentencePiece models are
# a few MB even at 256k pieces.
MAX_MODEL_BYTES = 256 << 20
MAX_VOCAB_SIZE = 1 << 22  # the largest open vocabularies have about 256k ids

_TOO_LARGE = re.compile(
    r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)"
)


class TokenizerError(MegalithError):
    """A tokenizer file that cannot be read, or settings that cannot train one."""


@dataclass(frozen=True)
class Tokenizer(ABC):
    """A loaded tokenizer: its identity, special ids and serialized bytes; subclasses encode.

    ``model_bytes`` is what a model package stores (as :attr:`file_name`) and ``id`` is
    their sha256. EOD is what documents end with: ``<|eod|>`` when the tokenizer has it,
    else its eos (``data.eod: eos`` picks the eos even when ``<|eod|>`` exists).
    """

    model_path: str
    id: str
    vocab_size: int
    padded_vocab_size: int
    eod_id: int
    pad_id: int | None
    special_ids: dict[str, int]
    model_bytes: bytes = field(repr=False)
    eos_id: int | None = None
    bos_id: int | None = None
    _backend: Any = field(init=False, repr=False, compare=False)

    kind: ClassVar[str]
    file_name: ClassVar[str]  # its name in a model package and an HF directory

    def __post_init__(self) -> None:
        object.__setattr__(self, "_backend", self._load(self.model_bytes, self.model_path))

    # Pickling (e.g. to worker processes) sends the bytes, not the native object.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_backend"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_backend", self._load(self.model_bytes, self.model_path))

    @staticmethod
    @abstractmethod
    def _load(model_bytes: bytes, name: str) -> Any: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` alone: no bos, eos or EOD is added."""

    @abstractmethod
    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]: ...

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @abstractmethod
    def id_to_piece(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what OpenAI's logprobs show): a byte piece
        ``<0xNN>`` that byte, else the piece with SentencePiece's "▁" as a space."""
        piece = self.id_to_piece(token_id)
        if match := BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True)
class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model``."""

    kind: ClassVar[str] = "sentencepiece"
    file_name: ClassVar[str] = "tokenizer.model"

    @staticmethod
    def _load(model_bytes: bytes, name: str) -> spm.SentencePieceProcessor:
        return _processor_from_bytes(model_bytes, name)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._backend.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._backend.id_to_piece(int(token_id))


@dataclass(frozen=True)
class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``), used as it is:
    ``encode`` adds none of its post-processor's tokens, ``decode`` keeps special tokens."""

    kind: ClassVar[str] = "hf"
    file_name: ClassVar[str] = "tokenizer.json"

    @staticmethod
    def _load(model_bytes: bytes, name: str) -> HFBackend:
        return _hf_backend(model_bytes, name)

    def encode(self, text: str) -> list[int]:
        with _native_errors(f"{self.model_path}: cannot encode"):
            return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        if num_threads == 1:  # tokenizers' own batch call uses every core
            return [self.encode(text) for text in texts]
        with _native_errors(f"{self.model_path}: cannot encode"):
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        with _native_errors(f"{self.model_path}: cannot decode"):
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        return self._backend.id_to_token(int(token_id)) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-level BPE piece (GPT-2's "Ġthe") mapped back to its bytes (b" the")."""
        piece = self.id_to_piece(token_id)
        byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        if byte_level and piece not in self.special_ids and set(piece) <= _BYTE_OF_CHAR.keys():
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return super().token_bytes(token_id)


def with_eod(tokenizer: Tokenizer, eod: str) -> Tokenizer:
    """The tokenizer with EOD = its eos (``</s>``, ``<|endoftext|>``...) when ``eod`` is
    ``"eos"``, else unchanged."""
    if eod == "token":
        return tokenizer
    if tokenizer.eos_id is None:
        raise TokenizerError(f"{tokenizer.model_path}: data.eod is 'eos' but it has no eos id")
    return replace(tokenizer, eod_id=tokenizer.eos_id)


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
    """Build a ``Tokenizer`` from serialized bytes; ``model_path`` is where they live: a
    Hugging Face ``tokenizer.json`` (a ``.json`` name or JSON text) or a SentencePiece model."""
    if model_path.endswith(".json") or model_bytes.lstrip()[:1] == b"{":
        return _hf_tokenizer(model_bytes, model_path, pad_vocab_multiple)
    processor = _processor_from_bytes(model_bytes, model_path)
    special_ids = _special_ids(model_bytes, model_path)
    eos_id = processor.eos_id() if processor.eos_id() >= 0 else None
    eod_id = special_ids.get(EOD_TOKEN, eos_id)
    if eod_id is None:
        raise TokenizerError(f"{model_path}: has neither a {EOD_TOKEN} token nor an eos id")
    vocab_size = processor.get_piece_size()
    return SentencePieceTokenizer(
        model_path=model_path,
        id=sha256_of_bytes(model_bytes),
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, pad_vocab_multiple),
        eod_id=eod_id,
        pad_id=special_ids.get(PAD_TOKEN),
        special_ids=special_ids,
        model_bytes=model_bytes,
        eos_id=eos_id,
        bos_id=processor.bos_id() if processor.bos_id() >= 0 else None,
    )


def _hf_tokenizer(model_bytes: bytes, model_path: str, pad_vocab_multiple: int) -> HFTokenizer:
    data = _json_object(model_bytes, model_path)
    if "model" not in data:
        hint = " (a GPT-2 vocab.json: name the file *vocab.json, with *merges.txt beside it)"
        raise TokenizerError(
            f"{model_path}: not a Hugging Face tokenizer.json (it has no 'model' section)"
            + (hint if _is_vocab(data) else "")
        )
    backend = _hf_backend(model_bytes, model_path)
    ids = backend.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise TokenizerError(f"{model_path}: a tokenizer.json with an empty vocabulary")
    special_ids = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
    eos_id = next((special_ids[t] for t in HF_EOS_TOKENS if t in special_ids), None)
    eod_id = special_ids.get(EOD_TOKEN, eos_id)
    if eod_id is None:
        raise TokenizerError(
            f"{model_path}: has no {EOD_TOKEN} token and none of the eos tokens "
            f"{list(HF_EOS_TOKENS)} among its added tokens, so documents cannot be separated: "
            f"add {EOD_TOKEN} as a special token (tokenizers: add_special_tokens) and save it"
        )
    vocab_size = max(ids) + 1
    if vocab_size > MAX_VOCAB_SIZE:
        raise TokenizerError(
            f"{model_path}: token id {vocab_size - 1} is beyond the {MAX_VOCAB_SIZE} ids "
            "an embedding table may have"
        )
    return HFTokenizer(
        model_path=model_path,
        id=sha256_of_bytes(model_bytes),
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, pad_vocab_multiple),
        eod_id=eod_id,
        pad_id=special_ids.get(PAD_TOKEN, special_ids.get("<pad>")),
        special_ids=special_ids,
        model_bytes=model_bytes,
        eos_id=eos_id,
        bos_id=next((special_ids[t] for t in HF_BOS_TOKENS if t in special_ids), None),
    )


@contextlib.contextmanager
def _native_errors(what: str) -> Iterator[None]:
    """tokenizers' errors as a TokenizerError: its bare ``Exception`` (a WordPiece model
    without its [UNK], a JSON error naming line and column) and the ``PanicException`` a Rust
    panic raises on some malformed files (it derives from BaseException, not Exception)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, TokenizerError):
        raise
    except BaseException as exc:  # noqa: BLE001 - see above: a panic is a BaseException
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise TokenizerError(f"{what} ({safe_read.clip(first, 200)})") from None


def _hf_backend(model_bytes: bytes, name: str) -> HFBackend:
    try:
        text = model_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"{name}: not a Hugging Face tokenizer.json (not UTF-8)") from None
    with _native_errors(f"{name}: not a Hugging Face tokenizer.json"):
        backend = HFBackend.from_str(text)
    # Documents are encoded whole: a truncation setting would cut them silently (and some
    # settings make the library panic), padding would add tokens.
    backend.no_truncation()
    backend.no_padding()
    return backend


def _json_object(data: bytes, name: str) -> dict[str, Any]:
    try:
        value = safe_read.loads_json(data, name)
    except safe_read.UnsafeFileError as exc:
        raise TokenizerError(str(exc)) from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{name}: expected a JSON object at the top")
    return value


def _is_vocab(data: dict[str, Any]) -> bool:
    return bool(data) and all(isinstance(v, int) and not isinstance(v, bool) for v in data.values())


def bpe_tokenizer_json(vocab: bytes, merges: bytes, vocab_path: str, merges_path: str) -> bytes:
    """A GPT-2-style ``vocab.json`` + ``merges.txt`` as a byte-level BPE ``tokenizer.json``
    (GPT-2's pre-tokenizer, decoder and post-processor; ``<|...|>`` entries of the vocabulary
    become special tokens). The same two files always give the same bytes, hence the same id."""
    table = _json_object(vocab, vocab_path)
    if not _is_vocab(table):
        raise TokenizerError(f"{vocab_path}: expected a JSON object of token -> id")
    pairs = []
    try:
        lines = merges.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise TokenizerError(f"{merges_path}: not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{merges_path}: line {number} is not two tokens: {line[:60]!r}")
        pairs.append((parts[0], parts[1]))
    try:
        backend = HFBackend(models.BPE(vocab=table, merges=pairs))
    except Exception as exc:  # a merge whose parts or result are not in the vocabulary
        raise TokenizerError(f"{merges_path} does not fit {vocab_path}: {exc}") from None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(sorted((t for t in table if _SPECIAL.fullmatch(t)), key=table.get))
    return backend.to_str().encode("utf-8")


def load_tokenizer(
    url: str | os.PathLike[str],
    pad_vocab_multiple: int = 128,
    storage_options: dict[str, Any] | None = None,
) -> Tokenizer:
    """Load a tokenizer from a local path or any fsspec URL: a SentencePiece ``.model``, a
    Hugging Face ``tokenizer.json``, or a GPT-2-style ``*vocab.json`` whose ``*merges.txt``
    lies beside it (``gpt2-vocab.json`` and ``gpt2-merges.txt``, as Megatron-LM names them)."""
    url = os.fspath(url)
    model_bytes = _read_tokenizer_file(url, storage_options)
    if url.endswith("vocab.json"):
        merges_url = url.removesuffix("vocab.json") + "merges.txt"
        merges = _read_tokenizer_file(merges_url, storage_options)
        model_bytes = bpe_tokenizer_json(model_bytes, merges, url, merges_url)
    return tokenizer_from_bytes(model_bytes, url, pad_vocab_multiple)


def _read_tokenizer_file(url: str, storage_options: dict[str, Any] | None) -> bytes:
    try:
        return safe_read.read_bytes_bounded(url, MAX_MODEL_BYTES, storage_options)
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer model not found: {url}") from None
    except IsADirectoryError:
        raise TokenizerError(
            f"tokenizer {url} is a directory, expected a .model, tokenizer.json or vocab.json file"
        ) from None


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
    processor = tokenizer._backend
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
    """Train SentencePiece and write ``PREFIX.model`` and ``PREFIX.vocab`` atomically
    (``model_type: byte_bpe``: a byte-level BPE with Hugging Face tokenizers, written as
    ``PREFIX.json``; see :func:`trained_tokenizer_url`).

    At most ``config.max_training_documents`` documents are used (a seeded sample);
    ``output_prefix`` is a local path or any fsspec URL. Same documents and config,
    same model bytes, same tokenizer id.
    """
    _check_config(config)
    sample = sample_documents(documents, config.max_training_documents, config.seed)
    if config.model_type == "byte_bpe":
        model_bytes = _train_byte_bpe(sample, config)
        url = trained_tokenizer_url(output_prefix, config)
        tokenizer = tokenizer_from_bytes(model_bytes, url, config.pad_vocab_multiple)
        atomic_write_bytes(url, model_bytes, storage_options)
        return tokenizer
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


def trained_tokenizer_url(output_prefix: str, config: TokenizerConfig) -> str:
    """Where :func:`train_tokenizer` writes: ``PREFIX.model``, or ``PREFIX.json`` for byte_bpe."""
    return f"{output_prefix}.json" if config.model_type == "byte_bpe" else f"{output_prefix}.model"


def _train_byte_bpe(documents: Sequence[str], config: TokenizerConfig) -> bytes:
    """GPT-2's byte-level BPE: every byte is a token, so any text encodes without unknowns;
    the special tokens (then the sentinels) take the first ids. Whole documents are the
    training texts (newlines are learned like any byte)."""
    specials = list(config.special_tokens) + sentinel_names(config.sentinel_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if config.vocab_size < len(alphabet) + len(specials):
        raise TokenizerError(
            f"tokenizer.vocab_size {config.vocab_size} is too small for a byte-level BPE: it "
            f"needs at least {len(alphabet) + len(specials)} (256 bytes and "
            f"{len(specials)} special tokens)"
        )
    if not any(documents):
        raise TokenizerError("no text to train the tokenizer on (every document was empty)")
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer)
    return backend.to_str().encode("utf-8")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character each byte is written as
    in a byte-level BPE vocabulary (printable Latin-1 as itself, the rest from U+0100 on)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in chars):
        chars[byte] = chr(0x100 + offset)
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = _byte_level_chars()
