"""lm-evaluation-harness over Megalith packages: the ``megalith`` model type
(evaluation/lm_eval_adapter.py), ``megalith eval --lm-eval-tasks`` and the shipped
``sample_facts`` task YAML.

The same tiny random GPT is scored four ways, and every item's log-likelihoods must agree
within 1e-4 nats: lm-eval's own command line with ``--model megalith`` (a subprocess:
the name must be registered where a user runs it), lm-eval's ``hf`` model on the
package's Hugging Face export (``export_hf``, what ``megalith export hf`` runs),
``megalith eval --lm-eval-tasks`` (a subprocess too, logging to MLflow) and the scorer
of ``megalith eval --tasks`` (:func:`evaluation.tasks.score_choices`). A document-level
(rolling) task checks ``loglikelihood_rolling`` against the HF export the same way.
Everything runs offline: the tasks' data are local files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lm_eval.api.instance import Instance

from evaluation import EvaluationError
from evaluation import cli as eval_cli
from evaluation.lm_eval_adapter import (
    LM_EVAL_FAMILIES,
    TASKS_DIR,
    MegalithLM,
    check_tasks,
    run_tasks,
    sequence_scores,
)
from evaluation.report import evaluate_model
from evaluation.seq2seq import span_logliks, span_prompt
from evaluation.tasks import SAMPLE_TASK, load_task, score_choices
from megalith.config import DEFAULT_SPECIAL_TOKENS, MetricRule, ModelConfig, TokenizerConfig
from megalith.errors import MegalithError
from preprocessing.tokenizer import load_tokenizer, sentinel_ids, train_tokenizer
from registry.models import register_model
from registry.promotion import gate
from tests.test_registry import store  # noqa: F401  (fixture)
from training.inference.decode import SamplingConfig, generate, generate_ids, prompt_ids
from training.inference.decode_t5 import generate_seq2seq_ids
from training.interop.export import export_hf
from training.mlflow_store.runs import MLflowRunLogger
from training.models import build_model
from training.models.package import load_model_package, save_model_package

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "preprocessing" / "sample_corpus" / "stories.jsonl"
BIN = Path(sys.executable).parent
NATS = 1e-4  # per item, as the issue asks
# A document-level task over local stories, read in memory (no datasets cache is written).
ROLLING_YAML = """task: stories_rolling
custom_dataset: !function stories_docs.load
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
ROLLING_DOCS = """import json
from pathlib import Path

import datasets


def load(**_):
    lines = (Path(__file__).parent / "docs.jsonl").read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines])}
"""


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No hub for the children (lm-eval's command line): offline, caches in a temporary
    folder. The tasks' data are read in memory, so nothing reaches a datasets cache."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-piece tokenizer with sentinels (for T5), a GPT and a T5 package (random
    weights, peaked distributions) and a rolling task over four sample stories."""
    root = tmp_path_factory.mktemp("lm-eval")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line)["text"] for line in lines[:300]]
    specials = [*DEFAULT_SPECIAL_TOKENS, "<extra_id_0>", "<extra_id_1>"]
    config = TokenizerConfig(
        vocab_size=400, pad_vocab_multiple=64, max_training_documents=300, special_tokens=specials
    )
    tokenizer = train_tokenizer(docs, config, str(root / "tok"))
    common = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": tokenizer.padded_vocab_size,
        "max_position_embeddings": 64,
        "init_std": 0.3,
        "backend": "torch",
    }
    models = {
        "gpt": ModelConfig(**common, num_query_groups=2),
        "t5": ModelConfig(
            **common,
            family="t5",
            num_decoder_layers=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        ),
    }
    for name, model_config in models.items():
        torch.manual_seed(0)
        model = build_model(model_config).eval()
        save_model_package(model, model_config, root / "tok.model", root / name)
    stories = root / "stories"
    stories.mkdir()
    with (stories / "docs.jsonl").open("w", encoding="utf-8") as out:
        for line in lines[300:303]:  # each longer than the model's 64 positions
            out.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    (stories / "stories.yaml").write_text(ROLLING_YAML)
    (stories / "stories_docs.py").write_text(ROLLING_DOCS)
    return root


def run(*command: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def megalith_eval(*args: str) -> dict[str, Any]:
    """``megalith eval ARGS`` in this process (its parser and handler); the JSON report."""
    parser = argparse.ArgumentParser(prog="megalith")
    eval_cli.register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["eval", "--device", "cpu", "--max-new-tokens", "0", *args])
    assert parsed.handler(parsed) == 0
    return json.loads(Path(parsed.output).read_text(encoding="utf-8"))


def logliks(samples: list[dict[str, Any]], key: str) -> dict[int, list[float]]:
    """``{doc_id: [log-likelihood of each response]}`` (lm-eval writes numbers as strings)."""
    return {
        s["doc_id"]: [float(r[0] if isinstance(r, list | tuple) else r) for r in s[key]]
        for s in samples
    }


def assert_agree(name: str, got: dict[int, list[float]], want: dict[int, list[float]], tol: float):
    assert got.keys() == want.keys(), name
    worst = max(abs(a - b) for i in want for a, b in zip(got[i], want[i], strict=True))
    assert worst <= tol, f"{name}: largest per-item difference {worst:.3g} > {tol}"


@pytest.fixture(scope="module")
def cli_run(root: Path) -> dict[str, Any]:
    """lm-eval's command line with ``--model megalith``, as a user runs it (the shipped
    task folder is included by ``megalith-lm-eval``)."""
    out = root / "cli-out"
    run(
        str(BIN / "megalith-lm-eval"), "run",
        "--model", "megalith",
        "--model_args", f"package={root / 'gpt'}",
        "--tasks", "sample_facts",
        "--batch_size", "16", "--device", "cpu",
        "--log_samples", "--output_path", str(out),
    )  # fmt: skip
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob("samples_sample_facts_*.jsonl")
    lines = samples.read_text(encoding="utf-8").splitlines()
    return {"results": json.loads(results.read_text()), "samples": [json.loads(x) for x in lines]}


@pytest.fixture(scope="module")
def hf_export(root: Path) -> Path:
    return export_hf(root / "gpt", root / "gpt-hf")  # what `megalith export hf` runs


def hf_samples(hf_dir: Path, task: str, task_source: str, **model_args: Any) -> list[dict]:
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu", **model_args},
        tasks=[task],
        task_manager=check_tasks([task_source]).manager,
        batch_size=16,
        log_samples=True,
        bootstrap_iters=0,
    )
    return results["samples"][task]


@pytest.fixture(scope="module")
def tracked_report(root: Path, store: str) -> tuple[dict[str, Any], str]:  # noqa: F811
    """``megalith eval --tasks sample_facts --lm-eval-tasks sample_facts STORIES.yaml
    --mlflow-run RUN`` on the GPT package, as a user runs it; the report and the run id."""
    logger = MLflowRunLogger.start(store, experiment="lm-eval", tags={})
    logger.close()
    output = root / "report.json"
    done = run(
        str(BIN / "megalith"), "eval", "--model", str(root / "gpt"), "--device", "cpu",
        "--max-new-tokens", "0",
        "--tasks", "sample_facts",
        "--lm-eval-tasks", "sample_facts", str(root / "stories" / "stories.yaml"),
        "--output", str(output),
        "--mlflow-run", logger.run_id, "--tracking-uri", store,
    )  # fmt: skip
    assert "lm_eval.sample_facts.acc_norm" in done.stdout
    assert f"to MLflow run {logger.run_id}" in done.stdout
    return json.loads(output.read_text(encoding="utf-8")), logger.run_id


@pytest.mark.slow
def test_adapter_hf_export_and_megalith_eval_agree_per_item(
    root: Path, cli_run: dict[str, Any], hf_export: Path, tracked_report: tuple[dict, str]
) -> None:
    report = tracked_report[0]
    adapter_cli = logliks(cli_run["samples"], "filtered_resps")
    hf = logliks(hf_samples(hf_export, "sample_facts", "sample_facts"), "filtered_resps")
    in_report = logliks(report["lm_eval"]["samples"]["sample_facts"], "responses")
    model, _, tokenizer_path = load_model_package(root / "gpt")
    items = load_task(SAMPLE_TASK)
    ours = score_choices(model, load_tokenizer(str(tokenizer_path)), items)
    native = {i: [choice.loglik for choice in scores] for i, scores in enumerate(ours)}

    assert len(native) == 96 and len({round(v, 3) for s in native.values() for v in s}) > 300
    assert_agree("lm_eval --model megalith", adapter_cli, native, NATS)
    assert_agree("lm_eval --model hf (export)", hf, native, NATS)
    assert_agree("megalith eval --lm-eval-tasks", in_report, native, NATS)
    # The same picks: lm-eval's acc and acc_norm (per character) are megalith eval's.
    lm_results = cli_run["results"]["results"]["sample_facts"]
    for metric in ("acc", "acc_norm"):
        assert report["tasks"]["sample_facts"][metric] == pytest.approx(
            lm_results[f"{metric},none"]
        )
        assert report["metrics"][f"lm_eval.sample_facts.{metric}"] == pytest.approx(
            lm_results[f"{metric},none"]
        )


def test_rolling_loglikelihood_matches_the_hf_export(
    root: Path, hf_export: Path, tracked_report: tuple[dict, str]
) -> None:
    """Documents longer than the model's 64 positions, in lm-eval's disjoint windows, each
    document after one <|eod|>. lm-eval's ``hf`` model prefixes a BOS to a text its
    tokenizer already gave one (upstream issue 3333): ``add_bos_token=False`` avoids it."""
    in_report = logliks(tracked_report[0]["lm_eval"]["samples"]["stories_rolling"], "responses")
    hf = logliks(
        hf_samples(
            hf_export,
            "stories_rolling",
            str(root / "stories" / "stories.yaml"),
            add_bos_token=False,
        ),
        "filtered_resps",
    )
    tokens = [len(load_tokenizer(str(root / "tok.model")).encode(t)) for t in stories(root)]
    assert min(tokens) > 2 * 64  # three windows or more each
    # fp32 logits summed over hundreds of tokens: 1e-4 nats per 10 tokens
    assert_agree("rolling: megalith eval vs hf", in_report, hf, NATS * max(tokens) / 10)


def stories(root: Path) -> list[str]:
    lines = (root / "stories" / "docs.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines]


def test_lm_eval_metrics_reach_mlflow_and_the_promotion_gate(
    root: Path,
    store: str,  # noqa: F811
    tracked_report: tuple[dict, str],
) -> None:
    from mlflow import MlflowClient

    report, run_id = tracked_report
    logged = MlflowClient(tracking_uri=store).get_run(run_id).data.metrics
    for name in ("lm_eval.sample_facts.acc_norm", "lm_eval.stories_rolling.bits_per_byte"):
        assert logged[f"eval.{name}"] == pytest.approx(report["metrics"][name])

    # A second model's lm-eval numbers against the first's, through the real gate.
    other = root / "gpt-other"
    torch.manual_seed(1)
    config = load_model_package(root / "gpt")[1]
    save_model_package(build_model(config).eval(), config, root / "tok.model", other)
    candidate = megalith_eval(
        "--model", str(other), "--lm-eval-tasks", "sample_facts",
        "--output", str(root / "report-other.json"),
    )["metrics"]  # fmt: skip
    champion = report["metrics"]
    other_run = MLflowRunLogger.start(store, experiment="lm-eval", tags={})
    other_run.close()
    versions = (
        (root / "gpt", run_id, champion, "champion"),
        (other, other_run.run_id, candidate, None),
    )
    for package, run, metrics, alias in versions:
        register_model(package, "lm-eval-gate", run, metrics, alias, tracking_uri=store)
    rule = MetricRule(metric="lm_eval.sample_facts.acc_norm", goal="max", margin=0.0)
    decision = gate("lm-eval-gate", [rule], version=2, tracking_uri=store, apply=False)
    [result] = decision.rules
    assert result.candidate == pytest.approx(candidate["lm_eval.sample_facts.acc_norm"])
    assert result.champion == pytest.approx(champion["lm_eval.sample_facts.acc_norm"])
    assert decision.promoted == (result.candidate >= result.champion)


def requests(kind: str, *args: tuple) -> list[Instance]:
    return [Instance(kind, {}, a, idx=0) for a in args]


def test_generate_until_is_megalith_greedy_generation_cut_at_until(root: Path) -> None:
    model, _, tokenizer_path = load_model_package(root / "gpt")
    tokenizer = load_tokenizer(str(tokenizer_path))
    lm = MegalithLM.from_model(model, tokenizer, batch_size=2)
    prompts = ["Once upon a time,", "The capital of Vantia is", "Max"]
    greedy = SamplingConfig(max_new_tokens=12, temperature=0, top_p=None)
    expected = [g.text for g in generate(model, tokenizer, prompts, greedy).generations]
    assert all(len(text) >= 6 for text in expected), expected
    free = lm.generate_until(
        requests("generate_until", *[(p, {"max_gen_toks": 12}) for p in prompts])
    )
    assert free == expected  # batched (2 a batch, lengths differ) like one at a time
    stops = [text[3:5] for text in expected]
    cut = lm.generate_until(
        requests(
            "generate_until",
            *[(p, {"max_gen_toks": 12, "until": [s]}) for p, s in zip(prompts, stops, strict=True)],
        )
    )
    assert cut == [text[: text.index(s)] for text, s in zip(expected, stops, strict=True)]
    # lm-eval's is_greedy: true for greedy generation's own tokens, false once one differs.
    context = prompt_ids(tokenizer, prompts[0])
    [(ids, _, _)] = generate_ids(
        model, [context], greedy, eod_id=tokenizer.eod_id, vocab_size=tokenizer.vocab_size
    )
    changed = [*ids[:-1], (ids[-1] + 1) % tokenizer.vocab_size]
    flags = sequence_scores(
        model,
        [(context + ids, len(ids)), (context + changed, len(ids))],
        vocab_size=tokenizer.vocab_size,
    )
    assert [greedy_flag for _, greedy_flag in flags] == [True, False]
    # A stop string the continuation starts with leaves nothing (and ends the row at once).
    first = requests(
        "generate_until", (prompts[0], {"max_gen_toks": 12, "until": [expected[0][:2]]})
    )
    assert lm.generate_until(first) == [""]


def test_t5_package_scores_and_generates_as_megalith_eval_does(root: Path) -> None:
    lm = MegalithLM(package=str(root / "t5"), device="cpu", batch_size="8")
    assert lm.family is LM_EVAL_FAMILIES["t5"]
    result = run_tasks(lm, ["sample_facts"], limit=24)
    items = load_task(SAMPLE_TASK)[:24]
    ours = score_choices(lm.model, lm.tokenizer, items)
    native = {i: [choice.loglik for choice in scores] for i, scores in enumerate(ours)}
    assert_agree(
        "T5 through lm-eval", logliks(result["samples"]["sample_facts"], "responses"), native, NATS
    )
    assert result["metrics"]["lm_eval.sample_facts.acc"] == pytest.approx(
        sum(s.index(max(s)) == item.answer for s, item in zip(native.values(), items, strict=True))
        / 24
    )
    # Generation: the span after the context, sentinels left out of the text.
    context = "Once upon a time,"
    [text] = lm.generate_until(requests("generate_until", (context, {"max_gen_toks": 8})))
    encoder, _ = span_prompt(lm.tokenizer, lm.tokenizer.encode(context))
    greedy = SamplingConfig(max_new_tokens=8, temperature=0, top_p=None)
    [(ids, _)] = generate_seq2seq_ids(
        lm.model, [encoder], greedy, pad_id=lm.tokenizer.pad_id, eod_id=lm.tokenizer.eod_id,
        vocab_size=lm.tokenizer.vocab_size,
    )  # fmt: skip
    sentinels = set(sentinel_ids(lm.tokenizer))
    assert text == lm.tokenizer.decode([t for t in ids if t not in sentinels])
    # A text within one window: the span after <|eod|>, as megalith eval scores spans.
    text = "The capital of Vantia is Rellis."
    [rolling] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))
    tokens = lm.tokenizer.encode(text)
    [expected] = span_logliks(
        lm.model, lm.tokenizer, [([lm.tokenizer.eod_id, *tokens], len(tokens))]
    )
    assert rolling == pytest.approx(expected, abs=NATS)


def test_an_unknown_task_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    missing = tmp_path / "no-package"
    with pytest.raises(EvaluationError, match="no task no_such_task.*shipped: sample_facts"):
        evaluate_model(missing, lm_eval_tasks=["no_such_task"], prompts=[])
    assert not missing.exists()


def test_broken_task_yaml_files_are_one_line_errors(tmp_path: Path) -> None:
    """lm-eval skips a task file it cannot parse and raises whatever its loader meets in
    one it can: both become one error naming the task, before any model work."""
    not_yaml = tmp_path / "not_yaml.yaml"
    not_yaml.write_text("task: broken\n  - [\n")
    no_data = tmp_path / "no_data.yaml"
    no_data.write_text("task: no_data\noutput_type: multiple_choice\n")
    no_name = tmp_path / "no_name.yaml"
    no_name.write_bytes(b"\xff\xfe output_type: loglikelihood\n")
    cases = {
        not_yaml: r"could not index .*not_yaml.yaml \(task broken\): is it valid YAML",
        no_data: "could not load task no_data: TypeError",
        no_name: "no_name.yaml: an lm-eval task YAML needs a 'task: NAME' line",
    }
    for path, message in cases.items():
        with pytest.raises(EvaluationError, match=message):
            evaluate_model(tmp_path / "no-package", lm_eval_tasks=[str(path)], prompts=[])


# Named apart from the shipped task, which would be loaded instead of the fuzzed file.
FUZZ_YAML = (
    (TASKS_DIR / "sample_facts.yaml").read_bytes().replace(b"task: sample_", b"task: fuzzed_")
)
NAME_END = FUZZ_YAML.index(b"fuzzed_facts") + len(b"fuzzed_facts\n")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cut=st.integers(NAME_END, len(FUZZ_YAML)),
    flips=st.lists(
        st.tuples(st.integers(NAME_END, len(FUZZ_YAML) - 1), st.integers(0, 255)), max_size=4
    ),
)
def test_fuzz_task_yaml_only_megalith_errors_escape(tmp_path: Path, cut: int, flips: list) -> None:
    """The task YAML cut short and with bytes changed after its name: lm-eval's loading
    of it ends in a usable task or an EvaluationError, never another exception."""
    data = bytearray(FUZZ_YAML[:cut])
    for where, value in flips:
        data[min(where, len(data) - 1)] = value
    folder = tmp_path / "fuzz"
    folder.mkdir(exist_ok=True)
    shutil.copy(TASKS_DIR / "sample_facts_docs.py", folder)
    task = folder / "task.yaml"
    task.write_bytes(bytes(data))
    with contextlib.suppress(MegalithError):
        assert check_tasks([str(task)]).names == ["fuzzed_facts"]


def test_a_wrong_mlflow_run_is_refused_before_evaluating(
    store: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The run is looked up first: a typo costs no evaluation (the package here does not
    even exist, and is never reached)."""
    with pytest.raises(MegalithError, match=f"--mlflow-run {'0' * 32}: no such run in {store}"):
        megalith_eval(
            "--model", str(tmp_path / "no-package"), "--lm-eval-tasks", "sample_facts",
            "--mlflow-run", "0" * 32, "--tracking-uri", store,
        )  # fmt: skip
    with pytest.raises(MegalithError, match="no MLflow store at"):
        megalith_eval(
            "--model", str(tmp_path / "no-package"),
            "--mlflow-run", "0" * 32, "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}",
        )  # fmt: skip
    assert not (tmp_path / "none.db").exists()
