"""The supervised fine-tuning loss (``data.format: chat``): assistant tokens only.

Batches come from :class:`~training.data.sft_dataset.SFTDataset` (packed conversations
with ``loss_mask`` and ``document_ids``). The model attends within each conversation and
restarts positions at each one; the loss is the cross-entropy on tokens whose mask is 1.

Normalisation: the training loss of a step is the mean over **all assistant tokens of
the global batch** (every micro-batch of every data-parallel rank), not a mean of
per-micro-batch means. Conversations differ in length, so averaging micro-batch means
would weight a token of a short answer more than one of a long answer, and the result
would change with micro_batch_size, gradient accumulation and the data-parallel size.
So before the step's forwards each rank counts the loss tokens of its micro-batches,
one all-reduce sums the counts, and each micro-batch contributes
``sum(its token losses) · DP / global count``; DDP's gradient average over the DP ranks
divides the DP back out. The step's gradient is then that of the global token mean,
whatever the layout (tests/test_sft.py checks the loss against a manual computation).

Validation reports the mean over each validation micro-batch's assistant tokens,
averaged over micro-batches (it needs no step-wide count).

Context parallelism: each CP rank feeds its load-balanced part of the sequence with its
part of the positions and of the packed documents' attention mask (keys: the whole
sequence's, gathered); it counts its part of the loss tokens, so the all-reduced count is
still the global one, and DDP's average over data × context leaves the global token mean.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from training.parallel import context_parallel as cp
from training.parallel.data_parallel import token_weight
from training.parallel.groups import ParallelState

SFT_KEYS = ("tokens", "loss_mask", "document_ids")


def prefetch_step(
    batches: Iterator[dict[str, Tensor]],
    accumulation: int,
    parallel: ParallelState,
    device: torch.device,
) -> tuple[Iterator[dict[str, Tensor]], Tensor]:
    """This step's micro-batches, and the weight of a token's loss: ``DP · CP / global
    count`` (DDP divides the data × context ranks back out)."""
    step = [next(batches) for _ in range(accumulation)]
    cp_size, cp_rank = parallel.sizes.cp, parallel.cp_rank
    # Under CP each rank counts its part of the sequence: the sum is the global count.
    masks = [cp.split_sequence(batch["loss_mask"], cp_size, cp_rank) for batch in step]
    count = sum(mask.sum() for mask in masks).to(device=device)
    return iter(step), token_weight(count, parallel)


def micro_batch_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    device: torch.device,
    weight: Tensor | None,
    parallel: ParallelState | None = None,
) -> Tensor:
    """``sum(assistant-token losses) · weight``; without a weight, their mean in this batch.
    Under context parallelism (``parallel``) this rank's part of the sequence: its loss
    tokens' sum times the weight, or without one ``CP ·`` that sum over the whole batch's
    count, which the mean over data × context turns into the batch's mean."""
    tokens, mask, documents = (batch[key].to(device, non_blocking=True) for key in SFT_KEYS)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    cp_size = 1 if parallel is None else parallel.sizes.cp
    if cp_size == 1:
        losses = model(inputs, labels=labels, loss_reduction="none", document_ids=documents)
        total = (losses.float() * mask).sum()
        return total * weight if weight is not None else total / mask.sum().clamp(min=1.0)
    assert parallel is not None
    positions, attn_mask = cp.packed_documents_part(documents, parallel)
    part = [cp.split_sequence(x, cp_size, parallel.cp_rank) for x in (inputs, labels, mask)]
    losses = model(
        part[0], labels=part[1], loss_reduction="none", position_ids=positions, attn_mask=attn_mask
    )
    total = (losses.float() * part[2]).sum()
    return total * weight if weight is not None else total * cp_size / mask.sum().clamp(min=1.0)
