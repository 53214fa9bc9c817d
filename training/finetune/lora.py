"""LoRA adapters on the model's linear layers, plain or tensor-parallel.

An adapter adds ``scale · B A dropout(x)`` (``scale = alpha / rank``, ``A [r, in]``,
``B [out, r]``) to its base layer's output. It is a child module ``lora`` of the base
linear, added by a forward hook, so every base parameter keeps its name
(``layers.0.attention.proj.weight``) and the adapter's are beside it
(``layers.0.attention.proj.lora.a`` / ``.lora.b``): checkpoints, resharding and the
base-weight loaders see one more pair of tensors per target, nothing renamed.

Tensor parallelism follows Megatron/NeMo:

- column-parallel base (``qkv``, ``fc1``; output split): ``A`` replicated, ``B`` split
  on its output dim like the base weight (per chunk for SwiGLU's ``[gate; up]``). The
  input enters like the base's (identity forward, gradient all-reduced; all-gathered
  along the sequence under SP) and ``A``'s gradient, partial on each rank, is
  all-reduced over the TP group.
- row-parallel base (``proj``, ``fc2``; input split): ``A`` split on its input dim,
  its partial product ``A_r x_r`` reduced as the base reduces (all-reduce, or
  reduce-scatter along the sequence under SP), ``B`` replicated (its gradient
  all-reduced under SP, where each rank sees only its tokens).

Under FSDP (no TP) the adapters are added on the meta device with the model
(:func:`add_adapters`), sharded by rows in their block's FSDP unit beside the frozen
base, and each rank fills its rows from the seeded whole ``A`` (:func:`initialize_shards`);
the package's merge folds the gathered adapters into the gathered whole model
(:func:`merge_into`).

Merging is local to each shard (``W_r += scale · B_r A`` for a column base,
``W_r += scale · B A_r`` for a row one), so a merged TP model gathers into exactly
the merged single-device model.

Initialisation: ``B = 0`` (the model starts as the base) and ``A`` Kaiming-uniform as
in PEFT, drawn whole from a generator seeded by the seed and the module's name, then
sliced: the same ``A`` at every TP size, and the global RNG is not touched.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from megalith.config import ConfigError, LoRAConfig
from training.models.layers import NormLinear
from training.parallel.dtensor import local_tensor
from training.parallel.groups import ParallelState
from training.parallel.shard_specs import assemble, model_specs
from training.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from training.parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

ADAPTER_MARK = ".lora."
LINEAR_TYPES = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``....lora.a`` / ``....lora.b``)."""
    return ADAPTER_MARK in name


