"""``megalith train``: pretrain a GPT from a recipe."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import yaml

from megalith.config import MegalithConfig, load_config
from megalith.errors import MegalithError
from megalith.storage import atomic_write_json
from training.mlflow_store.runs import lineage_tags
from training.parallel.groups import validate_layout
from training.parallel.support import check_trainer_support
from training.runtime.launch import (
    DEFAULT_RDZV_PORT,
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    LaunchSpec,
    comm_overlap_env,
    die_with_parent,
    run_torchrun,
    slurm_script,
    torchrun_command,
    under_torchrun,
    unwinding_on_sigterm,
)
from training.runtime.run_lock import hold_run_folder
from training.runtime.trainjob import MOUNT, TORCH_RUNTIME, train_job


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    train = subcommands.add_parser(
        "train",
        help="pretrain a GPT from a recipe (configs/*.yaml)",
        description="Train a GPT on prepared shards. Writes OUTPUT/metrics.jsonl (one JSON "
        "object per optimizer step), OUTPUT/checkpoints/step-*/ (safetensors + JSON) and "
        "OUTPUT/model/ (the final model package); tracks the run in MLflow unless "
        "logging.mlflow=false. With --nproc-per-node it relaunches itself through torchrun: "
        "data parallelism fills the world (nproc-per-node x nnodes) after parallel.tensor, "
        "parallel.context and parallel.pipeline; rank 0 alone writes files and talks to MLflow. "
        f"{TIMEOUT_ENV} (seconds, default {DEFAULT_TIMEOUT_S:.0f}) bounds every collective, so a "
        "dead rank fails the job instead of hanging it.",
        epilog="examples:\n"
        "  megalith train --config configs/tiny-cpu.yaml --set training.train_iters=50\n"
        "  megalith train --config X --nproc-per-node 8 --set parallel.data_parallel_mode="
        "distributed_optimizer\n"
        "  megalith train --config X --nproc-per-node 8 --nnodes 2 --node-rank 0 "
        "--rdzv-endpoint node0:29500   (and --node-rank 1 on the second node)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", required=True, metavar="YAML", help="recipe")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    train.add_argument("--output", metavar="DIR", help="run directory (default runs/NAME)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    train.add_argument("--quiet", action="store_true", help="log lines instead of a progress bar")
    launch = train.add_argument_group("multi-process launch (torchrun)")
    launch.add_argument(
        "--nproc-per-node", type=int, metavar="N", help="worker processes (GPUs) on this node"
    )
    launch.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes in the job")
    launch.add_argument(
        "--node-rank",
        type=int,
        metavar="R",
        help="this node's rank: its workers are ranks R*N to R*N+N-1 (node 0 hosts the "
        "rendezvous and rank 0); without it the nodes meet through c10d in any order",
    )
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the rendezvous, on node 0")
    launch.add_argument("--rdzv-id", default="megalith", metavar="ID", help="job id for rendezvous")
    launch.add_argument(
        "--local-addr",
        metavar="ADDR",
        help="this node's address for the workers' store (default: its hostname)",
    )
    train.set_defaults(handler=_train)
    _register_launch(subcommands)


def _register_launch(subcommands: argparse._SubParsersAction) -> None:
    group = subcommands.add_parser(
        "launch",
        help="run on many nodes: Slurm and Kubernetes job files, a Ray cluster (slurm, k8s, ray)",
        description="Run megalith train on many nodes: write a job for a cluster's scheduler, "
        "an sbatch script (slurm) or a Kubeflow Trainer TrainJob (k8s), or run it on a Ray "
        "cluster and follow it to its end (ray). The Prefect flows slurm-train, k8s-train and "
        "ray-train do the same from the Prefect UI (docs/multi-node.md).",
        epilog="examples:\n"
        "  megalith launch slurm --config configs/llama-1b.yaml --nodes 4 --gpus-per-node 8 "
        "--output train.sbatch\n"
        "  megalith launch k8s --config configs/llama-1b.yaml --nodes 4 --gpus-per-node 8 "
        "--image REGISTRY/megalith:TAG --volume-claim megalith-runs --output trainjob.yaml\n"
        "  megalith launch ray --address HEAD:6379 --config configs/llama-1b.yaml --nodes 4 "
        "--gpus-per-node 8 --run-dir /shared/runs/llama-1b",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group.set_defaults(group_parser=group)
    commands = group.add_subparsers(dest="launch_command", metavar="COMMAND")
    slurm = commands.add_parser(
        "slurm",
        help="write an sbatch script for a multi-node training job",
        description="Write an sbatch script for a multi-node job: srun starts one "
        "`megalith train` per node (--ntasks-per-node=1), which starts --gpus-per-node "
        "workers through torchrun; all nodes meet in a c10d rendezvous on the first node of "
        "the allocation (HOST:PORT from scontrol). --max-restarts is 0 and srun runs with "
        "--kill-on-bad-exit, so one failed rank ends the whole job; resubmit to resume (the "
        "script passes --resume). The output directory must be on a filesystem every node "
        "shares (checkpoints are written by rank 0 and read by every rank on resume).",
        epilog="example: megalith launch slurm --config configs/llama-1b.yaml --nodes 4 "
        "--gpus-per-node 8 --output train.sbatch && sbatch train.sbatch",
    )
    slurm.add_argument("--config", required=True, metavar="YAML", help="recipe")
    slurm.add_argument("--nodes", type=int, required=True, metavar="M")
    slurm.add_argument("--gpus-per-node", type=int, required=True, metavar="N")
    slurm.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    slurm.add_argument("--run-dir", metavar="DIR", help="the training run's output directory")
    slurm.add_argument("--job-name", default="megalith")
    slurm.add_argument("--partition", metavar="NAME")
    slurm.add_argument("--time", metavar="HH:MM:SS", help="wall-clock limit")
    slurm.add_argument("--port", type=int, default=DEFAULT_RDZV_PORT, help="rendezvous port")
    slurm.add_argument("--output", metavar="FILE", help="write the script here (default: stdout)")
    slurm.set_defaults(handler=_launch_slurm)
    _register_k8s(commands)
    _register_ray(commands)


def _register_k8s(commands: argparse._SubParsersAction) -> None:
    k8s = commands.add_parser(
        "k8s",
        help="write a Kubeflow Trainer TrainJob for a multi-node training job",
        description="Write a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) as "
        f"YAML: --nodes pods from the {TORCH_RUNTIME} ClusterTrainingRuntime, each running "
        "`megalith train` with --gpus-per-node workers through torchrun, meeting at the first "
        "pod (PET_MASTER_ADDR). Checkpoints need storage that outlives the pods: "
        f"--volume-claim (mounted at {MOUNT}; the run folder is {MOUNT}/runs/NAME) or "
        "--checkpoint-dir s3://... . --config is the recipe's path inside the pod (the image "
        "or the claim); it is also read here to check the layout. Apply with kubectl apply -f.",
        epilog="example: megalith launch k8s --config configs/llama-1b.yaml --nodes 4 "
        "--gpus-per-node 8 --image REGISTRY/megalith:TAG --volume-claim megalith-runs "
        "--output trainjob.yaml && kubectl apply -f trainjob.yaml",
    )
    k8s.add_argument("--config", required=True, metavar="YAML", help="recipe")
    k8s.add_argument("--nodes", type=int, required=True, metavar="M")
    k8s.add_argument("--gpus-per-node", type=int, required=True, metavar="N")
    k8s.add_argument("--image", required=True, help="container image with megalith installed")
    k8s.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    k8s.add_argument("--volume-claim", metavar="PVC", help="shared PersistentVolumeClaim")
    k8s.add_argument("--checkpoint-dir", metavar="s3://...", help="checkpoints in object storage")
    k8s.add_argument("--memory", default="64Gi", help="memory per node (default 64Gi)")
    k8s.add_argument("--cpus", type=int, metavar="N", help="CPUs per node")
    k8s.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="trainer environment"
    )
    k8s.add_argument("--name", help="TrainJob name (default: the recipe's name)")
    k8s.add_argument("--namespace", metavar="NS")
    k8s.add_argument("--runtime", default=TORCH_RUNTIME, help="ClusterTrainingRuntime name")
    k8s.add_argument("--output", metavar="FILE", help="write the YAML here (default: stdout)")
    k8s.set_defaults(handler=_launch_k8s)


def _register_ray(commands: argparse._SubParsersAction) -> None:
    ray = commands.add_parser(
        "ray",
        help="train on a Ray cluster, one torchrun launcher per node",
        description="Train on --nodes nodes of a Ray cluster and follow the run here. Ray "
        "places one bundle per node (a STRICT_SPREAD placement group: --gpus-per-node GPUs, "
        "--cpus-per-node CPUs) and starts `megalith train` on each, which starts "
        "--gpus-per-node workers through torchrun; all nodes meet at a rendezvous hosted by "
        "node 0, whose workers are ranks 0 to N-1. Every node's output is printed here, prefixed [node R]. If a node fails "
        "or is lost (its raylet or machine gone), the others are stopped and the command "
        "fails naming it; Ctrl-C stops every node. Run the same command again to resume from "
        "the last checkpoint (it passes --resume). --run-dir and --config must be paths every "
        "node sees (a shared filesystem); megalith and Ray must be installed on every node "
        "(pip install 'megalith[ray]'). With training.device=cpu no GPUs are asked for and "
        "--gpus-per-node is the number of CPU processes per node.",
        epilog="example: megalith launch ray --address HEAD:6379 --config configs/llama-1b.yaml "
        "--nodes 4 --gpus-per-node 8 --run-dir /shared/runs/llama-1b   (or RAY_ADDRESS=HEAD:6379)",
    )
    ray.add_argument("--config", required=True, metavar="YAML", help="recipe")
    ray.add_argument("--nodes", type=int, required=True, metavar="M")
    ray.add_argument("--gpus-per-node", type=int, required=True, metavar="N")
    ray.add_argument("--run-dir", required=True, metavar="DIR", help="the run's output folder")
    ray.add_argument(
        "--address", metavar="HOST:PORT", help="the Ray cluster (default: $RAY_ADDRESS)"
    )
    ray.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    ray.add_argument(
        "--cpus-per-node", type=float, default=8, metavar="N", help="CPUs each node reserves"
    )
    ray.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="launcher environment"
    )
    ray.add_argument(
        "--placement-timeout", type=float, default=600, metavar="S",
        help="how long to wait for the nodes (default 600 s)",
    )  # fmt: skip
    ray.set_defaults(handler=_launch_ray)


def _launch_ray(args: argparse.Namespace) -> int:
    from training.runtime import ray_launch  # imports Ray (an optional extra) when it runs

    config = load_config(args.config, args.set)
    run_dir = str(Path(args.run_dir).resolve())
    spec = ray_launch.job_spec(
        config, str(Path(args.config).resolve()), run_dir, args.nodes, args.gpus_per_node,
        sets=args.set, cpus_per_node=args.cpus_per_node, env=_key_values(args.env, "--env"),
        placement_timeout_s=args.placement_timeout,
    )  # fmt: skip
    with unwinding_on_sigterm():  # SIGTERM stops the nodes, as Ctrl-C does
        ray_launch.run_job(spec, args.address, lambda line: print(line, flush=True))
    print(f"trained on {args.nodes} Ray nodes; the run: {run_dir}")
    return 0


def _launch_k8s(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    validate_layout(config, args.nodes * args.gpus_per_node)
    manifest = train_job(
        args.config, args.nodes, args.gpus_per_node, args.image,
        name=args.name or config.name, sets=args.set, volume_claim=args.volume_claim,
        checkpoint_dir=args.checkpoint_dir, memory=args.memory, cpus=args.cpus,
        env=_key_values(args.env, "--env"), namespace=args.namespace, runtime=args.runtime,
    )  # fmt: skip
    text = yaml.safe_dump(manifest, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: kubectl apply -f {args.output}")
    else:
        print(text, end="")
    return 0


def _key_values(pairs: list[str], flag: str) -> dict[str, str]:
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MegalithError(f"{flag} {pair!r}: expected KEY=VALUE")
        values[key] = value
    return values


def _launch_slurm(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    validate_layout(config, args.nodes * args.gpus_per_node)
    script = slurm_script(
        str(Path(args.config).resolve()),
        args.nodes,
        args.gpus_per_node,
        sets=args.set,
        output=args.run_dir,
        job_name=args.job_name,
        partition=args.partition,
        time_limit=args.time,
        port=args.port,
    )
    if args.output:
        Path(args.output).write_text(script)
        print(f"wrote {args.output}: sbatch {args.output}")
    else:
        print(script, end="")
    return 0


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The train command each torchrun worker runs: this one without the launch options."""
    command = ["pipelines.cli", "train", "--config", args.config]
    for setting in args.set:
        command += ["--set", setting]
    if args.output:
        command += ["--output", args.output]
    command += ["--resume"] * args.resume + ["--quiet"] * args.quiet
    return command


