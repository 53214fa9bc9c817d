"""Packed sequences: several documents in one row, kept apart by their document ids.

``document_ids [B, T]`` numbers the documents of each row (equal ids = one document;
documents are contiguous). From it the model derives

- positions that restart at 0 at every document start (for RoPE or learned positions),
  so a packed document is encoded exactly as it would be alone;
- a block-diagonal causal mask ``[B, 1, T, T]`` (query ``i`` sees key ``j`` when
  ``j <= i`` and both are in the same document), given to SDPA as ``attn_mask``.

The boolean mask costs ``B·T²`` bytes and makes SDPA leave its fused causal path, which
is fine for fine-tuning lengths; FlexAttention's block masks or a varlen kernel
(``cu_seqlens``) would skip the masked blocks instead: a later speed-up behind the same
argument. Without document ids the model runs exactly as before (``is_causal``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_positions(document_ids: Tensor) -> Tensor:
    """``[B, T]`` positions counted from each document's first token."""
    length = document_ids.size(-1)
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """``[B, 1, T, T]`` bool: causal attention within each document only."""
    length = document_ids.size(-1)
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)
