"""Every process group, built in one place from the ``parallel`` config.

Ranks follow Megatron's order: tensor-parallel innermost (so TP peers share a node),
then context, then data, then pipeline outermost::

    rank = ((pp * DP + dp) * CP + cp) * TP + tp

Expert parallelism is carved out of DP·CP for the MoE layers, again Megatron's
order for expert layers (tp innermost, then ep, then expert-data-parallel, then pp)::

    rank = ((pp * EDP + edp) * EP + ep) * TP + tp,   EP · EDP = DP · CP

The layout helpers below are pure functions of the sizes, so the layout is
testable without processes; ``build_parallel_state`` turns it into DeviceMeshes.
Nothing else in the code base creates process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from megalith.config import ConfigError, MegalithConfig, ParallelConfig
from training.parallel.pipeline_layout import (
    layout_problems,
    pipelined_layers,
    schedule_problems,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


class ParallelLayoutError(ConfigError):
    """Parallel sizes that do not fit the world, the model or the data; names the sizes."""


GroupKind = Literal["tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "embedding"]
MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")


@dataclass(frozen=True)
class ParallelSizes:
    """The size of every parallel dimension; ``dp`` is derived from the world size."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    vpp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the DP·CP ranks that hold the same experts."""
        return self.dp * self.cp // self.ep

    def describe(self) -> str:
        return (
            f"world {self.world} = tensor {self.tp} · context {self.cp} · "
            f"pipeline {self.pp} · data {self.dp} (expert {self.ep}, virtual {self.vpp})"
        )


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the layout."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    edp: int