def _launch(args: argparse.Namespace, config: MegalithConfig) -> int:
    spec = LaunchSpec(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        local_addr=args.local_addr,
    )
    spec.check()
    # Fail before any process starts.
    check_trainer_support(config, validate_layout(config, spec.nproc_per_node * spec.nnodes))
    _check_training_data(config)
    # One node's launcher holds the run folder for its workers; several nodes' rank 0 does.
    holder = hold_run_folder(_output(args, config)) if spec.nnodes == 1 else nullcontext()
    with holder as lock:
        held = lock.child_env() if lock else {}
        returncode = run_torchrun(torchrun_command(spec, _worker_args(args)), held)
    if returncode:
        why = "was stopped by a signal" if returncode > 128 else "failed on at least one rank"
        print(f"error: training {why} (torchrun exit code {returncode})", file=sys.stderr)
    return returncode


def _check_training_data(config: MegalithConfig) -> None:
    """Missing training data named in one line before torchrun starts any worker (the
    workers would find it only after starting, and rank 0's failure then waits for its
    peers to be stopped)."""
    sources = [source.record_file for source in config.data.training_sources()]
    lineage_tags(sources, storage_options=config.data.storage_options)


def _output(args: argparse.Namespace, config: MegalithConfig) -> Path:
    return Path(args.output or Path("runs") / config.name)


