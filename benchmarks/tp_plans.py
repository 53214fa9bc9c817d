"""Our Megatron-style tensor-parallel linears against torch's DTensor tensor-parallel plans.

Issue 17 asks to prefer torch's own plans (``parallelize_module`` with ``ColwiseParallel``
/ ``RowwiseParallel``) where they reach the same numerics and speed. This measures both on
the layer pair every transformer block runs twice, a SwiGLU MLP (gate and up
column-parallel, down row-parallel), with and without sequence parallelism, against the
same MLP in one process: the output's and every gradient's largest difference, and the
forward+backward time per step.

    python benchmarks/tp_plans.py --tp 2 --device cpu --out results/    # gloo on CPU
    python benchmarks/tp_plans.py --tp 2 --device cuda --out $OUT       # NCCL, one GPU a rank

Each variant runs in the same processes one after the other; results go to
OUT/tp_plans.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from training.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from training.parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


class MLP(nn.Module):
    """The single-process reference, laid out as torchtitan's (gate and up apart)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w_gate = nn.Linear(hidden, ffn, bias=False)
        self.w_up = nn.Linear(hidden, ffn, bias=False)
        self.w_down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class OursMLP(nn.Module):
    """The same MLP on our layers: one column-parallel ``[gate; up]`` and a row-parallel down."""

    def __init__(self, reference: MLP, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        hidden, ffn = reference.w_gate.in_features, reference.w_gate.out_features
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.fc1 = ColumnParallelLinear(
            hidden, 2 * ffn, group=group, bias=False, init_std=0.02, output_chunks=2,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        self.fc2 = RowParallelLinear(
            ffn, hidden, group=group, bias=False, init_std=0.02,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        with torch.no_grad():
            gate = reference.w_gate.weight.chunk(tp)[rank]
            up = reference.w_up.weight.chunk(tp)[rank]
            self.fc1.weight.copy_(torch.cat([gate, up]))
            self.fc2.weight.copy_(reference.w_down.weight.chunk(tp, dim=1)[rank])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


def dtensor_mlp(reference: MLP, mesh, sequence_parallel: bool) -> nn.Module:
    """A copy of ``reference`` sharded by torch's plans (torchtitan's MLP plan)."""
    model = MLP(reference.w_gate.in_features, reference.w_gate.out_features).to(
        reference.w_gate.weight.device
    )
    model.load_state_dict(reference.state_dict())
    plan: dict[str, object] = {
        "w_gate": ColwiseParallel(),
        "w_up": ColwiseParallel(),
        "w_down": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if sequence_parallel:  # gather the sequence once for both column-parallel linears
        plan[""] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return parallelize_module(model, mesh, plan)


def _time_step(model: nn.Module, x: Tensor, steps: int, device: torch.device) -> float:
    for _ in range(3):
        model(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        model(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def worker(rank: int, tp: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp)
    mesh = init_device_mesh(device.type, (tp,))
    group = mesh.get_group()
    torch.manual_seed(0)
    reference = MLP(args.hidden, args.ffn).to(device)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device)
    reference(x).sum().backward()
    expected_out = reference(x).detach()
    rows = []
    for sp in (False, True):
        ours = OursMLP(reference, group, sp).to(device)
        theirs = dtensor_mlp(reference, mesh, sp)
        local_x = scatter_to_sequence_parallel_region(x, group) if sp else x
        for name, model in (("ours", ours), ("dtensor", theirs)):
            xin = local_x.detach().requires_grad_()
            out = model(xin)
            out.sum().backward()
            full = gather_from_sequence_parallel_region(out, group) if sp else out
            if hasattr(full, "full_tensor"):
                full = full.full_tensor()
            down = ours.fc2.weight.grad if name == "ours" else theirs.w_down.weight.grad
            down = down.to_local() if hasattr(down, "to_local") else down
            expected_down = reference.w_down.weight.grad.chunk(tp, dim=1)[rank]
            for p in model.parameters():
                p.grad = None
            rows.append(
                {
                    "variant": name,
                    "sequence_parallel": sp,
                    "max_abs_out": (full - expected_out).abs().max().item(),
                    "max_abs_grad_down": (down - expected_down).abs().max().item(),
                    "step_ms": 1e3 * _time_step(model, local_x, args.steps, device),
                }
            )
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "tp": tp,
                "torch": torch.__version__, **{k: getattr(args, k) for k in ("hidden", "ffn", "batch", "seq", "steps")}}  # fmt: skip
        (args.out / "tp_plans.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(json.dumps(meta))
        print("| variant | SP | max |Δ out| | max |Δ grad w_down| | fwd+bwd ms |")
        for r in rows:
            print(
                f"| {r['variant']} | {r['sequence_parallel']} | {r['max_abs_out']:.2e} "
                f"| {r['max_abs_grad_down']:.2e} | {r['step_ms']:.2f} |"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    mp.spawn(worker, args=(args.tp, args), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