def derive_sizes(parallel: ParallelConfig, world_size: int) -> ParallelSizes:
    """Sizes from the config and the world; raises naming the sizes that conflict."""
    tp, cp, pp, ep = parallel.tensor, parallel.context, parallel.pipeline, parallel.expert
    problems = []
    model_parallel = tp * cp * pp
    if world_size % model_parallel:
        launch = (
            f" (one process: launch {model_parallel} with `megalith train --nproc-per-node "
            f"{model_parallel}`)"
            if world_size == 1
            else ""
        )
        problems.append(
            f"world size {world_size} is not divisible by tensor {tp} · context {cp} · "
            f"pipeline {pp} = {model_parallel}{launch}"
        )
    dp = max(1, world_size // model_parallel)
    if (dp * cp) % ep:
        problems.append(
            f"expert {ep} does not divide data {dp} · context {cp} = {dp * cp} "
            f"(experts are spread over the data- and context-parallel ranks)"
        )
    if parallel.virtual_pipeline is not None and pp == 1:
        problems.append(
            f"virtual_pipeline {parallel.virtual_pipeline} needs pipeline > 1 (pipeline is 1)"
        )
    vpp = parallel.virtual_pipeline or 1
    if parallel.pipeline_schedule == "interleaved" and vpp < 2:
        problems.append(
            f"pipeline_schedule interleaved needs virtual_pipeline >= 2 (virtual_pipeline is "
            f"{parallel.virtual_pipeline})"
        )
    if parallel.pipeline_schedule == "zero-bubble" and pp == 1:
        problems.append("pipeline_schedule zero-bubble needs pipeline > 1 (pipeline is 1)")
    if parallel.pipeline_schedule == "1f1b" and vpp > 1:
        problems.append(
            f"virtual_pipeline {vpp} needs pipeline_schedule interleaved (schedule is 1f1b)"
        )
    if parallel.sequence_parallel and tp == 1:
        problems.append("sequence_parallel needs tensor > 1 (tensor is 1)")
    if problems:
        raise ParallelLayoutError(_message(problems))
    return ParallelSizes(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, vpp=vpp)


def validate_layout(config: MegalithConfig, world_size: int) -> ParallelSizes:
    """Check the parallel sizes against the world, the model, the sequence and the batch."""
    sizes = derive_sizes(config.parallel, world_size)
    model, tp, cp, pp = config.model, sizes.tp, sizes.cp, sizes.pp
    problems = []
    if model.num_attention_heads % tp:
        problems.append(
            f"num_attention_heads {model.num_attention_heads} is not divisible by tensor {tp}"
        )
    if model.num_query_groups % tp:
        problems.append(
            f"num_query_groups (KV groups) {model.num_query_groups} is not divisible by tensor {tp}"
        )
    if model.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size {model.ffn_hidden_size} is not divisible by tensor {tp}")
    problems += layout_problems(
        pipelined_layers(model), pp, sizes.vpp, config.parallel.pipeline_layers
    )
    seq = config.data.seq_length
    if cp > 1 and seq % (2 * cp):
        problems.append(
            f"seq_length {seq} is not divisible by 2 · context {cp} = {2 * cp} "
            f"(load-balanced context parallelism splits it into 2·context chunks)"
        )
    if config.parallel.sequence_parallel and seq % (tp * cp):
        problems.append(
            f"seq_length {seq} is not divisible by tensor {tp} · context {cp} = {tp * cp} "
            f"(sequence_parallel splits each context shard over the tensor ranks)"
        )
    training = config.training
    per_step = training.micro_batch_size * sizes.dp
    if training.global_batch_size % per_step:
        problems.append(
            f"global_batch_size {training.global_batch_size} is not divisible by "
            f"micro_batch_size {training.micro_batch_size} · data {sizes.dp} = {per_step}"
        )
    else:
        problems += schedule_problems(
            pp, sizes.vpp, training.global_batch_size // per_step, config.parallel.pipeline_schedule
        )
    if problems:
        raise ParallelLayoutError(_message(problems, sizes))
    return sizes


def _message(problems: list[str], sizes: ParallelSizes | None = None) -> str:
    head = "parallel layout does not fit"
    if sizes is not None:
        head += f" ({sizes.describe()})"
    return head + ":\n  - " + "\n  - ".join(problems)


# Pure layout helpers ------------------------------------------------------------------


def rank_of(sizes: ParallelSizes, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """The global rank at these coordinates (Megatron order, TP innermost)."""
    return ((pp * sizes.dp + dp) * sizes.cp + cp) * sizes.tp + tp


def coords_of(sizes: ParallelSizes, rank: int) -> RankCoords:
    """The coordinates of a global rank; inverse of ``rank_of``."""
    if not 0 <= rank < sizes.world:
        raise ValueError(f"rank {rank} outside world {sizes.world}")
    tp = rank % sizes.tp
    cp = rank // sizes.tp % sizes.cp
    dp = rank // (sizes.tp * sizes.cp) % sizes.dp
    pp = rank // (sizes.tp * sizes.cp * sizes.dp)
    dp_cp = dp * sizes.cp + cp
    return RankCoords(tp=tp, cp=cp, dp=dp, pp=pp, ep=dp_cp % sizes.ep, edp=dp_cp // sizes.ep)


def group_ranks(sizes: ParallelSizes, kind: GroupKind) -> list[list[int]]:
    """Every group of one kind as sorted rank lists, in a fixed order.

    ``dp_cp`` is the gradient-reduction group of dense parameters; ``ep`` and ``edp``
    are the expert-parallel and expert-data-parallel groups of MoE layers;
    ``embedding`` pairs the first and last pipeline stages (tied embeddings).
    """
    groups: dict[tuple, list[int]] = {}
    for rank in range(sizes.world):
        c = coords_of(sizes, rank)
        key = {
            "tp": (c.pp, c.dp, c.cp),
            "cp": (c.pp, c.dp, c.tp),
            "dp": (c.pp, c.cp, c.tp),
            "pp": (c.dp, c.cp, c.tp),
            "dp_cp": (c.pp, c.tp),
            "ep": (c.pp, c.edp, c.tp),
            "edp": (c.pp, c.ep, c.tp),
            "embedding": (c.dp, c.cp, c.tp),
        }[kind]
        if kind == "embedding" and c.pp not in (0, sizes.pp - 1):
            continue
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


# Process groups -----------------------------------------------------------------------


@dataclass
class ParallelState:
    """Sizes, this rank's coordinates and its process groups.

    Groups are ``None`` in the single-process default (every size 1, no
    torch.distributed); code that communicates checks the size first.
    """

    sizes: ParallelSizes = field(default_factory=ParallelSizes)
    rank: int = 0
    coords: RankCoords = field(default_factory=lambda: RankCoords(0, 0, 0, 0, 0, 0))
    mesh: DeviceMesh | None = None
    dp_cp_mesh: DeviceMesh | None = None
    cp_tp_mesh: DeviceMesh | None = None  # with CP and TP: a sequence's parts (MoE balance)
    expert_mesh: DeviceMesh | None = None
    embedding_group: ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return self.sizes.world

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def ep_rank(self) -> int:
        return self.coords.ep

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.sizes.pp - 1

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self._group("tp")

    @property
    def cp_group(self) -> ProcessGroup | None:
        return self._group("cp")

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self._group("dp")

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self._group("pp")

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        """Where dense gradients are reduced: data- and context-parallel peers together."""
        return None if self.dp_cp_mesh is None else self.dp_cp_mesh.get_group()

    @property
    def cp_tp_group(self) -> ProcessGroup | None:
        """With context and tensor (sequence) parallelism: the ranks holding the parts of
        one sequence, CP-major (None otherwise)."""
        return None if self.cp_tp_mesh is None else self.cp_tp_mesh.get_group()

    @property
    def ep_group(self) -> ProcessGroup | None:
        return None if self.expert_mesh is None else self.expert_mesh.get_group("ep")

    @property
    def edp_group(self) -> ProcessGroup | None:
        return None if self.expert_mesh is None else self.expert_mesh.get_group("edp")

    def _group(self, name: str) -> ProcessGroup | None:
        return None if self.mesh is None else self.mesh[name].get_group()

    def layout(self) -> dict[str, int | str]:
        """The layout as flat MLflow params."""
        s = self.sizes
        return {
            "world_size": s.world,
            "parallel.tensor": s.tp,
            "parallel.context": s.cp,
            "parallel.pipeline": s.pp,
            "parallel.virtual_pipeline": s.vpp,
            "parallel.data": s.dp,
            "parallel.expert": s.ep,
        }


def single_process_state() -> ParallelState:
    """The default: one process, every size 1, no torch.distributed needed."""
    return ParallelState()


def build_parallel_state(config: MegalithConfig, device_type: str = "cpu") -> ParallelState:
    """Validate the layout and create every group; a no-op state without torch.distributed.

    Collective: every rank of the world must call it with the same config.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        validate_layout(config, 1)
        return single_process_state()
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = validate_layout(config, world)
    mesh = init_device_mesh(
        device_type, (sizes.pp, sizes.dp, sizes.cp, sizes.tp), mesh_dim_names=MESH_DIMS
    )
    dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    cp_tp_mesh = mesh["cp", "tp"]._flatten("cp_tp") if sizes.cp > 1 and sizes.tp > 1 else None
    expert_mesh = None
    if sizes.ep > 1:
        expert_mesh = init_device_mesh(
            device_type, (sizes.pp, sizes.edp, sizes.ep, sizes.tp), mesh_dim_names=EXPERT_MESH_DIMS
        )
    embedding_group = None
    if sizes.pp > 1:
        # new_group is collective over the world: every rank creates every group.
        for ranks in group_ranks(sizes, "embedding"):
            group = dist.new_group(ranks)
            if rank in ranks:
                embedding_group = group
    return ParallelState(
        sizes=sizes,
        rank=rank,
        coords=coords_of(sizes, rank),
        mesh=mesh,
        dp_cp_mesh=dp_cp_mesh,
        cp_tp_mesh=cp_tp_mesh,
        expert_mesh=expert_mesh,
        embedding_group=embedding_group,
    )
