"""Work pools and workers: ``megalith deploy-pipelines`` creates a process pool and
registers the deployments to it; a real ``prefect worker start --pool`` process runs a
``cluster-train`` run created as the UI's Run button creates it, with job variables; the
kubernetes pool's template (documented in docs/multi-node.md) is accepted by the Prefect
server and renders a valid Kubernetes Job."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest
from kubeflow_trainer_api import models
from parallel_helpers import REPO, config_of, tiny_settings

from megalith.config import load_config
from megalith.errors import MegalithError
from pipelines.cli import main
from pipelines.cluster_train import ClusterSize, target_arguments
from pipelines.work_pools import base_job_template, ensure_pool
from tests.servers import running_process
from training.checkpoint.signing import check_signature

pytestmark = pytest.mark.slow

DOCS = REPO / "docs" / "multi-node.md"
SIGNING_KEY = "k" * 32
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def wait_for_final_state(client, run_id: uuid.UUID, log: Path, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while (run := client.read_flow_run(run_id)).state.type.value not in FINAL:
        assert time.monotonic() < deadline, (
            f"flow run still {run.state.name} after {timeout_s} s; the worker said:\n"
            + log.read_text(errors="replace")[-3000:]
        )
        time.sleep(1)
    return run


def run_logs(client, run_id: uuid.UUID) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    found = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return [entry.message for entry in found]


def test_a_worker_runs_cluster_train_from_a_process_pool(
    prefect_api, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    monkeypatch.setenv("PREFECT_API_URL", api)
    pool = f"box-{uuid.uuid4().hex[:8]}"
    assert main(["deploy-pipelines", "--pool", pool, "--workdir", str(tmp_path / "work")]) == 0
    said = capsys.readouterr().out
    assert f"work pool {pool} (process): created" in said
    assert f"prefect worker start --pool {pool}" in said
    with pytest.raises(MegalithError, match=f"{pool}' exists with type 'process'"):
        ensure_pool(pool, "kubernetes")

    run_dir = tmp_path / "run"
    settings = tiny_settings(shards, {"training.train_iters": 2, "checkpoint.interval": 2})
    worker_log = tmp_path / "worker.log"
    worker_env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # poll every second, not every 10
        "PYTHONPATH": str(REPO),
    }
    worker_env.pop("MEGALITH_SIGNING_KEY", None)
    worker = [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool]
    with (
        running_process(worker, worker_env, "prefect worker", log=worker_log),
        get_client(sync_client=True) as client,
    ):
        deployment = client.read_deployment_by_name("cluster-train/cluster-train")
        assert (deployment.work_pool_name, deployment.entrypoint, deployment.path) == (
            pool, "pipelines.cluster_train.cluster_train", None,
        )  # fmt: skip
        # What the UI's Custom run sends: the form's parameters and the job variables.
        run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"config": config_of(settings).model_dump(mode="json"), "run_dir": str(run_dir)},
            job_variables={"gpus_per_node": 2, "env": {"MEGALITH_SIGNING_KEY": SIGNING_KEY}},
        )  # fmt: skip
        run = wait_for_final_state(client, run.id, worker_log)
        logs = run_logs(client, run.id)
    assert run.state.type.value == "COMPLETED", (
        run.state.message,
        logs[-20:],
        worker_log.read_text(errors="replace")[-3000:],
    )
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == 2
    # gpus_per_node (a job variable) reached the flow as MEGALITH_GPUS_PER_NODE: two ranks.
    index = json.loads((Path(result["checkpoint"]) / "index.json").read_text())
    assert index["layout"]["world"] == 2, index["layout"]
    assert any("2 GPU(s)/processes per node" in line for line in logs), logs
    # env (a job variable) reached the training: its checkpoint is signed with that key.
    signature = json.loads((Path(result["checkpoint"]) / "signature.json").read_text())
    assert signature["algorithm"] == "hmac-sha256"
    monkeypatch.setenv("MEGALITH_SIGNING_KEY", SIGNING_KEY)
    assert check_signature(Path(result["checkpoint"]), "index.json", required=True)


def test_cluster_train_calls_each_target_with_its_parameters(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "tiny-cpu.yaml")
    size = ClusterSize(2, 4, "the run form")
    flow, arguments = target_arguments("slurm", config, "/shared/run", size, {"partition": "gpu"})
    assert flow.name == "slurm-train"
    assert {k: v for k, v in arguments.items() if k != "config"} == {
        "run_dir": "/shared/run", "nodes": 2, "gpus_per_node": 4, "partition": "gpu",
    }  # fmt: skip
    one_node = ClusterSize(1, 4, "the run form")
    flow, arguments = target_arguments("local", config, "/runs/a", one_node, {})
    chosen = (flow.name, arguments["output"], arguments["nproc_per_node"])
    assert chosen == ("pretrain", "/runs/a", 4)
    with pytest.raises(MegalithError, match="runs on one machine: nodes must be 1, got 2"):
        target_arguments("local", config, "/runs/a", size, {})
    with pytest.raises(MegalithError, match=r"k8s-train\) needs recipe"):
        target_arguments("k8s", config, "/runs/a", size, {"image": "reg/megalith:1"})
    with pytest.raises(MegalithError, match=r"options \['nodes'\] are not parameters"):
        target_arguments("slurm", config, "/runs/a", size, {"nodes": 3})


def documented_kubernetes_template() -> dict:
    text = DOCS.read_text()
    section = text[text.index("base job template of a kubernetes pool") :]
    return json.loads(re.search(r"```json\n(.*?)\n```", section, re.DOTALL).group(1))


def test_the_documented_kubernetes_template_renders_a_valid_job(prefect_api) -> None:
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.workers.base import BaseJobConfiguration

    template = base_job_template("kubernetes")
    assert documented_kubernetes_template() == template
    validate_base_job_template(template)  # the Prefect server's own check of placeholders
    assert ensure_pool(f"k8s-{uuid.uuid4().hex[:8]}", "kubernetes") == (True, [])

    class KubernetesJob(BaseJobConfiguration):  # the fields prefect-kubernetes reads
        namespace: str
        job_manifest: dict

    values = {"image": "reg/megalith:1", "nodes": 4, "gpus_per_node": 8, "pod_gpus": 8,
              "env": {"NCCL_DEBUG": "WARN"}, "name": "cluster-train-run"}  # fmt: skip
    job = asyncio.run(KubernetesJob.from_template_and_values(template, values))
    assert job.env == {
        "MEGALITH_NODES": "4", "MEGALITH_GPUS_PER_NODE": "8",
        "MEGALITH_IMAGE": "reg/megalith:1", "NCCL_DEBUG": "WARN",
    }  # fmt: skip
    manifest = job.job_manifest
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    # prefect-kubernetes writes the env map into the container as a list
    container["env"] = [{"name": k, "value": v} for k, v in job.env.items()]
    assert (container["image"], container["resources"]["limits"]["nvidia.com/gpu"]) == (
        "reg/megalith:1", 8,
    )  # fmt: skip
    # prefect-kubernetes' default template, and the manifest check its worker applies to
    # every job, keep these two in the pod spec, where Kubernetes ignores them.
    pod = manifest["spec"]["template"]["spec"]
    assert (pod.pop("parallelism"), pod.pop("completions")) == (1, 1)
    parsed = models.IoK8sApiBatchV1Job.from_dict(manifest)
    assert parsed.to_dict() == manifest, "every other field is Kubernetes' own"
