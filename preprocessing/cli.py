"""``megalith data ...``: tokenizer training, sharding, inspection and verification."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from megalith.config import MegalithConfig, load_config
from megalith.errors import MegalithError


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    group = subcommands.add_parser(
        "data",
        help="prepare corpora: curate, train a tokenizer, write Megatron shards, inspect, verify",
        description="Turn raw text (jsonl, parquet, txt; local or s3://) into a SentencePiece "
        "tokenizer and Megatron-compatible .bin/.idx shards with a manifest.",
    )
    group.set_defaults(group_parser=group)
    commands = group.add_subparsers(dest="data_command", metavar="COMMAND")

    train = commands.add_parser(
        "train-tokenizer",
        help="train a tokenizer (SentencePiece, or a byte-level BPE) on a corpus",
        description="Train a SentencePiece model (BPE or unigram, byte fallback, special tokens) "
        "on a seeded sample of the input documents. Writes PREFIX.model and PREFIX.vocab; with "
        "--model-type byte_bpe a Hugging Face tokenizers byte-level BPE, PREFIX.json.",
    )
    _add_input_arguments(train)
    train.add_argument(
        "--output",
        required=True,
        metavar="MODEL_PREFIX",
        help="writes MODEL_PREFIX.model (byte_bpe: MODEL_PREFIX.json)",
    )
    train.add_argument("--vocab-size", type=int, help="number of pieces (default 8000)")
    train.add_argument(
        "--model-type",
        choices=["bpe", "unigram", "byte_bpe"],
        help="SentencePiece bpe (default) or unigram; byte_bpe: a GPT-2-style byte-level BPE "
        "trained with Hugging Face tokenizers, written as MODEL_PREFIX.json",
    )
    train.add_argument(
        "--special-tokens", nargs="+", metavar="TOKEN", help="user-defined symbols, e.g. '<|eod|>'"
    )
    train.add_argument(
        "--sentinel-tokens",
        type=int,
        metavar="N",
        help="add T5 sentinels <extra_id_0>..<extra_id_N-1> (span corruption; T5 uses 100)",
    )
    train.add_argument("--max-documents", type=int, help="sampling cap (default 200000)")
    train.set_defaults(handler=_train_tokenizer)

    prepare = commands.add_parser(
        "prepare",
        help="tokenize a corpus into Megatron .bin/.idx shards",
        description="Tokenize documents in parallel into N shards of roughly equal tokens plus "
        "manifest.json. Resumable: a rerun skips shards that are complete and verified. "
        "Without --tokenizer, a tokenizer is trained first into OUTPUT/tokenizer.model. "
        "Megatron-LM users: with --eod eos and --shards 1, OUTPUT/shard-00000.bin/.idx are "
        "byte-identical to tools/preprocess_data.py --append-eod --tokenizer-type "
        "GPTSentencePieceTokenizer with the same model on the same jsonl (documents in input "
        "order; uint16 below 65,500 ids, else int32: Megatron counts the unpadded vocabulary, "
        "Megalith the padded one; the same .idx header, version 1). Shards that tool made "
        "need no preparing: see `megalith data verify --tokenizer`.",
    )
    _add_input_arguments(prepare)
    prepare.add_argument("--output", metavar="DIR_OR_URL", help="shard directory or s3:// prefix")
    prepare.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="SentencePiece .model, Hugging Face tokenizer.json, or GPT-2 *vocab.json "
        "(with *merges.txt beside it)",
    )
    prepare.add_argument("--workers", type=int, help="tokenizer processes (default: all cores)")
    prepare.add_argument("--shards", type=int, help="number of output shards (default 1)")
    prepare.add_argument("--no-eod", action="store_true", help="do not append EOD to documents")
    prepare.add_argument(
        "--eod",
        choices=["token", "eos"],
        help="EOD id: our <|eod|> piece (default) or the tokenizer's </s> "
        "(what Megatron-LM's tools/preprocess_data.py appends)",
    )
    _add_engine_arguments(prepare)
    prepare.set_defaults(handler=_prepare)

    curate = commands.add_parser(
        "curate",
        help="deduplicate, filter, decontaminate and redact a corpus before tokenizing it",
        description="One streaming pass over the corpus, in input order: exact duplicates "
        "(hash of the normalized text), Gopher/C4/FineWeb quality rules (word count, mean "
        "word length, symbol, bullet and ellipsis ratios, words with letters, stop words, "
        "repeated lines and n-grams), decontamination against evaluation task files (word "
        "13-grams), near duplicates (MinHash + LSH, datasketch) and optional PII redaction "
        "(emails, IPv4, phone numbers). Writes the kept documents as OUTPUT/part-XXXXX.jsonl "
        "and, last, OUTPUT/_curation.json with the counts by rule and examples; `megalith "
        "data prepare --input OUTPUT` copies them into the shard manifest. Each rule's "
        "setting is a data.curate key (--set data.curate.quality.min_words=20, "
        "--set data.curate.near_dedup.enabled=false); see docs/data.md. The same inputs, "
        "config and task files give the same documents; a rerun reuses a finished output.",
    )
    _add_input_arguments(curate)
    curate.add_argument(
        "--output",
        metavar="DIR_OR_URL",
        help="where the curated jsonl goes (data.curate.output; default DATA_OUTPUT/curated)",
    )
    curate.add_argument(
        "--decontaminate",
        nargs="+",
        metavar="FILE",
        help="evaluation task files (jsonl or txt) whose items' n-grams remove documents, "
        "e.g. evaluation/tasks/*.jsonl (added to data.curate.decontamination.task_files)",
    )
    curate.add_argument(
        "--report-contamination",
        action="store_true",
        help="keep contaminated documents and only count them (decontamination.action report)",
    )
    curate.add_argument(
        "--redact-pii",
        action="store_true",
        help="replace emails, IPv4 addresses and phone numbers (data.curate.pii.enabled)",
    )
    curate.add_argument(
        "--workers",
        type=int,
        help="processes applying the per-document rules (default: all cores; 1: in this one)",
    )
    _add_engine_arguments(curate)
    curate.set_defaults(handler=_curate)

    inspect = commands.add_parser(
        "inspect",
        help="summarise a shard set and decode sample documents",
        description="Print the manifest of a shard set: tokenizer, sizes, shards, rejected "
        "records. With --decode N, decode the first N documents back to text. A Megatron-LM "
        "PREFIX.bin/.idx (no manifest): name its tokenizer and --eod.",
    )
    inspect.add_argument("path", metavar="PATH", help="shard directory, URL or Megatron PREFIX")
    inspect.add_argument("--decode", type=int, default=0, metavar="N", help="decode N documents")
    inspect.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="override the tokenizer path; with --eod, the tokenizer of a Megatron-LM PREFIX",
    )
    inspect.add_argument(
        "--eod",
        choices=["token", "eos"],
        help="with --tokenizer: the EOD a Megatron-LM PREFIX's tool appended (eos: </s>)",
    )
    inspect.add_argument("--json", action="store_true", help="print the raw manifest as JSON")
    inspect.set_defaults(handler=_inspect)

    verify = commands.add_parser(
        "verify",
        help="re-check every file of a shard set against its manifest",
        description="Re-hash every shard file and check its index; exits 1 on any mismatch.",
    )
    verify.add_argument("path", metavar="PATH", help="shard directory or URL")
    verify.add_argument(
        "--tokenizer",
        metavar="MODEL",
        help="for shards made by Megatron-LM's preprocess_data.py (PATH.bin/.idx, no "
        "manifest): the tokenizer they were made with (.model, tokenizer.json, *vocab.json)",
    )
    verify.add_argument(
        "--eod",
        choices=["token", "eos"],
        help="with --tokenizer: the EOD it appended (eos: </s>, GPTSentencePieceTokenizer)",
    )
    verify.set_defaults(handler=_verify)


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML", help="recipe to start from (configs/*.yaml)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    parser.add_argument(
        "--input", nargs="+", metavar="URL", help="files, globs, dirs or s3:// URLs"
    )
    parser.add_argument("--input-format", choices=["auto", "jsonl", "parquet", "text"])
    parser.add_argument(
        "--format",
        choices=["pretrain", "chat"],
        help="chat: jsonl conversations for supervised fine-tuning, written with a loss mask",
    )
    parser.add_argument("--json-key", metavar="KEY", help="field holding the text (default 'text')")
    parser.add_argument(
        "--text-mode", choices=["paragraph", "line", "file"], help="plain-text documents"
    )
    parser.add_argument("--on-bad-record", choices=["fail", "skip"], help="default fail")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=["local", "ray"],
        help="where the per-document work runs: local processes (default, --workers) or Ray "
        "Data across a Ray cluster's nodes; the output is byte-identical (docs/data.md)",
    )
    parser.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="the Ray cluster for --engine ray (default $RAY_ADDRESS)",
    )


FLAG_KEYS = {
    "input": "data.inputs",
    "input_format": "data.input_format",
    "format": "data.format",
    "json_key": "data.json_key",
    "text_mode": "data.text_mode",
    "on_bad_record": "data.on_bad_record",
    "workers": "data.workers",
    "engine": "data.engine",
    "ray_address": "data.ray_address",
    "shards": "data.shards",
    "vocab_size": "tokenizer.vocab_size",
    "model_type": "tokenizer.model_type",
    "special_tokens": "tokenizer.special_tokens",
    "sentinel_tokens": "tokenizer.sentinel_tokens",
    "max_documents": "tokenizer.max_training_documents",
    "tokenizer": "tokenizer.model",
}


def config_from_args(args: argparse.Namespace) -> MegalithConfig:
    values: dict[str, Any] = {
        key: getattr(args, flag)
        for flag, key in FLAG_KEYS.items()
        if getattr(args, flag, None) is not None
    }
    if args.data_command == "prepare":
        if args.output is not None:
            values["data.output"] = args.output
        if args.no_eod:
            values["data.append_eod"] = False
        if args.eod is not None:
            values["data.eod"] = args.eod
    if args.data_command == "curate":
        if args.output is not None:
            values["data.curate.output"] = args.output
        if args.report_contamination:
            values["data.curate.decontamination.action"] = "report"
        if args.redact_pii:
            values["data.curate.pii.enabled"] = True
    return load_config(args.config, args.set, values)


def _train_tokenizer(args: argparse.Namespace) -> int:
    from preprocessing.corpus import Corpus, train_tokenizer_on_corpus

    config = config_from_args(args)
    corpus = Corpus.open(config.data)
    tokenizer = train_tokenizer_on_corpus(corpus, config.tokenizer, args.output)
    print(f"wrote {tokenizer.model_path}")
    print(f"  id {tokenizer.id}")
    print(
        f"  vocab {tokenizer.vocab_size} (padded {tokenizer.padded_vocab_size}), eod id {tokenizer.eod_id}"
    )
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from preprocessing.engines import where
    from preprocessing.stage import run_tokenize_stage

    config = config_from_args(args)
    report = run_tokenize_stage(config, show_progress=not args.quiet)
    manifest = report.manifest
    rates = report.rates()
    print(f"wrote {len(report.written)} shard(s), skipped {len(report.skipped)} already complete")
    if report.empty:
        print(
            f"  {len(report.empty)} of {config.data.shards} planned shard(s) got no documents "
            f"(fewer documents than shards, or a few very long ones): {', '.join(report.empty)}"
        )
    print(
        f"  {manifest.documents:,} documents, {manifest.tokens:,} tokens ({manifest.dtype}) "
        f"in {report.output}"
    )
    if report.tokenized_documents:
        print(
            f"  {rates['documents_per_s']:,.0f} docs/s, {rates['tokens_per_s']:,.0f} tokens/s, "
            f"{rates['mb_per_s']:.1f} MB/s with {where(config.data, report.nodes)}"
        )
    if manifest.rejected.total:
        print(f"  rejected {manifest.rejected.total} record(s): {dict(manifest.rejected.counts)}")
    return 0


def _curate(args: argparse.Namespace) -> int:
    from preprocessing.curate import curate_corpus, describe

    config = config_from_args(args)
    report = curate_corpus(config.data, args.decontaminate or (), show_progress=not args.quiet)
    print(describe(report))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from preprocessing.megatron_shards import read_shard_set_manifest
    from preprocessing.tokenizer import load_tokenizer
    from preprocessing.verify import decode_samples, describe_shard_set

    named = args.tokenizer if args.eod else None  # else --tokenizer only decodes
    # a ManifestError names the file and key
    root, manifest = read_shard_set_manifest(args.path, None, named, args.eod)
    if args.json:
        print(json.dumps(manifest.model_dump(mode="json"), indent=2))
        return 0
    print(describe_shard_set(manifest, args.path))
    if args.decode:
        tokenizer = load_tokenizer(
            args.tokenizer or _find_tokenizer(manifest, root),
            manifest.tokenizer.padded_vocab_size,
        )
        try:
            samples = decode_samples(manifest, root, tokenizer, args.decode)
        except ValueError as exc:
            raise MegalithError(str(exc)) from None
        for index, text in enumerate(samples):
            print(f"\n--- document {index} ---\n{text}")
    return 0


def _find_tokenizer(manifest, root: str) -> str:
    """The manifest's tokenizer path, or ROOT/tokenizer.model (a Hugging Face tokenizer:
    ROOT/tokenizer.json) when the shard set was moved."""
    from megalith.storage import filesystem, join

    recorded = manifest.tokenizer.path
    beside = join(root, "tokenizer.json" if manifest.tokenizer.kind == "hf" else "tokenizer.model")
    for candidate in (recorded, beside):
        fs, path = filesystem(candidate)
        if fs.exists(path):
            return candidate
    return recorded


def _verify(args: argparse.Namespace) -> int:
    from preprocessing.verify import verify_shard_set

    problems = verify_shard_set(args.path, tokenizer=args.tokenizer, eod=args.eod)
    if problems:
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        print(f"{args.path}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    fits = "its index and every token id fit the tokenizer"
    print(f"{args.path}: {fits if args.tokenizer else 'every file matches its manifest'}")
    return 0