def _train(args: argparse.Namespace) -> int:
    die_with_parent()  # a launcher's worker, or a flow's training process, dies with it
    with unwinding_on_sigterm():
        return _train_or_launch(args)


def _train_or_launch(args: argparse.Namespace) -> int:
    values = {"checkpoint.resume": True} if args.resume else {}
    config = load_config(args.config, args.set, values)
    if args.nproc_per_node is not None and not under_torchrun():
        return _launch(args, config)
    # Only now the heavy imports (torch, ~seconds): a bad config fails at once.
    from training.mlflow_store.runs import open_run_logger
    from training.models.backend import resolve_backend
    from training.runtime.distributed import distributed
    from training.trainer import train

    resolve_backend(config.model.backend)  # kernels this machine lacks: before any run exists
    output = _output(args, config)
    os.environ.update(comm_overlap_env(config))  # before CUDA starts
    with distributed(config.training.device) as (env, _device):
        tags = {}
        if env.is_main:  # reads the data's manifests: missing data fails before any output
            sources = [source.record_file for source in config.data.training_sources()]
            tags = lineage_tags(sources, storage_options=config.data.storage_options)
        with hold_run_folder(output, env.rank):
            run_logger = open_run_logger(
                config.logging,
                run_name=config.logging.run_name or config.name,
                rank=env.rank,
                workdir=Path.cwd(),
                tags=tags,
                run_folder=output,
            )
            if args.quiet or not env.is_main:
                level = logging.INFO if env.is_main else logging.WARNING
                logging.basicConfig(
                    level=level, format="%(message)s", stream=sys.stdout, force=True
                )
            status = "FAILED"
            try:
                result = train(config, output, run_logger, show_progress=not args.quiet)
                if hasattr(run_logger, "log_loss_curve"):
                    run_logger.log_loss_curve(output / "metrics.jsonl")
                status = "FINISHED"
            finally:
                run_logger.close(status)
    if not env.is_main:
        return 0
    run_id = getattr(run_logger, "run_id", None)
    if run_id:
        summary = json.loads((output / "result.json").read_text())
        atomic_write_json(str(output / "result.json"), {**summary, "mlflow_run_id": run_id})
    print(f"trained {result.steps} steps: loss {result.final_loss:.4f}", end="")
    print(f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else "")
    print(f"  {result.tokens_per_s:,.0f} tokens/s; metrics in {output / 'metrics.jsonl'}")
    print(f"  checkpoint {result.checkpoint}; model package {result.model_package}")
    return 0
