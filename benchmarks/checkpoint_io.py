"""Checkpoint save and load throughput: ours (sync and async) against torch.distributed.checkpoint.

One process, one GPU, the ~1B recipe after one training step (so AdamW's moments
exist): the state saved is the model's fp32 parameters and both moments. Measured in
the same run, on the same disk:

- the disk's sequential write bandwidth (``--disk-gib`` of data written and fsynced);
- ``Trainer.save()`` in the foreground and in the background (``checkpoint.async_save``):
  the time the training loop is blocked, and the time until the checkpoint is committed;
- ``Trainer.resume()`` into a fresh trainer (verification of every sha256 included);
- ``torch.distributed.checkpoint``: ``save`` and ``async_save`` (blocked / committed)
  and ``load`` of the same model and optimizer state dicts.

Loads read through the page cache unless ``--drop-caches`` can write
``/proc/sys/vm/drop_caches`` (root); the report says which.

    python3 benchmarks/checkpoint_io.py --shape 1b --out results/ckpt
    python3 benchmarks/checkpoint_io.py --shape tiny --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "1b": {"training.micro_batch_size": 2},
    "tiny": {
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.num_query_groups": 2,
        "model.ffn_hidden_size": 128,
        "model.num_layers": 2,
        "model.vocab_size": 2048,
        "model.max_position_embeddings": 128,
        "data.seq_length": 128,
        "training.micro_batch_size": 2,
        "mixed_precision.dtype": "fp32",
    },
}


def disk_write_gbps(directory: Path, gib: float) -> float:
    """Sequential write bandwidth: ``gib`` GiB in 64 MiB blocks, fsynced."""
    block = os.urandom(64 * 2**20)
    blocks = max(1, int(gib * 16))
    path = directory / "disk-probe.bin"
    started = time.perf_counter()
    with path.open("wb") as handle:
        for _ in range(blocks):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return blocks * len(block) / seconds / 1e9


def drop_caches(enabled: bool) -> bool:
    if not enabled:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_trainer(args, shards: str, directory: Path, async_save: bool):
    from megalith.config import load_config
    from training.trainer import Trainer

    values = {
        "data.inputs": [],
        "data.output": shards,
        "training.train_iters": 10,
        "training.eval_interval": 0,
        "training.compile": False,
        "training.device": args.device,
        "logging.mlflow": False,
        "checkpoint.interval": 0,
        "checkpoint.directory": str(directory),
        "checkpoint.keep_last": 1,
        "checkpoint.async_save": async_save,
        **SHAPES[args.shape],
    }
    config = load_config(ROOT / "configs" / "llama-1b.yaml", values=values)
    config.training = config.training.model_copy(
        update={"global_batch_size": config.training.micro_batch_size}
    )
    return Trainer(config, Path(args.out) / "run")


def time_ours(args, shards: str, out: Path, async_save: bool, sync) -> dict:
    directory = out / ("ours-async" if async_save else "ours-sync")
    trainer = make_trainer(args, shards, directory, async_save)
    trainer.train_step(trainer.train_batches())
    sync()
    started = time.perf_counter()
    path = Path(trainer.save(background=async_save))
    blocked = time.perf_counter() - started
    trainer.wait_for_save()
    committed = time.perf_counter() - started
    size = directory_bytes(path)
    del trainer
    cold = drop_caches(args.drop_caches)
    fresh = make_trainer(args, shards, directory, async_save)
    sync()
    started = time.perf_counter()
    assert fresh.resume(), f"{directory}: no checkpoint to resume"
    sync()
    loaded = time.perf_counter() - started
    return _row(size, blocked, committed, loaded, cold)


def time_dcp(args, shards: str, out: Path, async_save: bool, sync) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = out / ("dcp-async" if async_save else "dcp-sync")
    trainer = make_trainer(args, shards, out / "unused", False)
    trainer.train_step(trainer.train_batches())
    model, optimizer = trainer.model, trainer.optimizer
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    sync()
    started = time.perf_counter()
    if async_save:
        future = dcp.async_save(state, checkpoint_id=str(directory))
        blocked = time.perf_counter() - started
        future.result()
    else:
        dcp.save(state, checkpoint_id=str(directory))
        blocked = time.perf_counter() - started
    committed = time.perf_counter() - started
    cold = drop_caches(args.drop_caches)
    sync()
    started = time.perf_counter()
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    sync()
    loaded = time.perf_counter() - started
    return _row(directory_bytes(directory), blocked, committed, loaded, cold)


def _row(size: int, blocked: float, committed: float, loaded: float, cold: bool) -> dict:
    return {
        "gb": size / 1e9,
        "blocked_s": blocked,
        "committed_s": committed,
        "save_gbps": size / committed / 1e9,
        "load_s": loaded,
        "load_gbps": size / loaded / 1e9,
        "load_cold": cold,
    }


def table(report: dict) -> str:
    lines = [
        f"{report['device']}, shape {report['shape']}; disk write {report['disk_gbps']:.2f} GB/s",
        "| method | GB | training blocked s | committed s | save GB/s | "
        "save / disk | load s | load GB/s | load from |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['gb']:.2f} | {r['blocked_s']:.2f} | {r['committed_s']:.2f} | "
            f"{r['save_gbps']:.2f} | {r['save_gbps'] / report['disk_gbps']:.0%} | "
            f"{r['load_s']:.2f} | {r['load_gbps']:.2f} | "
            f"{'disk' if r['load_cold'] else 'page cache'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--disk-gib", type=float, default=8.0)
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmark-out"))
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from benchmarks.train_throughput import prepare_shards

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = prepare_shards(out)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # torch.distributed.checkpoint's async save wants a process group: one rank.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    work = out / "checkpoints"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    report = {
        "date": str(date.today()),
        "shape": args.shape,
        "device": f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
        if cuda
        else f"CPU (torch {torch.__version__})",
        "disk_gbps": disk_write_gbps(work, args.disk_gib),
        "results": {},
    }
    runs = {
        "ours, sync": lambda: time_ours(args, shards, work, False, sync),
        "ours, async": lambda: time_ours(args, shards, work, True, sync),
        "torch DCP, sync": lambda: time_dcp(args, shards, work, False, sync),
        "torch DCP, async": lambda: time_dcp(args, shards, work, True, sync),
    }
    for name, run in runs.items():
        report["results"][name] = run()
        print(name, json.dumps(report["results"][name]), flush=True)
        (out / f"checkpoint-io-{args.shape}.json").write_text(json.dumps(report, indent=2))
    print(table(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
