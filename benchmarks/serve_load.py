"""Load test of ``megalith serve`` over HTTP: C concurrent streaming clients for T seconds,
optionally side by side with Hugging Face transformers' ``generate`` on the same weights.

The script starts ``megalith serve`` as its own process on a free 127.0.0.1 port
(``--engine continuous``, the default: one server with ``--max-running`` the most clients;
``--engine static``: one server per ``--batch-sizes`` value), warms it up, then for each
``--clients`` value runs that many streaming clients of ``POST /v1/completions`` (httpx,
asyncio, spread over ``--client-procs`` processes so that the clients are not the
bottleneck: their CPU use is reported) that send one request after another for
``--seconds``. Every request asks for ``--max-tokens`` tokens (temperature 0.8;
``--ignore-eos``: past the end-of-document token, so each gets all of them).
Reported: requests/s and output tokens/s inside the window, time to first token and
between streamed chunks (one per token) p50/p99, the most and the mean KV blocks in use
(``/metrics``, scraped every 0.5 s), the engine's mean batch (static), and the server's
CPU time over the window, its engine process included (100% is one core, what one
process's Python threads can use together under the GIL: a server of one process near it
is paced by its own CPU work; ``--engine-process`` runs the engine in a second one).

``--hf`` then runs transformers' ``generate`` on the model exported to Hugging Face
(``training.interop.export``): for each ``--clients`` value C, static batches of C of the
same prompts, left-padded, ``max_new_tokens = min_new_tokens = --max-tokens``, greedy,
sdpa attention; reported: output tokens/s, time to the first token and the batch's latency.

Models: ``--shape demo`` (default) is configs/tiny-cpu.yaml (4 layers, hidden 128, a
2048-piece BPE tokenizer trained on the sample corpus); ``--shape 1b`` is
configs/llama-1b.yaml (1.1B parameters) with the test SentencePiece tokenizer; random
weights: speed does not depend on them. Prompts: corpus text cut to ``--prompt-tokens``
LO HI tokens (uniform).

    python benchmarks/serve_load.py --engine static --clients 8 --seconds 20 --batch-sizes 1 8
    python benchmarks/serve_load.py --shape 1b --device cuda --precision bf16 --ignore-eos \\
        --clients 1 16 64 256 --prompt-tokens 32 1024 --max-tokens 128 --hf --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from preprocessing.tokenizer import load_tokenizer  # noqa: E402
from training.models.package import package_tokenizer_path  # noqa: E402

RECIPES = {"demo": ROOT / "configs" / "tiny-cpu.yaml", "1b": ROOT / "configs" / "llama-1b.yaml"}
CORPUS = ROOT / "preprocessing" / "sample_corpus" / "stories.jsonl"
SP_TOKENIZER = ROOT / "tests" / "data" / "megatron_preprocess" / "tokenizer.model"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="models:/NAME@ALIAS or a package dir (default: --shape)")
    parser.add_argument("--shape", choices=list(RECIPES), default="demo")
    parser.add_argument("--layers", type=int, help="fewer layers than the recipe's")
    parser.add_argument("--engine", choices=["continuous", "static"], default="continuous")
    parser.add_argument("--clients", type=int, nargs="+", default=[8])
    parser.add_argument("--client-procs", type=int, default=1, help="client processes (1)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="static")
    parser.add_argument("--max-running", type=int, help="continuous (default: most clients)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ignore-eos", action="store_true", help="every request gets them all")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, metavar=("LO", "HI"))
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (1)")
    parser.add_argument(
        "--engine-process", action="store_true", help="megalith serve --engine-process"
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="megalith serve --no-cuda-graphs",
    )
    parser.add_argument("--hf", action="store_true", help="also transformers' generate")
    parser.add_argument("--hf-batches", type=int, default=64, help="HF: prompts per C (/C, >=1)")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--plot", help="write tokens/s and TTFT p99 against clients here (PNG)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="megalith-serve-load-") as tmp:
        model = args.model or str(random_package(Path(tmp), args))
        prompts = corpus_prompts(model, 256, args.prompt_tokens)
        if args.engine == "static":
            rows = [row for b in args.batch_sizes for row in run_server(model, prompts, args, b)]
        else:
            rows = run_server(model, prompts, args, args.max_running or max(args.clients))
        hf_rows = run_hf(model, Path(tmp), prompts, args) if args.hf else []
    print(header(args))
    print(format_table(rows))
    if hf_rows:
        print(format_hf_table(hf_rows))
    if args.output:
        results = {"args": vars(args), "header": header(args), "rows": rows, "hf": hf_rows}
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(rows, hf_rows, header(args), Path(args.plot))
    return 0


def random_package(workdir: Path, args: argparse.Namespace) -> Path:
    """The recipe's model with random weights, saved as a model package with a tokenizer."""
    import torch

    from megalith.config import load_config
    from preprocessing.tokenizer import train_tokenizer
    from training.models.gpt import GPTModel
    from training.models.package import save_model_package

    config = load_config(RECIPES[args.shape])
    if args.shape == "demo":
        texts = [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines()]
        tokenizer = train_tokenizer(texts, config.tokenizer, str(workdir / "tok"))
        tokenizer_path = tokenizer.model_path
        model_config = config.model.model_copy(update={"vocab_size": tokenizer.padded_vocab_size})
    else:
        tokenizer_path, model_config = str(SP_TOKENIZER), config.model
    if args.layers:
        model_config = model_config.model_copy(update={"num_layers": args.layers})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = GPTModel(model_config)
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    path = save_model_package(model, model.config, tokenizer_path, workdir / "package")
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def corpus_prompts(model: str, count: int, lengths: list[int] | None) -> list[str]:
    """Corpus text cut to ``lengths`` LO..HI tokens (uniform) of the model's tokenizer, or
    (no lengths) openings of corpus documents 3 to 40 words long."""
    rng = random.Random(0)
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    if lengths is None:
        texts = [json.loads(line)["text"].split() for line in rng.sample(lines, count)]
        return [" ".join(words[: rng.randint(3, 40)]) for words in texts]
    tokenizer = load_tokenizer(str(package_tokenizer_path(model)))
    ids = tokenizer.encode(" ".join(json.loads(line)["text"] for line in lines[:2000]))
    out = []
    for _ in range(count):
        length = rng.randint(*lengths)
        start = rng.randrange(len(ids) - length)
        out.append(tokenizer.decode(ids[start : start + length]))
    return out


