"""Work pools for the deployments: a ``process`` pool (runs on the worker's machine) or a
``kubernetes`` pool (each run in a pod), each with megalith's job variables.

A worker (``prefect worker start --pool NAME``) runs a deployment's flow run from its
pool, in the infrastructure the pool's base job template describes, filled with the job
variables of the deployment and of the run. Megalith's pools add four to Prefect's own:

- ``nodes`` and ``gpus_per_node``: the cluster size ``cluster-train`` uses when its form
  leaves it empty;
- ``image``: the container image of a kubernetes pool's pods, and the image of the
  ``k8s`` target's TrainJob when ``cluster-train``'s options leave it out;
- ``env`` (Prefect's): more environment for the run's process.

The template passes the first three to the run's process as ``MEGALITH_NODES``,
``MEGALITH_GPUS_PER_NODE`` and ``MEGALITH_IMAGE``: Prefect merges ``env`` into that map.
"""

from __future__ import annotations

import copy
from typing import Any

from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessWorker

from megalith.errors import MegalithError
from pipelines.cluster_train import GPUS_PER_NODE_ENV, IMAGE_ENV, NODES_ENV

POOL_TYPES = ("process", "kubernetes")

SIZE_VARIABLES: dict[str, dict[str, Any]] = {
    "nodes": {
        "title": "Nodes",
        "type": "integer",
        "minimum": 1,
        "default": 1,
        "description": "Nodes a cluster-train run uses when its form leaves nodes empty.",
    },
    "gpus_per_node": {
        "title": "GPUs per node",
        "type": "integer",
        "minimum": 1,
        "default": 1,
        "description": "GPUs (processes) per node a cluster-train run uses when its form "
        "leaves gpus_per_node empty.",
    },
    "image": {
        "title": "Image",
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": None,
        "description": "A container image with megalith installed: the image of the k8s "
        "target's TrainJob (and, in a kubernetes pool, of the run's own pod).",
    },
}
SIZE_ENV = {
    NODES_ENV: "{{ nodes }}",
    GPUS_PER_NODE_ENV: "{{ gpus_per_node }}",
    IMAGE_ENV: "{{ image }}",
}

POD_GPUS_VARIABLE = {
    "title": "GPUs of the run's pod",
    "type": "integer",
    "minimum": 0,
    "default": 0,
    "description": "nvidia.com/gpu of the pod the flow run itself runs in: gpus_per_node "
    "for the local target, 0 when the run submits to slurm, k8s or ray.",
}
KUBERNETES_VARIABLES: dict[str, dict[str, Any]] = {
    "namespace": {
        "title": "Namespace",
        "type": "string",
        "default": "default",
        "description": "The namespace of the flow runs' jobs.",
    },
    "service_account_name": {
        "title": "Service account",
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": None,
        "description": "The service account of the jobs (the k8s target needs one that "
        "may create and delete TrainJobs).",
    },
    "image_pull_policy": {
        "title": "Image pull policy",
        "enum": ["IfNotPresent", "Always", "Never"],
        "default": "IfNotPresent",
    },
    "finished_job_ttl": {
        "title": "Finished job TTL",
        "anyOf": [{"type": "integer"}, {"type": "null"}],
        "default": None,
        "description": "Seconds a finished job is kept; empty: kept.",
    },
    "pod_watch_timeout_seconds": {
        "title": "Pod watch timeout",
        "type": "integer",
        "default": 300,
        "description": "Seconds to wait for the pod to start (pulling a large image).",
    },
    "stream_output": {"title": "Stream output", "type": "boolean", "default": True},
    "pod_gpus": POD_GPUS_VARIABLE,
}


def base_job_template(pool_type: str) -> dict[str, Any]:
    """The base job template of a megalith pool of ``pool_type``."""
    if pool_type not in POOL_TYPES:
        raise MegalithError(f"pool type {pool_type!r}: expected one of {', '.join(POOL_TYPES)}")
    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"].update(copy.deepcopy(SIZE_VARIABLES))
    # A map, not "{{ env }}": Prefect merges the env job variable into it.
    template["job_configuration"]["env"] = dict(SIZE_ENV)
    if pool_type == "kubernetes":
        _make_kubernetes(template)
    return template


def _make_kubernetes(template: dict[str, Any]) -> None:
    """Prefect's kubernetes worker template (prefect-kubernetes), with the pod's GPUs."""
    properties = template["variables"]["properties"]
    del properties["working_dir"], properties["stream_output"]
    properties.update(copy.deepcopy(KUBERNETES_VARIABLES))
    container = {
        "name": "prefect-job",
        "env": "{{ env }}",  # the worker puts the whole env map here, as a list
        "image": "{{ image }}",
        "imagePullPolicy": "{{ image_pull_policy }}",
        "args": "{{ command }}",
        "resources": {"limits": {"nvidia.com/gpu": "{{ pod_gpus }}"}},
    }
    template["job_configuration"] = {
        "command": "{{ command }}",
        "env": dict(SIZE_ENV),
        "labels": "{{ labels }}",
        "name": "{{ name }}",
        "namespace": "{{ namespace }}",
        "stream_output": "{{ stream_output }}",
        "pod_watch_timeout_seconds": "{{ pod_watch_timeout_seconds }}",
        "job_manifest": {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "labels": "{{ labels }}",
                "namespace": "{{ namespace }}",
                "generateName": "{{ name }}-",
            },
            "spec": {
                "backoffLimit": 0,
                "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
                "template": {
                    "spec": {
                        "parallelism": 1,
                        "completions": 1,
                        "restartPolicy": "Never",
                        "serviceAccountName": "{{ service_account_name }}",
                        "containers": [container],
                    }
                },
            },
        },
    }


def ensure_pool(name: str, pool_type: str) -> tuple[bool, list[str]]:
    """Create work pool ``name`` with megalith's template unless it exists. Returns
    whether it was created, and the megalith job variables an existing pool lacks (it is
    kept as it is). An existing pool of another type is refused."""
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            template = base_job_template(pool_type)
            client.create_work_pool(
                WorkPoolCreate(name=name, type=pool_type, base_job_template=template)
            )
            return True, []
    if pool.type != pool_type:
        raise MegalithError(
            f"work pool {name!r} exists with type {pool.type!r}, not {pool_type!r}: "
            f"pass --pool-type {pool.type}, or another --pool name"
        )
    variables = pool.base_job_template.get("variables", {}).get("properties", {})
    return False, sorted(set(SIZE_VARIABLES) - set(variables))
