"""Submitting a manifest to Kubernetes with ``kubectl apply -f -`` (the manifest on stdin,
never a shell): whatever cluster kubectl is configured for (KUBECONFIG, its current
context, or ``context``). No Prefect and no torch here."""

from __future__ import annotations

from typing import Any

import yaml

from megalith.errors import MegalithError
from pipelines.external import find_command, run_command

KUBECTL_BIN_ENV = "MEGALITH_KUBECTL_BIN"  # the folder that holds kubectl


def apply(manifest: dict[str, Any], context: str | None = None) -> str:
    """Create or update the object; what kubectl names it (``trainjob.trainer.kubeflow.org/NAME``)."""
    where = "install kubectl and point it at the cluster (KUBECONFIG)"
    command = [find_command("kubectl", KUBECTL_BIN_ENV, where)]
    if context:
        command += ["--context", context]
    command += ["apply", "-f", "-", "-o", "name"]
    done = run_command(command, stdin=yaml.safe_dump(manifest, sort_keys=False))
    if done.returncode:
        raise MegalithError(f"kubectl apply refused the {manifest['kind']}: {done.stderr.strip()}")
    return done.stdout.strip()