def run_server(model: str, prompts: list[str], args: argparse.Namespace, size: int) -> list[dict]:
    """One ``megalith serve`` process of batch ``size``; a row per ``--clients`` value."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "pipelines.cli", "serve", "--model", model, "--port", str(port),
        "--engine", args.engine, "--max-tokens", str(args.max_tokens), "--timeout", "600",
        "--device", args.device, "--precision", args.precision,
        "--max-queue", str(max(256, *args.clients)),
    ]  # fmt: skip
    command.append("--engine-process" if args.engine_process else "--no-engine-process")
    if not args.cuda_graphs:
        command.append("--no-cuda-graphs")
    if args.engine == "static":
        command += ["--max-batch-size", str(size), "--batch-window-ms", str(args.batch_window_ms)]
    else:
        command += ["--max-running", str(size)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    rows = []
    procs = args.client_procs
    pool = multiprocessing.get_context("spawn").Pool(procs) if procs > 1 else None
    try:
        wait_healthy(server, url)
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        request = {"model": name, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
        load(url, request, prompts[:8], 4, None, 3.0)  # warm-up
        if pool is not None:
            pool.map(abs, range(args.client_procs))  # the processes are up
        for clients in args.clients:
            print(f"{args.engine} {size}: {clients} clients ...", file=sys.stderr, flush=True)
            before = httpx.get(f"{url}/v1/model").json().get("stats", {})
            scraper = Scraper(url)
            server_cpu = process_cpu_seconds(server.pid)
            samples, cpu, wall = load(url, request, prompts, clients, pool, args.seconds)
            server_cpu = process_cpu_seconds(server.pid) - server_cpu
            scraper.stop()
            after = httpx.get(f"{url}/v1/model").json().get("stats", {})
            row = summarize(samples, args.seconds, wall, cpu, before, after, scraper)
            row["server_cpu_percent"] = 100 * server_cpu / wall
            rows.append({"engine": args.engine, "size": size, "clients": clients, **row})
            print(format_table(rows[-1:]), file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.terminate()
        server.terminate()
        server.wait(timeout=60)
    return rows


def wait_healthy(server: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
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


class Scraper:
    """Reads the KV blocks in use from /metrics every 0.5 s, in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.blocks: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.done.wait(0.5):
                for line in http.get("/metrics").text.splitlines():
                    if line.startswith("megalith_kv_blocks_used "):
                        self.blocks.append(float(line.split()[1]))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def load(
    url: str, request: dict, prompts: list[str], clients: int, pool: Any, seconds: float
) -> tuple[list[dict], float, float]:
    """``clients`` closed-loop clients over the ``pool``'s processes (or this one), sending
    until ``seconds`` have passed; returns the samples, the clients' CPU seconds and the
    wall time to the last answer."""
    procs = min(clients, pool._processes) if pool is not None else 1
    start = time.perf_counter()
    end = start + seconds
    shares = [(url, request, prompts, range(p, clients, procs), end) for p in range(procs)]
    results = pool.starmap(client_process, shares) if pool else [client_process(*shares[0])]
    samples = [s for result, _ in results for s in result]
    return samples, sum(cpu for _, cpu in results), time.perf_counter() - start


