"""The serving engines in process, no HTTP: continuous batching over the paged KV cache
(``deploy.continuous``) against static batches (``deploy.engine``) on one device.

A model of the 1B recipe's shape (configs/llama-1b.yaml; random weights: speed does not
depend on them; ``--layers`` to shrink it) decodes ``--requests`` greedy requests of
prompt lengths drawn from 32..1024 and ``--max-tokens`` new tokens each (no EOD stop),
``C`` at a time for each ``--concurrency`` value: every request ended submits the next
(closed loop). Reported per engine and concurrency: output tokens/s, time to first token
and inter-token latency p50/p99, and for the continuous engine the most KV blocks in
use. First it checks on a few prompts that the continuous engine's greedy tokens equal
each prompt decoded alone (``generate_ids``).

    python benchmarks/engine_load.py --device cuda --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.continuous import ContinuousEngine  # noqa: E402
from deploy.engine import BatchingEngine, Finished, PendingRequest  # noqa: E402
from megalith.config import ModelConfig  # noqa: E402
from preprocessing.tokenizer import load_tokenizer  # noqa: E402
from training.inference.decode import SampledToken, SamplingConfig, generate_ids  # noqa: E402
from training.inference.loading import ModelInfo, ServedModel  # noqa: E402
from training.models.gpt import GPTModel  # noqa: E402

RECIPE = ROOT / "configs" / "llama-1b.yaml"
TOKENIZER = ROOT / "tests" / "data" / "megatron_preprocess" / "tokenizer.model"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--layers", type=int, help="fewer layers than the recipe's 16")
    parser.add_argument(
        "--init-std",
        type=float,
        help="weights' std (the recipe's 0.02 gives near-flat next-token distributions, "
        "whose near ties rounding may flip; 0.3 gives peaked ones)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=0, help="per run (default: 2 x C, >= 8)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=["continuous", "continuous-eager", "static"],
        default=["continuous", "static"],
        help="continuous-eager: the continuous engine without CUDA graphs for decode steps",
    )
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args()

    served = random_model(args)
    print(f"model: {describe(served.model)}, {args.dtype} on {args.device}", flush=True)
    print(f"greedy equal to alone: {check_equal(served, args)}", flush=True)
    print("| engine | clients | requests | output tok/s | req/s | TTFT p50 / p99 ms "
          "| ITL p50 / p99 ms | KV blocks used (max) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for concurrency in args.concurrency:
        for name in args.engines:
            result = run(served, name, concurrency, args)
            results.append(result)
            print(row(result), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def random_model(args: argparse.Namespace) -> ServedModel:
    values = yaml.safe_load(RECIPE.read_text())["model"]
    if args.layers:
        values["num_layers"] = args.layers
    if args.init_std:
        values["init_std"] = args.init_std
    torch.manual_seed(0)
    with torch.device(args.device):
        model = GPTModel(ModelConfig(**values, backend="torch"))
    model = model.to(DTYPES[args.dtype]).eval()
    tokenizer = load_tokenizer(str(TOKENIZER))
    info = ModelInfo("random", "random", None, None, "0" * 64, values["max_position_embeddings"], 0)
    return ServedModel(model, tokenizer, info)


def describe(model: GPTModel) -> str:
    params = sum(p.numel() for p in model.parameters())
    config = model.config
    return (
        f"{params / 1e9:.2f}B parameters, {config.num_layers} layers, hidden {config.hidden_size}"
    )


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(32, 1024))] for _ in range(count)]


def check_equal(served: ServedModel, args: argparse.Namespace) -> str:
    """How many of 8 prompts' greedy tokens equal those of the prompt decoded alone."""
    tokenizer = served.tokenizer
    sampling = SamplingConfig(32, temperature=0.0, stop_at_eod=False)
    texts = prompts(8, tokenizer.vocab_size, seed=1)
    engine = ContinuousEngine(served, max_running=8, prefill_chunk=args.prefill_chunk).start()
    done: list[Finished] = []
    finished = threading.Semaphore(0)
    for prompt in texts:
        engine.submit(
            PendingRequest(
                prompt, sampling, time.monotonic() + 600, lambda token: None,
                lambda result: (done.append(result), finished.release()),
            )
        )  # fmt: skip
    for _ in texts:
        finished.acquire()
    engine.retire()
    engine.join()
    batched = {tuple(r.token_ids) for r in done}
    model: Any = served.model
    same = 0
    for prompt in texts:
        new, _, _ = generate_ids(model, [prompt], sampling, eod_id=tokenizer.eod_id,
                                 vocab_size=tokenizer.vocab_size)[0]  # fmt: skip
        same += tuple(new) in batched
    return f"{same} of {len(texts)} prompts"


