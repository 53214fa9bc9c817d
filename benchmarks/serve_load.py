"""Load test of ``megalith serve`` on 127.0.0.1: N concurrent streaming clients for T seconds.

For each ``--batch-sizes`` value the script starts ``megalith serve`` as its own process
(``--engine static --max-batch-size B``) on a free 127.0.0.1 port, warms it up, then runs ``--clients``
asyncio clients that each send one streaming request after another for ``--seconds``.
Every request asks for ``--max-tokens`` tokens (sampled, temperature 0.8; a request may
stop earlier at the end-of-document token) after a prompt cut from the sample corpus.
It reports requests/s, generated tokens/s, and the p50/p90/p99 of the time to the first
token and of the whole request, plus the engine's mean batch size (from /v1/model).

Without ``--model`` it builds a package of the demo recipe's shape (configs/tiny-cpu.yaml:
4 layers, hidden 128, 2048-piece BPE tokenizer trained on the sample corpus, 256
positions) with random weights: speed does not depend on the weights.

    python benchmarks/serve_load.py --clients 8 --seconds 20 --batch-sizes 1 8
    python benchmarks/serve_load.py --model models:/megalith-demo@candidate --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "configs" / "tiny-cpu.yaml"
CORPUS = ROOT / "preprocessing" / "sample_corpus" / "stories.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="models:/NAME@ALIAS or a package dir (default: demo shape)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (1)")
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="megalith-serve-load-") as tmp:
        model = args.model or str(demo_shaped_package(Path(tmp)))
        prompts = corpus_prompts(64)
        rows = [run_one(model, batch, prompts, args) for batch in args.batch_sizes]
    print(format_table(rows, args))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


def demo_shaped_package(workdir: Path) -> Path:
    """The demo recipe's model with random weights and a tokenizer trained on the corpus."""
    import torch

    from megalith.config import load_config
    from preprocessing.tokenizer import train_tokenizer
    from training.models.gpt import GPTModel
    from training.models.package import save_model_package

    config = load_config(RECIPE)
    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    tokenizer = train_tokenizer(texts, config.tokenizer, str(workdir / "tokenizer"))
    torch.manual_seed(0)
    model = GPTModel(config.model.model_copy(update={"vocab_size": tokenizer.padded_vocab_size}))
    return save_model_package(model, model.config, tokenizer.model_path, workdir / "package")


def corpus_prompts(count: int) -> list[str]:
    """Openings of corpus documents, 3 to 40 words long."""
    rng = random.Random(0)
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"].split() for line in rng.sample(lines, count)]
    return [" ".join(words[: rng.randint(3, 40)]) for words in texts]


def run_one(model: str, batch: int, prompts: list[str], args: argparse.Namespace) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "pipelines.cli", "serve", "--model", model,
        "--port", str(port), "--engine", "static", "--max-batch-size", str(batch),
        "--batch-window-ms", str(args.batch_window_ms), "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url)
        asyncio.run(load(url, prompts[:4], 1, 2.0, args.max_tokens))  # warm-up
        before = httpx.get(f"{url}/v1/model").json()["stats"]
        samples, wall = asyncio.run(load(url, prompts, args.clients, args.seconds, args.max_tokens))
        after = httpx.get(f"{url}/v1/model").json()["stats"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    return summarize(batch, samples, wall, before, after)


def wait_healthy(server: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"megalith serve exited:\n{server.stderr.read().decode()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"megalith serve did not answer on {url} within {timeout_s} s")


async def load(
    url: str, prompts: list[str], clients: int, seconds: float, max_tokens: int
) -> tuple[list[dict[str, float]], float]:
    """Each client sends requests until ``seconds`` have passed; returns samples and wall time."""
    samples: list[dict[str, float]] = []
    start = time.perf_counter()
    end = start + seconds
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def client(index: int) -> None:
            rng = random.Random(index)
            while time.perf_counter() < end:
                body = {
                    "prompt": rng.choice(prompts),
                    "max_tokens": max_tokens,
                    "temperature": 0.8,
                    "seed": rng.randrange(2**31),
                    "stream": True,
                }
                samples.append(await one_request(http, body))

        await asyncio.gather(*(client(i) for i in range(clients)))
    return samples, time.perf_counter() - start


async def one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, float]:
    sent = time.perf_counter()
    first = None
    final: dict[str, Any] = {}
    async with http.stream("POST", "/v1/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if first is None:
                first = time.perf_counter()
            if event.get("done"):
                final = event
    done = time.perf_counter()
    return {
        "ttft": (first or done) - sent,
        "total": done - sent,
        "tokens": float(final.get("completion_tokens", 0)),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summarize(
    batch: int, samples: list[dict[str, float]], wall: float, before: dict, after: dict
) -> dict:
    batches = after["batches"] - before["batches"]
    row: dict[str, Any] = {
        "max_batch_size": batch,
        "requests": len(samples),
        "seconds": round(wall, 2),
        "requests_per_s": len(samples) / wall,
        "tokens_per_s": sum(s["tokens"] for s in samples) / wall,
        "mean_batch": (after["requests"] - before["requests"]) / batches if batches else 0.0,
    }
    for key in ("ttft", "total"):
        values = [s[key] for s in samples]
        for q in (50, 90, 99):
            row[f"{key}_p{q}_ms"] = 1000 * percentile(values, q)
    row["mean_tokens"] = statistics.fmean(s["tokens"] for s in samples)
    return row


def format_table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (
        f"{date.today()} {platform.machine()} {os.cpu_count()} CPUs, {args.clients} clients, "
        f"{args.seconds:g} s, max_tokens {args.max_tokens}, server threads {args.threads}\n"
        "| max batch | requests | req/s | tokens/s | mean batch | TTFT p50/p90/p99 ms "
        "| total p50/p90/p99 ms |\n|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['max_batch_size']} | {r['requests']} | {r['requests_per_s']:.2f} "
        f"| {r['tokens_per_s']:.0f} | {r['mean_batch']:.1f} "
        f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
        f"| {r['total_p50_ms']:.0f} / {r['total_p90_ms']:.0f} / {r['total_p99_ms']:.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


if __name__ == "__main__":
    sys.exit(main())
