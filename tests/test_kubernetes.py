"""``megalith launch k8s`` and the ``k8s-train`` flow without a cluster: the TrainJob is
checked against Kubeflow Trainer's own API models (kubeflow-trainer-api, the pydantic
types the kubeflow SDK builds its TrainJobs with), and the flow's submission is checked
at the command boundary, a stand-in kubectl recording its argv and stdin."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import fake_commands
import pytest
import yaml
from kubeflow_trainer_api import models
from parallel_helpers import RECIPE
from pydantic import ValidationError

from megalith.config import load_config
from pipelines import kubernetes
from pipelines.cli import build_parser, main
from pipelines.cluster_flows import k8s_train
from pipelines.external import Outcome

DATA = Path(__file__).parent / "data" / "kubernetes"
SETS = ["training.micro_batch_size=1"]
IMAGE = "ghcr.io/acme/megalith:0.1"


def launch_k8s(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "trainjob.yaml"
    args = ["launch", "k8s", "--config", str(RECIPE), "--nodes", "2", "--gpus-per-node", "4",
            "--image", IMAGE, "--set", SETS[0], "--output", str(out), *extra]  # fmt: skip
    assert main(args) == 0
    return yaml.safe_load(out.read_text())


def test_the_trainjob_is_a_valid_kubeflow_trainer_object(tmp_path: Path) -> None:
    manifest = launch_k8s(
        tmp_path, "--volume-claim", "megalith-runs", "--memory", "480Gi",
        "--env", "NCCL_DEBUG=WARN", "--checkpoint-dir", "s3://ckpt/tiny",
    )  # fmt: skip
    job = models.TrainerV1alpha1TrainJob.from_dict(manifest)
    # The models drop keys they do not know: a round trip that loses nothing means every
    # key is one the TrainJob API has, with a value of its type.
    assert job.to_dict() == manifest
    assert (job.api_version, job.kind) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job.spec.runtime_ref.name == "torch-distributed"
    assert job.spec.runtime_ref.kind == "ClusterTrainingRuntime"
    trainer = job.spec.trainer
    assert trainer.num_nodes == 2 and trainer.image == IMAGE
    limits = trainer.resources_per_node.to_dict()["limits"]
    assert limits == {"nvidia.com/gpu": "4", "memory": "480Gi"}
    assert [(env.name, env.value) for env in trainer.env] == [("NCCL_DEBUG", "WARN")]
    (patch,) = job.spec.runtime_patches
    (node,) = patch.training_runtime_spec.template.spec.replicated_jobs
    pod = node.template.spec.template.spec
    assert node.name == "node" and pod.containers[0].name == "node"
    assert pod.volumes[0].persistent_volume_claim.claim_name == "megalith-runs"
    mount = pod.containers[0].volume_mounts[0]
    assert (mount.name, mount.mount_path) == (pod.volumes[0].name, "/mnt/megalith")

    # Each pod runs `megalith train` as Kubernetes expands it on node 1: a command our
    # own parser takes, meeting at the first pod, checkpoints on the claim's run folder
    # and in s3.
    expanded = [
        arg.replace("$(PET_NODE_RANK)", "1").replace("$(PET_MASTER_ADDR)", "tiny-cpu-node-0-0.tiny-cpu")
        .replace("$(PET_MASTER_PORT)", "29400")
        for arg in trainer.command
    ]  # fmt: skip
    assert expanded[0] == "megalith"
    args = build_parser().parse_args(expanded[1:])
    assert args.command == "train" and args.config == str(RECIPE)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == (2, 4, 1)
    assert args.rdzv_endpoint == "tiny-cpu-node-0-0.tiny-cpu:29400"
    assert args.output.startswith("/mnt/megalith/runs/") and args.resume
    assert args.set == [*SETS, "checkpoint.directory=s3://ckpt/tiny"]


def test_the_trainer_models_catch_a_wrong_key_or_type(tmp_path: Path) -> None:
    """What the check above relies on: a misspelled key is dropped, a wrong type refused."""
    manifest = launch_k8s(tmp_path, "--volume-claim", "runs")
    manifest["spec"]["trainer"]["numnodes"] = manifest["spec"]["trainer"].pop("numNodes")
    assert models.TrainerV1alpha1TrainJob.from_dict(manifest).to_dict() != manifest
    manifest["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(ValidationError, match="numNodes"):
        models.TrainerV1alpha1TrainJob.from_dict(manifest)


def test_a_trainjob_without_lasting_checkpoint_storage_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["launch", "k8s", "--config", str(RECIPE), "--nodes", "1", "--gpus-per-node", "1",
            "--image", IMAGE, "--checkpoint-dir", "/tmp/ckpt"]  # fmt: skip
    assert main(args) == 1
    assert "--volume-claim NAME" in capsys.readouterr().err


def test_launch_help_lists_slurm_and_k8s_with_examples(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    text = capsys.readouterr().out
    assert "slurm" in text and "k8s" in text
    assert "megalith launch k8s --config" in text and "megalith launch slurm --config" in text
    with pytest.raises(SystemExit):
        main(["launch", "k8s", "--help"])
    assert "kubectl apply -f trainjob.yaml" in " ".join(capsys.readouterr().out.split())


@pytest.fixture
def fake_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stand-in kubectl answering from a scenario folder; the calls it had."""
    state = tmp_path / "state"

    def use(scenario: Path) -> Path:
        for key, value in fake_commands.install(tmp_path / "bin", scenario, state).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        return state

    return use


