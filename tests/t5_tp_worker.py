"""A torchrun worker for tests/test_t5_model.py (not a test module itself).

Every rank builds the single-process T5 model and, from the same weights, its
tensor-parallel shard for each layout (TP, TP+SP, TP+SP with selective checkpointing),
then writes what diverged to OUT/rank{R}.json: logits, mean and per-token losses,
each parameter's gradient (split ones against the same slice of the whole gradient),
the split parameters against the sharding rules, and the TP state dicts gathered back.

    torchrun --nproc-per-node 2 tests/t5_tp_worker.py SPEC.json
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from parallel_helpers import mismatch

from megalith.config import ModelConfig
from training.models import T5Model, TorchBackend
from training.models.tp_backend import TensorParallelBackend
from training.parallel.tensor_parallel import (
    gather_tp_state_dict,
    partition_spec,
    shard_full_state_dict,
    tensor_parallel_partition,
)
from training.parallel.tensor_parallel.sharding import shard_tensor
from training.runtime.distributed import distributed


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    encoder_tokens = torch.randint(1, vocab, (2, 8), generator=generator)
    decoder_tokens = torch.randint(1, vocab, (2, 6), generator=generator)
    labels = torch.randint(1, vocab, (2, 6), generator=generator)
    labels[1, 4:] = -100
    encoder_mask = torch.ones(2, 8, dtype=torch.bool)
    encoder_mask[1, 5:] = False
    return {
        "encoder_tokens": encoder_tokens,
        "decoder_tokens": decoder_tokens,
        "labels": labels,
        "encoder_mask": encoder_mask,
    }


def check_layout(spec: dict, layout: dict, group: dist.ProcessGroup) -> list[str]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = f"{layout['id']} rank {rank}"
    config = ModelConfig(**spec["config"], **layout["config"])
    tol, grad_tol = spec["tol"], spec["grad_tol"]
    torch.manual_seed(0)
    full = T5Model(config, TorchBackend())
    tp = T5Model(config, TensorParallelBackend(group, layout["sequence_parallel"]))
    tp.load_state_dict(shard_full_state_dict(full.state_dict(), config, rank, world))
    problems: list[str] = []

    split = tensor_parallel_partition(tp)
    by_name = {n: s for n, _ in tp.named_parameters() if (s := partition_spec(n, config))}
    if split != by_name:
        problems.append(f"{where}: split parameters {split} differ from partition_spec {by_name}")

    batch = _batch(config.vocab_size)
    inputs = (batch["encoder_tokens"], batch["decoder_tokens"])
    mask = {"encoder_mask": batch["encoder_mask"]}
    with torch.no_grad():
        problems += mismatch(f"{where}: logits", tp(*inputs, **mask), full(*inputs, **mask), tol)
        none = {"loss_reduction": "none", **mask}
        got, expected = tp(*inputs, batch["labels"], **none), full(*inputs, batch["labels"], **none)
        problems += mismatch(f"{where}: per-token losses", got, expected, tol)

    expected = full(*inputs, batch["labels"], **mask)
    got = tp(*inputs, batch["labels"], **mask)
    problems += mismatch(f"{where}: loss", got, expected, tol)
    expected.backward()
    got.backward()
    whole = dict(full.named_parameters())
    for name, param in tp.named_parameters():
        want = whole[name].grad
        if name in split:
            want = shard_tensor(want, *split[name], rank, world)
        problems += mismatch(f"{where}: gradient of {name}", param.grad, want, grad_tol)

    shards: list[dict] = [None] * world
    dist.all_gather_object(shards, {k: v.detach() for k, v in tp.state_dict().items()}, group)
    gathered = gather_tp_state_dict(shards, config)
    for name, tensor in full.state_dict().items():
        problems += mismatch(
            f"{where}: gathered {name}", gathered[name], tensor, {"rtol": 0, "atol": 0}
        )
    return problems


def check_trainer_helpers(spec: dict, group: dist.ProcessGroup) -> list[str]:
    """tensor_parallel_training.build_model shards a T5 built from the seed as one
    device does, and full_model gathers the whole single-process T5 back on rank 0."""
    from megalith.config import MegalithConfig
    from training.parallel import tensor_parallel_training as tpt
    from training.parallel.groups import build_parallel_state

    config = MegalithConfig(model=spec["config"], parallel={"tensor": 2, "sequence_parallel": True})
    state = build_parallel_state(config)
    torch.manual_seed(0)
    expected = T5Model(config.model, TorchBackend())
    torch.manual_seed(0)
    model = tpt.build_model(config.model, state, True, torch.device("cpu"))
    problems = []
    batch = _batch(config.model.vocab_size)
    with torch.no_grad():
        args = (batch["encoder_tokens"], batch["decoder_tokens"], batch["labels"])
        got, want = model(*args), expected(*args)
    problems += mismatch("trainer build_model: loss", got, want, spec["tol"])
    is_main = dist.get_rank() == 0
    with tpt.full_model(model, state, is_main) as whole:
        if is_main:
            if not isinstance(whole, T5Model):
                return [f"full_model gave a {type(whole).__name__}, not a T5Model"]
            for name, tensor in expected.state_dict().items():
                exact = {"rtol": 0, "atol": 0}
                problems += mismatch(f"full_model: {name}", whole.state_dict()[name], tensor, exact)
    return problems


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with distributed("cpu"):
        group = dist.group.WORLD
        results = {}
        for layout in spec["layouts"]:
            try:
                results[layout["id"]] = check_layout(spec, layout, group)
            except Exception:  # recorded for the test that reads this layout
                results[layout["id"]] = [traceback.format_exc()]
        try:
            results["trainer helpers"] = check_trainer_helpers(spec, group)
        except Exception:
            results["trainer helpers"] = [traceback.format_exc()]
        Path(spec["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