def client_process(
    url: str, request: dict, prompts: list[str], indices: range, end: float
) -> tuple[list[dict], float]:
    cpu = time.process_time()
    samples = asyncio.run(clients_until(url, request, prompts, indices, end))
    return samples, time.process_time() - cpu


async def clients_until(
    url: str, request: dict, prompts: list[str], indices: range, end: float
) -> list[dict]:
    samples: list[dict] = []
    limits = httpx.Limits(max_connections=len(indices))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client(index: int) -> None:
            rng = random.Random(index)
            while time.perf_counter() < end:
                body = {
                    **request,
                    "prompt": rng.choice(prompts),
                    "temperature": 0.8,
                    "seed": rng.randrange(2**31),
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                samples.append(await one_request(http, body))

        await asyncio.gather(*(client(i) for i in indices))
    return samples


async def one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> dict:
    """One streamed completion: when it was sent, when each text chunk came, its usage."""
    sent = time.perf_counter()
    chunks: list[float] = []
    usage: dict[str, int] = {}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"the stream ended in an error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"] and event["choices"][0]["text"]:
                chunks.append(time.perf_counter())
    return {"sent": sent, "done": time.perf_counter(), "chunks": chunks, **usage}


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` and the processes under it (an engine
    process), their threads included (Linux ``/proc``)."""
    parents, times = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        times[child] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, grew = {pid}, True
    while grew:
        below = {child for child, parent in parents.items() if parent in tree}
        grew = not below <= tree
        tree |= below
    return sum(times.get(process, 0.0) for process in tree)


def summarize(
    samples: list[dict],
    seconds: float,
    wall: float,
    cpu: float,
    before: dict,
    after: dict,
    scraper: Scraper,
) -> dict:
    """Throughput inside the window (chunks and requests done before it ended), latencies
    of every request."""
    start = min(s["sent"] for s in samples)
    end = start + seconds
    ttft = [s["chunks"][0] - s["sent"] for s in samples if s["chunks"]]
    gaps = [b - a for s in samples for a, b in zip(s["chunks"], s["chunks"][1:], strict=False)]
    tokens = sum(s.get("completion_tokens", 0) for s in samples)
    chunks = sum(len(s["chunks"]) for s in samples)
    in_window = sum(t < end for s in samples for t in s["chunks"])
    batches = after.get("batches", 0) - before.get("batches", 0)
    requests = after.get("requests", 0) - before.get("requests", 0)
    return {
        "requests": len(samples),
        "seconds": round(wall, 2),
        "requests_per_s": sum(s["done"] < end for s in samples) / seconds,
        "output_tokens_per_s": in_window / seconds * (tokens / chunks if chunks else 1.0),
        "mean_completion_tokens": tokens / len(samples),
        "mean_prompt_tokens": statistics.fmean(s.get("prompt_tokens", 0) for s in samples),
        "tokens_per_chunk": tokens / chunks if chunks else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "kv_blocks_max": max(scraper.blocks, default=0),
        "kv_blocks_mean": statistics.fmean(scraper.blocks) if scraper.blocks else 0.0,
        "mean_batch": requests / batches if batches else 0.0,
        "client_cpu_percent": 100 * cpu / wall,
    }


def run_hf(model: str, workdir: Path, prompts: list[str], args: argparse.Namespace) -> list[dict]:
    """transformers' generate on the model exported to HF, static batches of C prompts."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    from training.interop.export import export_hf

    hf_dir = export_hf(model, workdir / "hf")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(args.device).eval()
    tokenizer = load_tokenizer(str(package_tokenizer_path(model)))
    encoded = [[tokenizer.eod_id, *tokenizer.encode(p)] for p in prompts]
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    class FirstToken(StoppingCriteria):
        """Notes when the first new token is there (generate calls this after each)."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if self.at is None:
                sync()
                self.at = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def batch(rows: list[list[int]]) -> dict[str, float]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        first = FirstToken()
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                stopping_criteria=StoppingCriteriaList([first]),
            )  # fmt: skip
        sync()
        done = time.perf_counter()
        new = int((out.shape[1] - width) * len(rows))
        return {"seconds": done - start, "ttft": (first.at or done) - start, "tokens": new}

    batch(encoded[:2])  # warm-up
    rows = []
    for clients in args.clients:
        runs = [
            batch([encoded[(b * clients + i) % len(encoded)] for i in range(clients)])
            for b in range(max(1, args.hf_batches // clients))
        ]
        seconds = sum(r["seconds"] for r in runs)
        rows.append({
            "engine": "hf-generate", "clients": clients, "batches": len(runs),
            "requests": clients * len(runs),
            "output_tokens_per_s": sum(r["tokens"] for r in runs) / seconds,
            "requests_per_s": clients * len(runs) / seconds,
            "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in runs),
            "ttft_p99_ms": 1000 * max(r["ttft"] for r in runs),
            "latency_ms": 1000 * seconds / len(runs),
            "new_tokens_per_request": runs[0]["tokens"] / clients,
        })  # fmt: skip
        print(format_hf_table(rows[-1:]), file=sys.stderr, flush=True)
    return rows


def header(args: argparse.Namespace) -> str:
    device = args.device
    if device.startswith("cuda"):
        import torch

        device = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{when}, {platform.machine()} {os.cpu_count()} CPUs, device {device}, "
        f"{args.shape if not args.model else args.model} {args.precision}, {args.seconds:g} s "
        f"a load, max_tokens {args.max_tokens}, ignore_eos {args.ignore_eos}, prompt tokens "
        f"{args.prompt_tokens or 'short'}, server threads {args.threads}"
        + (", engine in its own process" if args.engine_process else "")
        + ("" if args.cuda_graphs else ", no CUDA graphs")
    )


def format_table(rows: list[dict]) -> str:
    head = (
        "| engine (batch) | clients | requests | req/s | output tok/s | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | KV blocks max / mean | mean batch | tokens/request "
        "| client CPU | server CPU |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['engine']} ({r['size']}) | {r['clients']} | {r['requests']} "
        f"| {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} "
        f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
        f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} "
        f"| {r['kv_blocks_max']:.0f} / {r['kv_blocks_mean']:.0f} | {r['mean_batch']:.1f} "
        f"| {r['mean_completion_tokens']:.1f} | {r['client_cpu_percent']:.0f}% "
        f"| {r.get('server_cpu_percent', float('nan')):.0f}% |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def format_hf_table(rows: list[dict]) -> str:
    head = (
        "| engine | clients (batch) | requests | req/s | output tok/s | TTFT median / max ms "
        "| latency per batch ms | new tokens/request |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['engine']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} "
        f"| {r['output_tokens_per_s']:.0f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
        f"| {r['latency_ms']:.0f} | {r['new_tokens_per_request']:.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def plot(rows: list[dict], hf_rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    engine = rows[0]["engine"] if rows else ""
    for label, series in ((f"megalith serve ({engine})", rows), ("HF generate", hf_rows)):
        if not series:
            continue
        clients = [r["clients"] for r in series]
        left.plot(clients, [r["output_tokens_per_s"] for r in series], "o-", label=label)
        right.plot(clients, [r["ttft_p99_ms"] for r in series], "o-", label=label)
    for axis, name in ((left, "output tokens/s"), (right, "time to first token p99 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks([r["clients"] for r in rows], [str(r["clients"]) for r in rows])
        axis.set_xlabel("concurrent clients")
        axis.set_title(name)
        axis.grid(True, alpha=0.3)
        axis.legend()
    right.set_yscale("log")
    fig.suptitle(textwrap.fill(title, 160), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