# `kubectl get trainjob -o json` of a job in each state: its outcome and what the run logs
CONDITIONS = {
    "running": (Outcome.RUNNING, "node jobs: 2 active, 2 ready"),
    "suspended": (Outcome.WAITING, "Suspended (Suspended: TrainJob is suspended)"),
    "complete": (Outcome.SUCCEEDED, "Complete (JobCompleted: Job completed successfully)"),
    "failed": (
        Outcome.FAILED,
        "Failed (JobFailed: jobset failed: job node failed with BackoffLimitExceeded)",
    ),
}


def test_trainjob_conditions_map_to_outcomes(fake_kubectl) -> None:
    for case, (outcome, text) in CONDITIONS.items():
        reply = DATA / "states" / case / "kubectl-get-1.txt"
        as_json = json.loads(reply.read_text())
        job = models.TrainerV1alpha1TrainJob.from_dict(as_json)  # the shape the API has
        assert job.model_dump(mode="json", by_alias=True, exclude_none=True) == as_json
        state = fake_kubectl(DATA / "states" / case)
        status = kubernetes.trainjob_status("tiny-cpu", namespace="research")
        assert (status.outcome, status.describe()) == (outcome, text), case
        (call,) = fake_commands.calls(state, "kubectl")
        assert call["argv"][-6:] == ["research", "get", "trainjob", "tiny-cpu", "-o", "json"]
        shutil.rmtree(state)


def test_the_k8s_flow_applies_follows_and_deletes_the_trainjob(
    prefect_api, fake_kubectl, tmp_path: Path
) -> None:
    """Applied with the manifest `megalith launch k8s` writes, followed, and deleted when
    following fails (the API server unreachable three polls in a row): the run fails
    with kubectl's error and leaves no job training unwatched."""
    state = fake_kubectl(DATA)
    final = k8s_train(
        recipe=str(RECIPE), image=IMAGE, nodes=2, gpus_per_node=4, overrides=SETS,
        volume_claim="megalith-runs", context="gpu-cluster", poll_seconds=0.01, return_state=True,
    )  # fmt: skip
    assert final.is_failed() and "Unable to connect to the server" in final.message
    name = load_config(RECIPE, SETS).name
    calls = fake_commands.calls(state, "kubectl")
    assert [call["argv"] for call in calls] == [
        ["--context", "gpu-cluster", "apply", "-f", "-", "-o", "name"],
        *[["--context", "gpu-cluster", "get", "trainjob", name, "-o", "json"]] * 4,
        ["--context", "gpu-cluster", "delete", "trainjob", name, "--wait=false"],
    ]
    # what kubectl read is the manifest `megalith launch k8s` writes for the same inputs
    expected = launch_k8s(tmp_path, "--volume-claim", "megalith-runs")
    assert yaml.safe_load(calls[0]["stdin"]) == expected
