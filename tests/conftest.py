"""Shared pytest fixtures.

``s3_endpoint`` runs moto's S3 server in a thread for the whole session; tests talk
to it over HTTP through s3fs exactly as they would to a real bucket. Use
``s3_bucket`` for a fresh empty bucket, or ``make_s3_bucket()`` for several.
``shards`` is the tiny shard set of the trainer and parallelism tests; every test
runs with one intra-op thread (``one_cpu_thread``). ``ray_cluster`` is a two-node Ray
cluster on this machine (tests/ray_cluster.py).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from tests.servers import free_port, running_process

# Python caches compiled modules in __pycache__ unless PYTHONDONTWRITEBYTECODE is set, as it
# is on our CI machines: then every `megalith` process the suite starts (hundreds of them)
# compiles the project's modules again, about half a second of CPU each.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The fuzz tests draw the same examples on every run, so CI is repeatable and a failure
# reproduces; HYPOTHESIS_PROFILE=explore draws new ones (run it when hardening a reader).
# No example database: nothing is written into the source tree.
hypothesis_settings.register_profile("repeatable", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", database=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[dict[str, Any]]:
    """A local S3 server; yields fsspec ``storage_options`` for s3fs.

    While it runs, the AWS environment points at it with dummy credentials
    (``AWS_ENDPOINT_URL`` included, real config files hidden), so boto3 clients and
    s3fs created without options reach it too and never a real AWS account.
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in S3_CREDENTIALS.items():
            env.setenv(name, value)
        env.setenv("AWS_ENDPOINT_URL", endpoint)
        env.delenv("AWS_PROFILE", raising=False)
        env.setenv("AWS_CONFIG_FILE", os.devnull)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
        env.setenv("NO_PROXY", no_proxy)
        try:
            yield {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        finally:
            _clear_s3fs_instances()
            server.stop()


def _clear_s3fs_instances() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def make_s3_bucket(s3_endpoint: dict[str, Any]) -> Callable[[], str]:
    """A factory: each call creates a new, uniquely named bucket and returns ``s3://name``."""
    import s3fs

    def make() -> str:
        name = f"megalith-test-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**s3_endpoint).mkdir(name)
        return f"s3://{name}"

    return make


@pytest.fixture
def s3_bucket(make_s3_bucket: Callable[[], str]) -> str:
    """A fresh empty bucket, as ``s3://name``."""
    return make_s3_bucket()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """One temporary Prefect server and database for the whole session. Startup takes
    ~10 s here; the generous limit is for a loaded CI machine, where one slow start would
    otherwise error every Prefect test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A real two-node Ray cluster on this machine (``tests/ray_cluster.py``: a head and a
    worker node, each its own raylet), one per test module that asks for it."""
    from tests.ray_cluster import two_node_cluster

    with two_node_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory):
    """The sample corpus as tiny shards (tests/parallel_helpers.py), built once per session."""
    from parallel_helpers import tiny_shard_set

    return tiny_shard_set(tmp_path_factory)


@pytest.fixture(autouse=True, scope="session")
def one_cpu_thread() -> Iterator[None]:
    """The tests' tensors are tiny: intra-op threads only add synchronisation, and on a
    busy two-core machine they make steps 4-40x slower. Child processes inherit it."""
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a test marked ``slow`` first (pytest-xdist hands out whole files in this
    order, so no worker is left running a long file alone at the end); tests marked
    ``gpu`` run only where CUDA is available."""
    import torch

    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` on 127.0.0.1 with a SQLite store and served artifacts."""
    from training.mlflow_store.runs import ensure_tracking_store

    root = tmp_path_factory.mktemp("mlflow-server")
    store = f"sqlite:///{root / 'mlflow.db'}"
    ensure_tracking_store(store)  # migrate once, before the server's workers start
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", store,
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running_process(command, env, "mlflow server", f"{url}/health"):
        yield url


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-piece SentencePiece model trained on the shipped stories."""
    import json

    from megalith.config import TokenizerConfig
    from preprocessing.tokenizer import train_tokenizer

    corpus = Path(__file__).parent.parent / "preprocessing/sample_corpus/stories.jsonl"
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:300]]
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    config = TokenizerConfig(vocab_size=400, pad_vocab_multiple=64, max_training_documents=300)
    train_tokenizer(docs, config, str(prefix))
    return Path(f"{prefix}.model")