class LoRAAdapter(nn.Module):
    """``scale · B A dropout(x)`` for one base linear; see the module docstring for TP."""

    def __init__(
        self,
        base: nn.Module,
        rank: int,
        alpha: float,
        dropout: float,
    ):
        super().__init__()
        self.kind = _kind(base)
        self.group = getattr(base, "group", None)
        self.sequence_parallel = getattr(base, "sequence_parallel", False)
        self.chunks = getattr(base, "output_chunks", 1)
        out_local, in_local = base.weight.shape
        self.rank, self.scale = rank, alpha / rank
        self.a = nn.Parameter(torch.empty(rank, in_local, device=base.weight.device))
        self.b = nn.Parameter(torch.zeros(out_local, rank, device=base.weight.device))
        self.dropout = nn.Dropout(dropout)
        self.merged = False  # the update is in the base weight: add nothing

    @property
    def tp_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def full_shape_a(self) -> tuple[int, int]:
        """``A``'s shape in the single-device model."""
        factor = self.tp_size if self.kind == "row" else 1
        return self.a.size(0), self.a.size(1) * factor

    def whole_a(self, seed: int, name: str) -> Tensor:
        """The single-device ``A`` of the adapter on module ``name``, drawn from a
        generator seeded by (seed, name): Kaiming-uniform as PEFT."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        whole = torch.empty(self.full_shape_a())
        bound = 1.0 / math.sqrt(whole.size(1))  # kaiming_uniform_(a=sqrt(5)), as PEFT
        return whole.uniform_(-bound, bound, generator=generator)

    def initialize(self, seed: int, name: str) -> None:
        """``B = 0``; ``A`` drawn whole from (seed, name), then this rank's slice. (Not
        ``reset_parameters``: ``GPTModel.init_weights`` must not redraw adapters.)"""
        whole = self.whole_a(seed, name)
        if self.kind == "row" and self.tp_size > 1:
            whole = whole.chunk(self.tp_size, dim=1)[dist.get_rank(self.group)]
        with torch.no_grad():
            self.a.copy_(whole)
            self.b.zero_()

    def tensor_parallel_parameters(self) -> list[tuple[nn.Parameter, int, int]]:
        """``(parameter, split dim, output chunks)`` of the split ones (for checkpoints,
        grad norms): column base: ``B`` on dim 0; row base: ``A`` on dim 1."""
        if self.kind == "column":
            return [(self.b, 0, self.chunks)]
        if self.kind == "row":
            return [(self.a, 1, 1)]
        return []

    def delta(self) -> Tensor:
        """This rank's ``scale · B A``, the shape of its base weight shard."""
        return self.scale * (self.b @ self.a)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "column":
            return self._column(x)
        if self.kind == "row":
            return self._row(x)
        return self.scale * F.linear(F.linear(self.dropout(x), self.a), self.b)

    def _column(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        a = copy_to_tensor_parallel_region(self.a, self.group)
        return self.scale * F.linear(F.linear(self.dropout(x), a), self.b)

    def _row(self, x: Tensor) -> Tensor:
        h = F.linear(self.dropout(x), self.a)
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, self.group)
            b = copy_to_tensor_parallel_region(self.b, self.group)
        else:
            h = reduce_from_tensor_parallel_region(h, self.group)
            b = self.b
        return self.scale * F.linear(h, b)


def _kind(base: nn.Module) -> str:
    if isinstance(base, ColumnParallelLinear):
        return "column"
    if isinstance(base, RowParallelLinear):
        return "row"
    return "plain"


def _add_update(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    adapter = module.lora
    return output if adapter.merged else output + adapter(args[0]).to(output.dtype)


def target_linears(model: nn.Module, targets: list[str]) -> dict[str, nn.Module]:
    """``{module name: linear}`` of every module named one of ``targets`` (the last part
    of its dotted name); a fused norm+linear gives its ``.linear``. Raises naming the
    targets that match nothing and the names that would."""
    found: dict[str, nn.Module] = {}
    matched: set[str] = set()
    available: set[str] = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        linear = module.linear if isinstance(module, NormLinear) else module
        if not isinstance(linear, LINEAR_TYPES) or name.endswith(".linear"):
            continue
        available.add(leaf)
        if leaf in targets:
            matched.add(leaf)
            found[f"{name}.linear" if linear is not module else name] = linear
    missing = [t for t in targets if t not in matched]
    if missing:
        raise ConfigError(
            f"finetune.lora.target_modules: {missing} match no linear layer of this model; "
            f"expected names among {sorted(available)}"
        )
    return found


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int) -> dict[str, LoRAAdapter]:
    """Add an adapter to every target linear, initialized, and freeze every other parameter.

    Returns ``{base module name: adapter}``. Call before wrapping the model in DDP and
    building the optimizer, so that both see only the adapters as trainable."""
    adapters = add_adapters(model, config)
    for name, adapter in adapters.items():
        adapter.initialize(seed, name)
    return adapters


