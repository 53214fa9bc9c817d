"""``megalith serve``: the HTTP generation server (``deploy.server``) under uvicorn."""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import sys
from collections.abc import Callable

from deploy.request_body import DEFAULT_MAX_BODY_BYTES
from megalith.errors import MegalithError
from registry.cli import add_store_arguments, mlflow_errors_in_one_line
from training.mlflow_store.registered import is_registry_uri
from training.mlflow_store.runs import existing_store_uri

DEFAULT_PORT = 8000
ADMIN_TOKEN_ENV = "MEGALITH_ADMIN_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def number_type(
    kind: type[int] | type[float], minimum: float, maximum: float = math.inf, above: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a ``kind`` from ``minimum`` (exclusive with ``above``) to
    ``maximum``; NaN and infinities are refused, so no later arithmetic meets them."""
    wanted = f"above {minimum}" if above else f"at least {minimum}"
    if math.isfinite(maximum):
        wanted = f"from {minimum} to {maximum}"  # (inclusive; no caller has both `above` and a max)
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str) -> float:
        value = kind(text)  # a ValueError: argparse says "invalid int/float value"
        low_ok = value > minimum if above else value >= minimum
        if not (math.isfinite(value) and low_ok and value <= maximum):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {noun} {wanted}")
        return value

    parse.__name__ = kind.__name__
    return parse


def require_free_port(host: str, port: int, flag: str) -> None:
    """Refuse an address nothing can listen on (something already does) before any slow
    start-up. SO_REUSEADDR as servers set it: a closed server's lingering connections do
    not count as taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MegalithError(
                    f"{host}:{port} is taken: stop what listens there, or pick another "
                    f"port with {flag}"
                ) from None
            raise MegalithError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


PORT = number_type(int, 1, 65535)
COUNT = number_type(int, 1)
SECONDS = number_type(float, 0, above=True)


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "serve",
        help="serve a model over HTTP: generation, streaming, batching, hot reload",
        description="Serve a registered model version (models:/NAME@ALIAS or "
        "models:/NAME/VERSION, from --tracking-uri, MLFLOW_TRACKING_URI or WORKDIR/mlflow.db as "
        "`megalith demo` writes it) or a model "
        "package directory over HTTP: the OpenAI-compatible POST /v1/completions, POST "
        "/v1/chat/completions and GET /v1/models; POST /v1/generate (SSE streaming with "
        '"stream": true), POST /v1/chat (messages through the chat template), GET /health, '
        "GET /v1/model, GET /metrics (Prometheus), POST /admin/reload (switch to the "
        "alias's current version without dropping requests; it needs 'Authorization: Bearer "
        f"TOKEN' when {ADMIN_TOKEN_ENV} is set). A GPT's concurrent requests are decoded with "
        "continuous batching over a paged KV cache (--engine continuous): they join and leave "
        "the batch at every step; a T5's (or --engine static) in static batches.",
    )
    parser.add_argument(
        "--model", required=True, metavar="SOURCE", help="models:/NAME@ALIAS, or a package dir"
    )
    add_store_arguments(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"address to bind (127.0.0.1); set {ADMIN_TOKEN_ENV} before binding another",
    )
    parser.add_argument("--port", type=PORT, default=DEFAULT_PORT, help=f"({DEFAULT_PORT})")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (cpu)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument(
        "--max-tokens",
        type=COUNT,
        default=256,
        metavar="N",
        help="most tokens a request may ask (256)",
    )
    parser.add_argument(
        "--timeout", type=SECONDS, default=60.0, metavar="S", help="longest a request runs (60 s)"
    )
    parser.add_argument(
        "--engine",
        choices=["continuous", "static"],
        default="continuous",
        help="continuous batching over a paged KV cache (GPT; a T5 is always static), or "
        "static batches decoded to the end (continuous)",
    )
    parser.add_argument(
        "--max-running",
        type=COUNT,
        default=64,
        metavar="N",
        help="continuous: most sequences decoding at once (64)",
    )
    parser.add_argument(
        "--block-size",
        type=COUNT,
        default=16,
        metavar="N",
        help="continuous: positions per KV-cache block (16)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=COUNT,
        metavar="N",
        help="continuous: KV-cache blocks, the KV memory (default: --max-running sequences "
        "of the model's whole context); a request waits until its prompt + max_tokens fit",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=COUNT,
        default=2048,
        metavar="N",
        help="continuous: most prompt tokens read in one step, between decode steps (2048)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="run the engine in a process of its own, so that the decode loop and the HTTP "
        "side do not share one Python interpreter (GIL); the model loads there (default: "
        "on for CUDA devices, off on CPU)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="continuous on CUDA: launch each decode step kernel by kernel instead of "
        "replaying it as a CUDA graph (slower; to rule graphs out when debugging)",
    )
    parser.add_argument("--max-batch-size", type=COUNT, default=8, metavar="N", help="static: (8)")
    parser.add_argument(
        "--batch-window-ms",
        type=number_type(float, 0),
        default=5.0,
        metavar="MS",
        help="static: how long the first request of a batch waits for others (5 ms)",
    )
    parser.add_argument(
        "--max-queue",
        type=COUNT,
        default=256,
        metavar="N",
        help="waiting requests before 429 with Retry-After (256)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=COUNT,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"larger request bodies answer 413, unread ({DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--watch",
        type=SECONDS,
        metavar="S",
        help="check the alias every S seconds and switch when it moves (default: off)",
    )
    parser.set_defaults(handler=_serve)


@mlflow_errors_in_one_line
def _serve(args: argparse.Namespace) -> int:
    require_free_port(args.host, args.port, "--port")
    tracking_uri = args.tracking_uri
    if is_registry_uri(args.model):
        tracking_uri = existing_store_uri(tracking_uri, args.workdir)

    import uvicorn

    from deploy.deployment import engine_summary
    from deploy.server import Deployment, ServeConfig, create_app

    config = ServeConfig(
        model=args.model,
        tracking_uri=tracking_uri,
        device=args.device,
        precision=args.precision,
        max_tokens=args.max_tokens,
        timeout_s=args.timeout,
        engine=args.engine,
        max_batch_size=args.max_batch_size,
        batch_window_ms=args.batch_window_ms,
        max_running=args.max_running,
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        prefill_chunk=args.prefill_chunk,
        engine_process=args.engine_process,
        cuda_graphs=args.cuda_graphs,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        watch_s=args.watch,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
    )
    if config.admin_token is None and args.host not in LOOPBACK:
        print(
            f"warning: {args.host} is reachable from other hosts and {ADMIN_TOKEN_ENV} is "
            "not set: anyone who reaches it can reload the model",
            file=sys.stderr,
        )
    deployment = Deployment(config)
    info = deployment.engine.served.info
    what = info.name if info.version is None else f"{info.name} version {info.version}"
    print(f"serving {what} ({info.content_id[:12]}) on http://{args.host}:{args.port}", flush=True)
    print(engine_summary(deployment.engine, args.max_running), flush=True)
    uvicorn.run(create_app(deployment), host=args.host, port=args.port, log_level="info")
    return 0
