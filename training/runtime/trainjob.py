"""A Kubeflow Trainer v2 ``TrainJob`` that runs ``megalith train`` on Kubernetes.

The TrainJob names a ClusterTrainingRuntime (``torch-distributed`` by default); the
Trainer controller makes one pod per node from it and sets PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT in each. The pod's command is ``megalith train``
with those as its launch flags (Kubernetes expands ``$(VAR)`` in a command from the
container's environment), so each pod's launcher starts its GPUs' workers through
torchrun and all nodes meet at the first pod, as in the Slurm script.

Checkpoints must outlive the pods: a PersistentVolumeClaim every node mounts (the run
folder lives on it) or an ``s3://`` checkpoint directory, or both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megalith.errors import MegalithError

API_VERSION = "trainer.kubeflow.org/v1alpha1"
TORCH_RUNTIME = "torch-distributed"  # the ClusterTrainingRuntime Kubeflow Trainer ships
NODE = "node"  # the runtime's replicated job and container that run the trainer
MOUNT = "/mnt/megalith"  # where the claim is mounted in every pod
PATCH_MANAGER = "megalith"  # owner of the runtime patch that mounts the claim


def trainjob_name(name: str) -> str:
    """A DNS-1035 label from a run name: lower case, digits and '-', a letter first."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:50].rstrip("-")
    return label if label[:1].isalpha() else f"m-{label}"


def train_job(
    config: str,
    nodes: int,
    gpus_per_node: int,
    image: str,
    *,
    name: str,
    sets: Sequence[str] = (),
    volume_claim: str | None = None,
    checkpoint_dir: str | None = None,
    memory: str = "64Gi",
    cpus: int | None = None,
    env: Mapping[str, str] | None = None,
    namespace: str | None = None,
    runtime: str = TORCH_RUNTIME,
) -> dict[str, Any]:
    """The TrainJob manifest as plain data (``yaml.safe_dump`` it). ``config`` is the
    recipe's path as the pod sees it (in the image, or under the claim's mount)."""
    if nodes < 1 or gpus_per_node < 1:
        raise MegalithError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    if not volume_claim and not (checkpoint_dir or "").startswith("s3://"):
        raise MegalithError(
            "checkpoints would die with the pods: give --volume-claim NAME (a "
            "PersistentVolumeClaim every node mounts) or --checkpoint-dir s3://BUCKET/PATH"
        )
    job = trainjob_name(name)
    run_dir = f"{MOUNT}/runs/{job}" if volume_claim else f"/tmp/{job}"
    settings = list(sets)
    if checkpoint_dir:
        settings.append(f"checkpoint.directory={checkpoint_dir}")
    command = ["megalith", "train", "--config", config]
    for setting in settings:
        command += ["--set", setting]
    command += [
        "--output", run_dir, "--quiet", "--resume",
        "--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node),
        "--node-rank", "$(PET_NODE_RANK)",
        "--rdzv-endpoint", "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", "--rdzv-id", job,
    ]  # fmt: skip
    resources = {"nvidia.com/gpu": str(gpus_per_node), "memory": memory}
    if cpus:
        resources["cpu"] = str(cpus)
    trainer: dict[str, Any] = {
        "numNodes": nodes,
        "image": image,
        "command": command,
        "resourcesPerNode": {"limits": resources, "requests": dict(resources)},
    }
    if env:
        trainer["env"] = [{"name": key, "value": value} for key, value in env.items()]
    spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                       "name": runtime},
        "trainer": trainer,
    }  # fmt: skip
    if volume_claim:
        spec["runtimePatches"] = [_mount_claim(volume_claim)]
    metadata: dict[str, Any] = {"name": job, "labels": {"app.kubernetes.io/name": "megalith"}}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": "TrainJob", "metadata": metadata, "spec": spec}


def _mount_claim(claim: str) -> dict[str, Any]:
    """A runtime patch that mounts the claim at ``MOUNT`` in every node's trainer."""
    pod = {
        "volumes": [{"name": "megalith", "persistentVolumeClaim": {"claimName": claim}}],
        "containers": [{"name": NODE, "volumeMounts": [{"name": "megalith", "mountPath": MOUNT}]}],
    }
    job = {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}},
    }
