"""The ``cluster-train`` flow: one run form for training on any cluster target.

The form names the target (processes on the flow run's machine, Slurm, Kubernetes
through Kubeflow Trainer, Ray) and its size; the run calls the flow that knows that
target (``pretrain``, ``slurm-train``, ``k8s-train``, ``ray-train``, found by name) as a
subflow in this process, so cancelling this run stops that one and its job. A size left
empty in the form comes from the work pool's job variables, which a megalith pool passes
to the run's process as ``MEGALITH_NODES``, ``MEGALITH_GPUS_PER_NODE`` and
``MEGALITH_IMAGE`` (``pipelines.work_pools``).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Literal

from prefect import Flow, flow, get_run_logger

from megalith.config import MegalithConfig
from megalith.errors import MegalithError
from pipelines import cluster_flows, flows

Target = Literal["local", "slurm", "k8s", "ray"]

# The flow that runs each target, by flow name: a target whose flow this installation
# lacks is refused when a run asks for it, not at import.
TARGET_FLOWS: dict[str, str] = {
    "local": "pretrain",  # torchrun on the machine (or pod) this run is on
    "slurm": "slurm-train",
    "k8s": "k8s-train",
    "ray": "ray-train",
}
FLOW_MODULES = (flows, cluster_flows)

# The job variables a megalith work pool turns into the run's environment.
NODES_ENV = "MEGALITH_NODES"
GPUS_PER_NODE_ENV = "MEGALITH_GPUS_PER_NODE"
IMAGE_ENV = "MEGALITH_IMAGE"

NO_OPTIONS: dict[str, Any] = {}
FORM_FIELDS = ("config", "run_dir", "nodes", "gpus_per_node")


@dataclass(frozen=True)
class ClusterSize:
    nodes: int
    gpus_per_node: int
    source: str  # where the numbers came from, for the run's log


def cluster_size(nodes: int | None, gpus_per_node: int | None) -> ClusterSize:
    """The form's numbers; an empty one from the work pool's job variable; else 1."""
    from_form = nodes is not None and gpus_per_node is not None
    size = ClusterSize(
        nodes if nodes is not None else _env_count(NODES_ENV, "nodes"),
        gpus_per_node if gpus_per_node is not None else _env_count(GPUS_PER_NODE_ENV, "gpus_per_node"),
        "the run form" if from_form else "the run form and the work pool's job variables",
    )  # fmt: skip
    if size.nodes < 1 or size.gpus_per_node < 1:
        raise MegalithError(
            f"nodes and gpus_per_node must be at least 1, got {size.nodes} and "
            f"{size.gpus_per_node} (from {size.source})"
        )
    return size


def _env_count(name: str, variable: str) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return 1
    try:
        return int(value)
    except ValueError:
        raise MegalithError(
            f"job variable {variable} ({name}={value!r}) is not a whole number"
        ) from None


def flow_named(name: str) -> Flow:
    """The megalith flow called ``name``."""
    for module in FLOW_MODULES:
        for value in vars(module).values():
            if isinstance(value, Flow) and value.name == name:
                return value
    raise MegalithError(f"this installation of megalith has no flow named {name!r}")


def target_arguments(
    target: str,
    config: MegalithConfig,
    run_dir: str,
    size: ClusterSize,
    options: dict[str, Any],
) -> tuple[Flow, dict[str, Any]]:
    """The target's flow and what to call it with: the form's values the flow takes (the
    run folder is ``output`` for ``pretrain``, the GPUs per node its ``nproc_per_node``),
    the pool's image, then ``options`` (the target's own parameters)."""
    target_flow = flow_named(TARGET_FLOWS[target])
    accepted = inspect.signature(target_flow.fn).parameters
    offered: dict[str, Any] = {
        "config": config, "run_dir": run_dir, "output": run_dir, "nodes": size.nodes,
        "gpus_per_node": size.gpus_per_node, "nproc_per_node": size.gpus_per_node,
    }  # fmt: skip
    if os.environ.get(IMAGE_ENV):
        offered["image"] = os.environ[IMAGE_ENV]
    if size.nodes > 1 and "nodes" not in accepted:
        raise MegalithError(
            f"target {target} ({target_flow.name}) runs on one machine: nodes must be 1, "
            f"got {size.nodes} (from {size.source}); choose slurm, k8s or ray for more"
        )
    own = sorted(set(accepted) - set(offered))
    if misplaced := sorted(set(options) - set(own)):
        raise MegalithError(
            f"options {misplaced} are not parameters of {target_flow.name} left to set "
            f"(the form sets {', '.join(FORM_FIELDS)}); it takes: {', '.join(own) or 'none'}"
        )
    arguments = {key: value for key, value in offered.items() if key in accepted} | options
    missing = [
        name
        for name, parameter in accepted.items()
        if name not in arguments and parameter.default is inspect.Parameter.empty
    ]
    if missing:
        raise MegalithError(
            f"target {target} ({target_flow.name}) needs {', '.join(missing)}: set them in "
            f"options, e.g. {{{', '.join(f'{name!r}: ...' for name in missing)}}}"
        )
    return target_flow, arguments


@flow(name="cluster-train", log_prints=True)
def cluster_train(
    config: MegalithConfig,
    run_dir: str,
    target: Target = "local",
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    options: dict[str, Any] = NO_OPTIONS,  # noqa: B006 - a read-only form default
) -> Any:
    """Pretrain on ``target`` at ``nodes`` x ``gpus_per_node`` (empty: the work pool's
    job variables ``nodes`` and ``gpus_per_node``, else 1). ``local`` starts
    ``gpus_per_node`` processes through torchrun where this run runs (one node);
    ``slurm``, ``k8s`` and ``ray`` submit to that cluster and follow the job. ``options``
    holds the target's own parameters, e.g. ``{"partition": "gpu"}`` for slurm,
    ``{"recipe": "/recipes/llama.yaml", "volume_claim": "runs"}`` for k8s. The run ends
    as the target's run ends (Completed, Failed or Cancelled)."""
    size = cluster_size(nodes, gpus_per_node)
    target_flow, arguments = target_arguments(target, config, run_dir, size, dict(options))
    logger = get_run_logger()
    logger.info(
        "target %s (%s flow): %d node(s) x %d GPU(s)/processes per node, from %s",
        target, target_flow.name, size.nodes, size.gpus_per_node, size.source,
    )  # fmt: skip
    if "config" not in arguments:
        logger.warning(
            "%s reads its recipe from options (%s); the config form is not used",
            target_flow.name, ", ".join(sorted(options)),
        )  # fmt: skip
    return target_flow(**arguments, return_state=True)
