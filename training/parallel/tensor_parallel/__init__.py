"""Megatron-style tensor and sequence parallelism in plain PyTorch.

- :mod:`.mappings`: autograd-aware collectives between replicated, tensor-parallel
  and sequence-parallel regions.
- :mod:`.layers`: column/row-parallel linears, vocab-parallel embedding and output
  head, sequence-parallel norms.
- :mod:`.cross_entropy`: cross-entropy on vocab-split logits.
- :mod:`.sharding`: full state dict <-> per-rank shards.

The model uses them through :class:`training.models.tp_backend.TensorParallelBackend`.
"""

from training.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from training.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
    squared_grad_norm,
    tensor_parallel_partition,
)
from training.parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from training.parallel.tensor_parallel.sharding import (
    check_tensor_parallel,
    gather_tp_state_dict,
    partition_spec,
    shard_full_state_dict,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelOutputHead",
    "check_tensor_parallel",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gather_tp_state_dict",
    "partition_spec",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "shard_full_state_dict",
    "squared_grad_norm",
    "tensor_parallel_partition",
    "vocab_parallel_cross_entropy",
]