def add_adapters(model: nn.Module, config: LoRAConfig) -> dict[str, LoRAAdapter]:
    """:func:`apply_lora` without initializing the adapters (on a meta model, whose
    shards :func:`initialize_shards` fills once sharded)."""
    targets = target_linears(model, config.target_modules)
    taken = [
        name
        for name, linear in targets.items()
        if isinstance(getattr(linear, "lora", None), LoRAAdapter)
    ]
    if taken:
        raise ConfigError(f"{taken[:3]} already have LoRA adapters; apply_lora once per model")
    for param in model.parameters():
        param.requires_grad_(False)
    adapters = {}
    for name, linear in targets.items():
        adapter = LoRAAdapter(linear, config.rank, config.alpha, config.dropout)
        linear.lora = adapter
        linear.register_forward_hook(_add_update)
        adapters[name] = adapter
    return adapters


def initialize_shards(model: nn.Module, seed: int, parallel: ParallelState) -> None:
    """Each adapter of a model sharded as it was built on meta (FSDP rows), as
    :meth:`LoRAAdapter.initialize` makes it whole: this rank's part of the whole ``A``
    (drawn from (seed, name), one adapter at a time), and ``B = 0``."""
    specs, params = model_specs(model, parallel), dict(model.named_parameters())
    with torch.no_grad():
        for name, adapter in adapters_of(model).items():
            key = f"{name}.lora.a"
            whole = adapter.whole_a(seed, name)
            local_tensor(adapter.a).copy_(assemble(specs[key], whole, params[key]))
            local_tensor(adapter.b).zero_()


def adapters_of(model: nn.Module) -> dict[str, LoRAAdapter]:
    """``{base module name: adapter}`` of a model :func:`apply_lora` changed."""
    return {
        name.removesuffix(".lora"): m
        for name, m in model.named_modules()
        if isinstance(m, LoRAAdapter)
    }


def trainable_summary(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts of this rank's model."""
    params = list({id(p): p for p in model.parameters()}.values())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@contextmanager
def merged(model: nn.Module) -> Iterator[None]:
    """Inside: every adapter's update is in its base weight and the hooks add nothing
    (the model computes the same function). After: the base weights are restored
    exactly (from copies, not by subtracting)."""
    adapters = adapters_of(model)
    saved = {}
    with torch.no_grad():
        for name, adapter in adapters.items():
            base = model.get_submodule(name)
            saved[name] = base.weight.detach().clone()
            base.weight.add_(adapter.delta().to(base.weight.dtype))
            adapter.merged = True
    try:
        yield
    finally:
        with torch.no_grad():
            for name, adapter in adapters.items():
                model.get_submodule(name).weight.copy_(saved[name])
                adapter.merged = False


def merge_into(model: nn.Module, adapters: dict[str, Tensor], scale: float) -> None:
    """Fold whole adapter tensors (``X.lora.a``/``X.lora.b``) into the weights of a plain
    single-device model without adapters, in place (:func:`merge_tensors`)."""
    weights = {n: p.detach() for n, p in model.named_parameters()}
    folded = merge_tensors({**weights, **adapters}, scale)
    with torch.no_grad():
        for name in adapters:
            if name.endswith(".lora.a"):
                weight = f"{name.removesuffix('.lora.a')}.weight"
                model.get_parameter(weight).copy_(folded[weight])


def merge_tensors(tensors: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """Whole single-device tensors with adapters (``X.lora.a``/``X.lora.b``) folded into
    their base weights ``X.weight`` (``W + scale · B A``, computed in fp32) and dropped."""
    merged_tensors = {k: v for k, v in tensors.items() if not is_adapter_param(k)}
    for name in tensors:
        if not name.endswith(".lora.a"):
            continue
        module = name.removesuffix(".lora.a")
        a, b = tensors[name].float(), tensors[f"{module}.lora.b"].float()
        weight = merged_tensors[f"{module}.weight"]
        merged_tensors[f"{module}.weight"] = (weight.float() + scale * (b @ a)).to(weight.dtype)
    return merged_tensors


__all__ = [
    "LoRAAdapter",
    "add_adapters",
    "adapters_of",
    "apply_lora",
    "initialize_shards",
    "is_adapter_param",
    "merge_into",
    "merge_tensors",
    "merged",
    "target_linears",
    "trainable_summary",
]
