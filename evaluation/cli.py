"""``megalith eval``: perplexity, multiple-choice tasks and sample generations of a model package."""

from __future__ import annotations

import argparse
from pathlib import Path

from megalith import safe_read
from megalith.config import MAX_POSITIONS, DataConfig, load_config
from megalith.errors import MegalithError
from training.mlflow_store.runs import existing_store_uri, log_evaluation

DEFAULT_OUTPUT = "eval-report.json"
CONFIG_SUFFIXES = (".yaml", ".yml")
MAX_PROMPT_FILE_BYTES = 64 << 20


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "eval",
        help="evaluate a model package: perplexity, tasks, generations",
        description="Evaluate a model package: perplexity on the valid/test split of a shard "
        "set, zero-shot multiple-choice tasks scored by log-likelihood, and sampled "
        "generations. Prints a table and writes a JSON report.",
    )
    parser.add_argument("--model", required=True, metavar="PACKAGE_DIR", help="model package")
    parser.add_argument(
        "--data",
        metavar="SHARD_DIR_OR_CONFIG",
        help="shard set directory/URL, or a recipe whose data section to use; omit to skip "
        "perplexity",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a data key, e.g. data.seq_length=256; data.split defaults to the "
        "split the model trained with",
    )
    parser.add_argument(
        "--allow-split-mismatch",
        action="store_true",
        help="score a split of the training shard set other than the model's own (its "
        "valid/test documents may then include training documents)",
    )
    parser.add_argument("--split", choices=["valid", "test"], default="valid")
    parser.add_argument(
        "--max-samples", type=int, default=64, metavar="N", help="perplexity samples (64)"
    )
    parser.add_argument("--batch-size", type=int, default=8, metavar="N")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=[],
        metavar="FILE",
        help="task jsonl files or shipped task names (sample_facts)",
    )
    parser.add_argument(
        "--lm-eval-tasks",
        nargs="+",
        default=[],
        metavar="TASK",
        help="lm-evaluation-harness tasks: names lm-eval knows (hub tasks need a network), "
        "shipped ones (sample_facts) or task YAML files; needs the eval extra",
    )
    parser.add_argument(
        "--lm-eval-limit", type=int, metavar="N", help="at most N items of each lm-eval task"
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        metavar="FILE_OR_TEXT",
        help='prompt texts, or files: .jsonl with {"prompt": ...} per line, else one per line',
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="0: none")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 for greedy decoding (default 0.8)"
    )
    parser.add_argument(
        "--top-k", type=int, metavar="K", help="sample from the K most likely (default: off)"
    )
    parser.add_argument(
        "--top-p", type=float, default=0.95, metavar="P", help="nucleus mass (0.95; 1: off)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    parser.add_argument(
        "--output", default=DEFAULT_OUTPUT, metavar="FILE", help=f"JSON report ({DEFAULT_OUTPUT})"
    )
    parser.add_argument(
        "--mlflow-run",
        metavar="RUN_ID",
        help="log the metrics (eval.<name>) and the report to this MLflow run, e.g. the "
        "training run, so that registration and the promotion gate can use them",
    )
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (else MLFLOW_TRACKING_URI)")
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from evaluation.report import evaluate_model, format_table
    from training.inference.decode import SamplingConfig

    try:
        sampling = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    except ValueError as exc:
        raise MegalithError(str(exc)) from None
    store = mlflow_run_store(args.mlflow_run, args.tracking_uri) if args.mlflow_run else None
    data = data_config(args.data, args.set, args.model) if args.data else None
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    report = evaluate_model(
        args.model,
        data,
        args.tasks,
        prompts,
        split=args.split,
        max_samples=args.max_samples,
        batch_size=args.batch_size,
        sampling=sampling,
        device=args.device,
        precision=args.precision,
        output=args.output,
        lm_eval_tasks=args.lm_eval_tasks,
        lm_eval_limit=args.lm_eval_limit,
        allow_split_mismatch=args.allow_split_mismatch,
    )
    print(format_table(report))
    print(f"\nwrote {args.output}")
    if args.mlflow_run:
        log_evaluation(args.mlflow_run, report["metrics"], args.output, store)
        print(f"logged {len(report['metrics'])} metrics to MLflow run {args.mlflow_run}")
    return 0


def mlflow_run_store(run_id: str, tracking_uri: str | None) -> str:
    """The store holding ``run_id`` (``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else
    ./mlflow.db), checked before the evaluation so a wrong id costs no evaluation."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = existing_store_uri(tracking_uri, Path.cwd())
    try:
        MlflowClient(tracking_uri=uri).get_run(run_id)
    except MlflowException as exc:
        raise MegalithError(
            f"--mlflow-run {run_id}: no such run in {uri} ({exc.error_code})"
        ) from None
    return uri


def data_config(source: str, overrides: list[str], package_dir: str) -> DataConfig:
    """A recipe's data section, or a shard set with the model's context length as seq_length."""
    if source.endswith(CONFIG_SUFFIXES):
        return load_config(source, overrides).data
    seq_length = f"data.seq_length={package_max_positions(package_dir)}"
    return load_config(None, [seq_length, *overrides], {"data.output": source}).data


def package_max_positions(package_dir: str) -> int:
    """The model's ``max_position_embeddings`` from the package's config.json (not verified
    here: loading the package does that)."""
    path = Path(package_dir) / "config.json"
    try:
        meta = safe_read.read_json(path, 1 << 20, allow_symlink=False, expect=dict)
    except OSError as exc:
        raise MegalithError(f"{path}: cannot read the model's context length: {exc}") from None
    model = safe_read.field(meta, "model", dict, str(path))
    return safe_read.field(
        model, "max_position_embeddings", int, f"{path}: model", minimum=1, maximum=MAX_POSITIONS
    )


def read_prompts(values: list[str]) -> list[str]:
    """Each value is a prompt file if one exists at that path, else the prompt text itself."""
    prompts: list[str] = []
    for value in values:
        path = Path(value)
        if not path.is_file():
            prompts.append(value)
        elif path.suffix == ".jsonl":
            prompts += _jsonl_prompts(path)
        else:
            prompts += [line for line in _read_text(path).splitlines() if line]
    return prompts


def _read_text(path: Path) -> str:
    data = safe_read.read_bytes_bounded(path, MAX_PROMPT_FILE_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MegalithError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _jsonl_prompts(path: Path) -> list[str]:
    prompts = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        record = safe_read.loads_json(line, f"{path}:{number}")
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str):
            raise MegalithError(f'{path}:{number}: expected {{"prompt": "..."}}')
        prompts.append(prompt)
    return prompts
