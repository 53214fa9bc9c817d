"""kubectl for TrainJobs: ``apply -f -`` (the manifest on stdin, never a shell), the
job's state from its conditions (``get -o json``), ``delete``. Whatever cluster kubectl
is configured for (KUBECONFIG, its current context, or ``context``). No Prefect and no
torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from megalith.errors import MegalithError
from pipelines.external import Outcome, find_command, run_command

KUBECTL_BIN_ENV = "MEGALITH_KUBECTL_BIN"  # the folder that holds kubectl
# TrainJob condition types (Kubeflow Trainer v2) that end or pause a job, first match wins
CONDITIONS = (("Failed", Outcome.FAILED), ("Complete", Outcome.SUCCEEDED),
              ("Suspended", Outcome.WAITING))  # fmt: skip


@dataclass(frozen=True)
class TrainJobStatus:
    outcome: Outcome
    condition: str  # "Complete (JobCompleted: ...)"; its child jobs' counts while it runs

    def describe(self) -> str:
        return self.condition


def kubectl(context: str | None = None, namespace: str | None = None) -> list[str]:
    where = "install kubectl and point it at the cluster (KUBECONFIG)"
    command = [find_command("kubectl", KUBECTL_BIN_ENV, where)]
    if context:
        command += ["--context", context]
    if namespace:
        command += ["--namespace", namespace]
    return command


def apply(manifest: dict[str, Any], context: str | None = None) -> str:
    """Create or update the object; what kubectl names it (``trainjob.trainer.kubeflow.org/NAME``)."""
    command = [*kubectl(context), "apply", "-f", "-", "-o", "name"]
    done = run_command(command, stdin=yaml.safe_dump(manifest, sort_keys=False))
    if done.returncode:
        raise MegalithError(f"kubectl apply refused the {manifest['kind']}: {done.stderr.strip()}")
    return done.stdout.strip()


def trainjob_status(
    name: str, namespace: str | None = None, context: str | None = None
) -> TrainJobStatus:
    """From the TrainJob's true conditions: Failed, Complete or Suspended, else running."""
    done = run_command([*kubectl(context, namespace), "get", "trainjob", name, "-o", "json"])
    if done.returncode:
        raise MegalithError(f"kubectl get trainjob {name}: {done.stderr.strip()}")
    status = json.loads(done.stdout).get("status") or {}
    true = {c["type"]: c for c in status.get("conditions", []) if c.get("status") == "True"}
    for kind, outcome in CONDITIONS:
        if kind in true:
            why = ": ".join(filter(None, (true[kind].get("reason"), true[kind].get("message"))))
            return TrainJobStatus(outcome, f"{kind} ({why})" if why else kind)
    jobs = [f"{job['name']} jobs: {job.get('active', 0)} active, {job.get('ready', 0)} ready"
            for job in status.get("jobsStatus", [])]  # fmt: skip
    return TrainJobStatus(Outcome.RUNNING, "; ".join(jobs) or "submitted")


def delete(name: str, namespace: str | None = None, context: str | None = None) -> str:
    """``kubectl delete trainjob NAME``: its pods are stopped (SIGTERM, then SIGKILL)."""
    command = [*kubectl(context, namespace), "delete", "trainjob", name, "--wait=false"]
    done = run_command(command)
    return (done.stderr or done.stdout).strip()