class Load:
    """A closed loop of ``concurrency`` clients over ``total`` requests, timing each token."""

    def __init__(self, engine: Any, texts: list[list[int]], concurrency: int, max_tokens: int):
        self.engine = engine
        self.texts = texts
        self.sampling = SamplingConfig(max_tokens, temperature=0.0, stop_at_eod=False)
        self.next = 0
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.ended = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.concurrency = concurrency
        self.blocks_in_use: list[int] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        for _ in range(self.concurrency):
            self.submit()

    def submit(self) -> None:
        with self.lock:
            if self.next >= len(self.texts):
                return
            prompt = self.texts[self.next]
            self.next += 1
        times = [time.perf_counter()]

        def on_token(token: SampledToken) -> None:
            now = time.perf_counter()
            (self.ttft if len(times) == 1 else self.itl).append(now - times[-1])
            times.append(now)
            self.tokens += 1
            if isinstance(self.engine, ContinuousEngine):
                self.blocks_in_use.append(self.engine.kv_stats()["blocks_used"])

        def on_done(result: Finished | BaseException) -> None:
            if isinstance(result, BaseException):
                self.error = result
                self.all_done.set()
                return
            with self.lock:
                self.ended += 1
                if self.ended == len(self.texts):
                    self.all_done.set()
            self.submit()

        deadline = time.monotonic() + 3600
        self.engine.submit(PendingRequest(prompt, self.sampling, deadline, on_token, on_done))


def run(served: ServedModel, name: str, concurrency: int, args: argparse.Namespace) -> dict:
    total = args.requests or max(8, 2 * concurrency)
    texts = prompts(total, served.tokenizer.vocab_size, seed=concurrency)
    if name.startswith("continuous"):
        engine: Any = ContinuousEngine(
            served,
            max_running=concurrency,
            prefill_chunk=args.prefill_chunk,
            cuda_graphs=name == "continuous",
        )
    else:
        engine = BatchingEngine(served, max_batch_size=concurrency)
    engine.start()
    engine.ready.wait()  # CUDA graphs captured
    load = Load(engine, texts, concurrency, args.max_tokens)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    load.start()
    load.all_done.wait()
    seconds = time.perf_counter() - start
    if load.error is not None:
        raise load.error
    engine.retire()
    engine.join()
    return {
        "engine": name,
        "concurrency": concurrency,
        "requests": total,
        "seconds": seconds,
        "output_tokens_per_s": load.tokens / seconds,
        "requests_per_s": total / seconds,
        "ttft_p50_ms": 1000 * percentile(load.ttft, 50),
        "ttft_p99_ms": 1000 * percentile(load.ttft, 99),
        "itl_p50_ms": 1000 * percentile(load.itl, 50),
        "itl_p99_ms": 1000 * percentile(load.itl, 99),
        "kv_blocks_used_max": max(load.blocks_in_use, default=0),
    }


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def row(r: dict) -> str:
    return (
        f"| {r['engine']} | {r['concurrency']} | {r['requests']} | "
        f"{r['output_tokens_per_s']:.0f} | {r['requests_per_s']:.2f} | "
        f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
        f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['kv_blocks_used_max']} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
