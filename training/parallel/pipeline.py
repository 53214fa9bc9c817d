"""Pipeline parallelism in the trainer: stage models, 1F1B schedules, gradients, I/O.

Layout (``training.parallel.pipeline_layout``): ``parallel.pipeline`` ranks, each with
``parallel.virtual_pipeline`` model chunks; chunk ``c`` of rank ``r`` is virtual stage
``c · pp + r`` (Megatron's assignment). The embedding runs on the first virtual stage,
the final norm, output head and loss on the last; ``parallel.pipeline_layers`` sets
how many layers each virtual stage holds.

- Stage model: the single-device model is built from the seed on every rank (then TP
  sharded as in :mod:`tensor_parallel_training`), and each rank keeps only its layers,
  so the initial weights equal one device's. Parameter names stay the single-process
  ones (``layers.{i}`` with global ``i``), which keeps AdamW's weight-decay groups,
  checkpoints and TP partition specs unchanged.
- Tied embeddings: the last stage holds a copy of ``embedding.word.weight`` for its
  output head; both copies start equal and, as in Megatron, their gradients are summed
  over ``ParallelState.embedding_group`` (first + last stage) before the optimizer step,
  so they stay equal. The grad norm counts the copy once.
- Schedule: ``torch.distributed.pipelining`` over the ``pp`` group: ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B`` with virtual stages, or ``ScheduleInterleavedZeroBubble``
  (``zero-bubble``: ZB1P of Qi et al. 2024, which splits each backward into the input
  gradient, sent upstream at once, and the weight gradient, deferred into the bubble;
  one or more chunks per rank). The
  micro-batches are the gradient-accumulation micro-batches of one optimizer step
  (``global_batch / (micro_batch · dp)``); each micro-batch's loss is the output head's
  mean loss divided by their number, as the non-pipelined trainer does, so losses and
  gradients equal one device's. Gradients are averaged over data parallelism after the
  schedule (one flat all-reduce per dtype; no overlap with backward), then the
  distributed optimizer (ZeRO-1) or AdamW steps each stage's parameters.
- Validation runs forward only, one micro-batch at a time through the virtual stages.
- Checkpoints are sharded (:mod:`training.checkpoint.sharded_files`; :meth:`owner_stage`
  says which stage writes a tied copy) and load at any pipeline size. The model
  package holds whole tensors: stages (and TP shards) send their parameters to rank 0.
  Whole (v1) checkpoints still load: :meth:`load` picks this rank's parameters.

What differs per model family comes from its :class:`~training.families.spec.PipelineSplit`
(the stage model, a chunk, the schedule's inputs, what travels between stages, who owns a
parameter): GPT's are here; T5's (the encoder's then the decoder's layers are split over
the stages, stages exchange ``(encoder side, decoder side)`` pairs and the encoder mask
goes to every stage as a keyword input) in :mod:`training.parallel.pipeline_t5`.

Inputs are made contiguous before the schedule: torch 2.11's ``PipelineStage`` checks
each micro-batch's strides against those it inferred, and ``tokens[:, :-1]`` is a view
with the row stride of ``tokens`` (seen as a hang on 2x H200: the first stage raised
``PipeliningShapeError`` and the last waited for it forever; :func:`training.runtime.distributed.distributed`
now ends a failed rank at once so torchrun stops the job).

fp16: the last stage's loss function returns the scaled loss, so every stage's gradients
come out scaled; the trainer unscales them and ``AgreedGradScaler`` agrees on an inf over
every rank (so all stages skip the step together). ``training.compile`` compiles each
block of the stage in place (``nn.Module.compile``: names, chunks and checkpoints stay as
they are; the family names its blocks, ``PipelineSplit.blocks``), as torchtitan does, not
the schedule. Not integrated: compiled zero-bubble schedules;
:mod:`training.parallel.support` refuses them.

Measuring the bubble (GPU): every step logs, from each pipeline rank's ``busy`` time (its
chunks' forward and backward and the loss: CUDA events, no extra synchronisation; wall
clock on CPU) and the step's time ``step`` (the whole schedule until its last rank is
done, so waiting for peers and point-to-point transfers count as idle):

- ``pipeline_bubble`` = ``(step - busy) / busy`` of the busiest rank: the time the
  critical stage spends outside its own compute, as a fraction of that compute. This is
  the quantity the theory ``pipeline_bubble_theory`` = ``(p - 1) / (v · m)`` describes
  (Narayanan et al. 2021: bubble time over ideal compute time, stages of equal cost).
- ``pipeline_idle`` = the mean over ranks of ``(step - busy) / step``: the share of the
  GPUs' time spent idle, which adds the stages' imbalance to the bubble.
- ``pipeline_imbalance`` = ``max(busy) / mean(busy) - 1``: how much more the busiest stage
  computes than the average (the output head and loss on the last stage cost about one
  layer at the 1B shape, so 16 layers on 2 stages are 5-6% apart whichever the split).

For example, PP=2 on 2 GPUs at the 1B shape (16 layers) with
m = global_batch_size / micro_batch_size micro-batches per step (here m = 8)::

    megalith train --config configs/llama-1b.yaml --nproc-per-node 2 --output runs/pp2 \\
      --set parallel.pipeline=2 --set training.micro_batch_size=4 \\
      --set training.global_batch_size=32 --set training.train_iters=20 \\
      --set training.eval_interval=0 --set checkpoint.interval=0
    # interleaved: --set parallel.virtual_pipeline=2 --set parallel.pipeline_schedule=interleaved
    # zero bubble (ZB1P, weight gradients fill the bubble): --set parallel.pipeline_schedule=zero-bubble
    # uneven split: --set parallel.pipeline_layers=[9,7]

then ``pipeline_stats(read_metrics("runs/pp2/metrics.jsonl"))`` gives the mean
``step_time_s``, ``pipeline_bubble`` and ``pipeline_bubble_theory`` after warm-up.
Vary m (global_batch_size) to see the bubble fall as (p - 1) / (v · m).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megalith.config import MegalithConfig, ModelConfig
from megalith.errors import MegalithError
from training.checkpoint.format import (
    load_model_tensors,
    optimizer_group_indices,
    read_checkpoint_tensors,
    restore_rng_state,
    saved_param_groups,
    verify_checkpoint_state,
)
from training.models import GPTModel, T5Model, meta_model, model_from_tensors
from training.models.flops import param_groups
from training.models.layers import IGNORE_INDEX
from training.models.moe import moe_layers
from training.models.packing import document_causal_mask, document_positions
from training.parallel import context_parallel as cp
from training.parallel import data_parallel as dp
from training.parallel import expert_parallel_training as ep
from training.parallel import tensor_parallel_training as tp
from training.parallel.dtensor import is_dtensor, local_tensor, whole_tensor
from training.parallel.groups import ParallelState
from training.parallel.pipeline_layout import (
    bubble_fraction,
    layer_counts,
    pipelined_layers,
    stage_layers,
    virtual_stages_of,
)
from training.parallel.te_tensor_parallel import comm_overlap
from training.parallel.tensor_parallel.layers import tensor_parallel_partition
from training.precision.mixed import Precision

if TYPE_CHECKING:  # the family registry imports this module for GPT's stages
    from training.families.spec import PipelineSplit

STATE_KEYS = dp.DistributedOptimizer.STATE_KEYS  # AdamW's moments and step count


# --- stage model and chunks --------------------------------------------------------------


def build_stage_model(
    model: GPTModel, state: ParallelState, counts: list[int]
) -> tuple[GPTModel, list[list[int]]]:
    """Keep this rank's layers, embedding and head of a whole (or TP-sharded) model, in
    place; returns it and the global layer indices of each of its chunks."""
    sizes = state.sizes
    ranges = stage_layers(counts)
    chunks = [list(ranges[s]) for s in virtual_stages_of(state.pp_rank, sizes.pp, sizes.vpp)]
    keep = sorted(i for chunk in chunks for i in chunk)
    # A ModuleDict keyed by the global index keeps the single-process names layers.{i}.
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in keep})
    if not state.is_first_stage:
        if state.is_last_stage and model.config.tie_embeddings:
            model.embedding.position = None  # only the word embedding, for the tied head
        else:
            model.embedding = None
    if not state.is_last_stage:
        model.final_norm = None
        model.output = None
    return model, chunks


class StageChunk(nn.Module):
    """One virtual stage: [embedding] → its blocks → [final norm]; the loss is the
    schedule's ``loss_fn`` (through ``output``). Shares its modules with the stage model."""

    def __init__(
        self,
        model: GPTModel,
        layers: list[int],
        first: bool,
        last: bool,
        autocast: Callable[[], contextlib.AbstractContextManager],
        sequence_shards: int,
        context_shards: int = 1,  # unused: under CP every stage gets its positions
    ):
        super().__init__()
        self.embedding = model.embedding if first else None
        self.rope = model.rope
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in layers)
        self.final_norm = model.final_norm if last else None
        self.output = model.output if last else None
        # The last stage's tied head shares the embedding's Parameter: FSDP must see both
        # modules that hold it to swap both to its sharded and gathered forms.
        tied = last and not first and model.config.tie_embeddings
        self.tied_embedding = model.embedding if tied else None
        self._run_block = model._run_block  # activation checkpointing as configured
        self._autocast = autocast
        self._sequence_shards = sequence_shards  # TP size under sequence parallelism

    def forward(
        self,
        x: Tensor,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """``document_ids [B, T]`` (packed chat samples, every stage gets them): positions
        restart at each document and attention stays within it, as in ``GPTModel.forward``.
        Under context parallelism instead ``position_ids [B, T]``, the positions of this
        rank's part of the sequence, and for packed chat samples ``attn_mask [B, 1, T, S]``,
        its rows of their mask (``context_parallel.packed_documents_part``)."""
        positions = position_ids
        if document_ids is not None:
            positions = document_positions(document_ids)
            attn_mask = document_causal_mask(document_ids)
        with self._autocast():
            if self.embedding is not None:
                length = x.size(1)
                x = self.embedding(x, 0, positions)
            else:
                length = x.size(1) * self._sequence_shards
            rope = self.rope(0, length, x.device, positions) if self.rope is not None else None
            for block in self.blocks:
                x = self._run_block(block, x, rope, None, 0, attn_mask)
            if self.final_norm is not None:
                x = self.final_norm(x)
        return x


def schedule_inputs(
    batches: list[dict[str, Tensor]], device: torch.device
) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
    """The schedule's whole-batch inputs of a GPT: the first stage's tokens, no keyword
    inputs, the last stage's next-token targets (all contiguous). Packed chat samples add
    their document ids for every stage, and their targets are -100 (ignored) outside the
    assistant tokens (``loss_mask``)."""

    def stacked(key: str) -> Tensor:
        return torch.cat([b[key] for b in batches]).to(device, non_blocking=True)

    tokens = stacked("tokens")
    targets = tokens[:, 1:]
    if "document_ids" not in batches[0]:
        return (tokens[:, :-1].contiguous(),), {}, targets.contiguous()
    targets = targets.masked_fill(stacked("loss_mask") == 0, IGNORE_INDEX)
    kwargs = {"document_ids": stacked("document_ids").contiguous()}
    return (tokens[:, :-1].contiguous(),), kwargs, targets.contiguous()


def context_parallel_part(
    args: tuple[Tensor, ...], kwargs: dict[str, Tensor], target: Tensor, state: ParallelState
) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
    """A GPT's schedule inputs for this CP rank: its part of the tokens and targets, and
    every stage's keyword inputs for it: the part's positions, and for packed chat samples
    its rows of their mask in place of the document ids."""
    cp_size, cp_rank = state.sizes.cp, state.cp_rank
    tokens, kwargs = args[0], dict(kwargs)
    documents = kwargs.pop("document_ids", None)
    if documents is None:
        local = cp.positions(tokens.size(1), cp_size, cp_rank, tokens.device)
        kwargs["position_ids"] = local.expand(tokens.size(0), -1).contiguous()
    else:
        positions, mask = cp.packed_documents_part(documents, state)
        kwargs.update(position_ids=positions.contiguous(), attn_mask=mask.contiguous())
    return (
        (cp.split_sequence(tokens, cp_size, cp_rank).contiguous(),),
        kwargs,
        cp.split_sequence(target, cp_size, cp_rank).contiguous(),
    )


def activation_shapes(
    batch: dict[str, Tensor], hidden_size: int, sequence_shards: int
) -> list[tuple[int, ...]]:
    """The shape of one GPT micro-batch's hidden states between stages."""
    tokens = batch["tokens"]
    return [(tokens.size(0), (tokens.size(1) - 1) // sequence_shards, hidden_size)]


class _Busy:
    """Time spent computing (forward, backward, loss) on this rank during one step:
    CUDA events on the current stream (read after the step's synchronisation), else
    wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.seconds, self.events = 0.0, []

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            started = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - started

    def total(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        return self.seconds


# --- the runner --------------------------------------------------------------------------


class PipelineParallel:
    """This rank's stage model, its chunks and schedule, and what the trainer asks of
    them: a training step's forward/backward, gradient sync and clipping, validation
    losses, whole-tensor checkpoints and loading."""

    def __init__(
        self,
        config: MegalithConfig,
        model_config: ModelConfig,
        state: ParallelState,
        device: torch.device,
        precision: Precision,
        split: PipelineSplit,
    ):
        sizes = state.sizes
        self.config, self.model_config, self.state = config, model_config, state
        self.device, self.precision = device, precision
        self.split = split
        self.counts = layer_counts(
            pipelined_layers(model_config), sizes.pp, sizes.vpp, config.parallel.pipeline_layers
        )
        # This rank's TP shard, its EP rank's experts and the MoE layers' CP group.
        whole = ep.build_model(
            model_config,
            state,
            config.parallel.sequence_parallel,
            device,
            comm_overlap(config, model_config, sizes),
        )
        self.model, chunk_layers = split.build_stage(whole, state, self.counts)
        if config.training.compile:  # each block in place: names and chunks stay as they are
            for block in split.blocks(self.model):
                block.compile(backend=config.training.compile_backend)
        self.virtual_stages = virtual_stages_of(state.pp_rank, sizes.pp, sizes.vpp)
        self.num_virtual = sizes.pp * sizes.vpp
        shards = sizes.tp if config.parallel.sequence_parallel else 1
        self.chunks = [
            split.chunk(
                self.model, layers, stage == 0, stage == self.num_virtual - 1,
                precision.autocast, shards, sizes.cp,
            )
            for stage, layers in zip(self.virtual_stages, chunk_layers, strict=True)
        ]  # fmt: skip
        training = config.training
        self.micro_batches = training.global_batch_size // (training.micro_batch_size * sizes.dp)
        self.busy = _Busy(device)
        self._loss_weight: Tensor | None = None
        if precision.scaler is not None:  # only the last stage scales a loss: the scale
            precision.scaler.scale(self._zero())  # must exist on every stage to unscale
        self.schedule = self._schedule()
        self.whole_param_names = whole_param_names(model_config)
        self.moe_layers = moe_layers(self.model)
        self.sharded = False  # FSDP over data x context (shard_data_parallel)

    def shard_data_parallel(self) -> None:
        """FSDP2 over data × context: one unit per block, and each chunk the root of what
        else it runs (embedding, final norm, head), so that torch's pipeline stages drive
        FSDP: gradients reduce-scattered once, after the step's last micro-batch, and the
        parameters resharded then (Megatron's and torchtitan's FSDP × PP)."""
        from torch.distributed.fsdp import fully_shard  # as data_parallel.shard_model

        mesh = self.state.dp_cp_mesh
        # T5's relative-bias tables: every stage holds them but a chunk registers only those
        # it reads, so FSDP would shard them on some stages only. They stay whole:
        # sync_grads averages them over data, then sums them over the stages.
        shared = {p for n, p in self.model.named_parameters() if self.split.on_every_stage(n)}
        # Zero bubble's split backward finds the weights to differentiate through the
        # chunk's parameters() when the input-gradient step runs: they must be the gathered
        # tensors the forward used, so blocks stay gathered from the first forward to the
        # step's gradient reduction (as every stage holds them after its first backward).
        keep_gathered = self.config.parallel.pipeline_schedule == "zero-bubble"
        ep.shard_experts(self.model, self.state, reshard_after_forward=not keep_gathered)
        for block in self.split.blocks(self.model):
            fully_shard(block, mesh=mesh, reshard_after_forward=not keep_gathered)
        for chunk in self.chunks:
            fully_shard(chunk, mesh=mesh, ignored_params=shared or None)
        self.sharded = True

    def reshard(self) -> None:
        """A forward without backward (validation) leaves the chunks' own parameters
        gathered: shard them again, so that the stage model holds what the optimizer steps."""
        if self.sharded:
            for chunk in self.chunks:
                chunk.reshard()

    # ---------------------------------------------------------------- schedule

    def _schedule(self):
        # Imported here: torch.distributed.pipelining imports dynamo (about 1.6 s of CPU),
        # which only pipeline-parallel processes need.
        from training.parallel.pipeline_schedule import build_schedule

        return build_schedule(
            self.chunks, self.virtual_stages, self.num_virtual, self.device, self.state,
            self.busy, self.micro_batches, self._loss, self.config.parallel.pipeline_schedule,
        )  # fmt: skip

    def _loss(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """The objective the schedule back-propagates: the micro-batch's mean loss over the
        step's micro-batches, or with a ``loss_weight`` (packed chat samples) the sum of its
        token losses times it; under fp16, scaled by the loss scaler (every stage's
        gradients come out scaled; the trainer unscales them and skips the step on an inf
        that any rank found, ``AgreedGradScaler``)."""
        with self.busy.span(), self.precision.autocast():
            if self._loss_weight is None:
                loss = self.chunks[-1].output.loss(hidden, labels) / self.micro_batches
            else:
                losses = self.chunks[-1].output.loss(hidden, labels, reduction="none")
                loss = losses.float().sum() * self._loss_weight
        scaler = self.precision.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def forward_backward(
        self, batches: Iterator[dict[str, Tensor]], loss_weight: Tensor | None = None
    ) -> tuple[Tensor, dict]:
        """Run one optimizer step's micro-batches through the schedule and average the
        gradients over data parallelism (and the tied embedding over its copies).
        ``loss_weight``: a token loss's weight in the step (packed chat samples,
        ``objectives.sft.prefetch_step``) instead of the micro-batches' mean.

        Returns the step's loss (mean over micro-batches and data-parallel ranks, on every
        rank) and the bubble metrics."""
        self._arm_load_balancing()
        args, kwargs, target = self._schedule_inputs(
            [next(batches) for _ in range(self.micro_batches)]
        )
        if loss_weight is None and self.state.sizes.cp > 1:
            loss_weight = self._context_parallel_weight(target)
        self._loss_weight = loss_weight
        args = args if self.state.is_first_stage else ()
        losses: list[Tensor] = []
        self.busy.reset()
        started = time.perf_counter()
        if self.state.is_last_stage:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        loss = torch.stack([x.detach() for x in losses]).sum() if losses else self._zero()
        if self.precision.scaler is not None and losses:  # the schedule's losses are scaled
            loss = loss.float() / self.precision.scaler.get_scale()
        busy = self.busy.total()  # synchronises on CUDA
        elapsed = time.perf_counter() - started
        self.sync_grads()
        loss = self.from_last_stage(dp.all_reduce_mean(loss.float(), self.state))
        metrics = self._bubble_metrics(busy, elapsed)
        if self.moe_layers:
            metrics["moe_aux_loss"] = self._load_balancing_loss()
        return loss, metrics

    def _context_parallel_weight(self, target: Tensor) -> Tensor:
        """Under CP, a target token's weight in the step, ``DP·CP / the step's count``: a
        CP rank's part of a micro-batch may hold fewer targets than another's (a T5's
        padded decoder), so the mean of the parts' means would not be the micro-batch's;
        where every micro-batch holds as many targets (GPT pretraining, T5 span
        corruption) this is the micro-batches' mean, as without CP."""
        return dp.token_weight((target != IGNORE_INDEX).sum(), self.state)

    def _arm_load_balancing(self) -> None:
        """Each MoE layer's balance loss gets its gradient in backward, as ``aux · CP /
        micro-batches`` (times the fp16 loss scale) added to the loss would give it: what
        the trainer adds without pipeline stages (CP: see ``Trainer.train_step``)."""
        scale = self.state.sizes.cp / self.micro_batches
        if self.precision.scaler is not None:
            scale *= float(self.precision.scaler.get_scale())
        for layer in self.moe_layers:
            layer.aux_grad_scale, layer.aux_values = scale, []

    def _load_balancing_loss(self) -> Tensor:
        """The step's balance loss as the trainer logs it without stages: the layers' sum
        of their mean over the micro-batches, summed over the stages, averaged over data.
        The last micro-batches' values: torch's first step also runs a metadata forward
        and backward through the last stage before them."""
        total = self._zero()
        for layer in self.moe_layers:
            if layer.aux_values:
                total = total + torch.stack(layer.aux_values[-self.micro_batches :]).mean()
        dist.all_reduce(total, group=self.state.pp_group)
        return dp.all_reduce_mean(total, self.state)

    def _schedule_inputs(
        self, batches: list[dict[str, Tensor]]
    ) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
        """The schedule's whole-batch inputs: the first stage's positional inputs, every
        stage's keyword inputs, the last stage's loss target (all contiguous). Under
        context parallelism each CP rank keeps its load-balanced part of the tokens and
        targets, and every stage gets that part's positions (and rows of the packed chat
        samples' mask; the family's ``PipelineSplit.context_parallel_part``). Pretraining
        parts hold as many targets each, so the mean of the CP ranks' mean losses, which
        ``sync_grads`` and ``all_reduce_mean`` take over data × context, is the whole
        sequence's; packed chat samples weigh every token by the step's global count
        (``objectives.sft.prefetch_step`` counts each rank's part)."""
        return self._context_parallel_part(*self.split.schedule_inputs(batches, self.device))

    def _context_parallel_part(
        self, args: tuple[Tensor, ...], kwargs: dict[str, Tensor], target: Tensor
    ) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
        if self.state.sizes.cp == 1:
            return args, kwargs, target
        return self.split.context_parallel_part(args, kwargs, target, self.state)

    def _bubble_metrics(self, busy: float, elapsed: float) -> dict[str, float]:
        """``pipeline_bubble`` (critical stage), ``pipeline_idle``, ``pipeline_imbalance``
        and the theory, from every pipeline rank's busy and step time (module docstring)."""
        sizes = self.state.sizes
        mine = torch.tensor([busy, elapsed], device=self.device, dtype=torch.float64)
        ranks = [torch.empty_like(mine) for _ in range(sizes.pp)]
        dist.all_gather(ranks, mine, group=self.state.pp_group)
        times = torch.stack(ranks).cpu()
        # The pipeline's makespan: a rank's schedule returns after its own last action,
        # which for the last stage comes before the first stage's last backward; the ranks
        # start together (the previous step ended in collectives over the pipeline).
        busy_s, step = times[:, 0], float(times[:, 1].max())
        critical = float(busy_s.max())
        return {
            "pipeline_bubble": (step - critical) / critical,
            "pipeline_idle": float((1 - busy_s / step).mean()),
            "pipeline_imbalance": float(busy_s.max() / busy_s.mean() - 1),
            "pipeline_bubble_theory": bubble_fraction(sizes.pp, sizes.vpp, self.micro_batches),
        }

    def _zero(self) -> Tensor:
        return torch.zeros((), device=self.device)

    def from_last_stage(self, value: Tensor) -> Tensor:
        """The last stage's value on every rank of the pipeline (collective over pp)."""
        value = value.detach().clone().contiguous()
        dist.broadcast(value, group_src=self.state.sizes.pp - 1, group=self.state.pp_group)
        return value

    # ---------------------------------------------------------------- gradients

    def sync_grads(self) -> None:
        """Average over data × context (as DDP would) the gradients FSDP does not hold,
        reduce the experts' over their expert-data group (EP), then sum the tied
        embedding's gradient over its first- and last-stage copies (Megatron's embedding
        group) and T5's relative-bias tables over the pipeline (every stage holds them)."""
        experts = ep.expert_parameters(self.model) if self.state.sizes.ep > 1 else {}
        grads = [
            p.grad
            for name, p in self.model.named_parameters()
            # EP ranks hold different experts; FSDP has reduce-scattered its rows.
            if p.grad is not None and name not in experts and not is_dtensor(p.grad)
        ]
        if self.model_config.num_experts:  # dense models skip the walk over their modules
            ep.reduce_moe_grads(self.model, self.state)
        size = dp.data_parallel_size(self.state)
        if size > 1 and grads:
            dp.all_reduce_coalesced(grads, self.state.dp_cp_group, divide_by=size)
        if self._tied_copy() is not None:
            grad = self._tied_copy().grad
            if grad is None:
                grad = self._tied_copy().grad = torch.zeros_like(self._tied_copy())
            # Under FSDP both copies hold the same rows of it: sum those.
            dist.all_reduce(local_tensor(grad), group=self.state.embedding_group)
        for name, param in self.model.named_parameters():
            if self.split.on_every_stage(name):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                # Under FSDP every stage holds the same rows of it.
                dist.all_reduce(local_tensor(param.grad), group=self.state.pp_group)

    def _tied_copy(self) -> nn.Parameter | None:
        """The word embedding where it is tied and held by a first or last stage."""
        if not self.model_config.tie_embeddings or self.model.embedding is None:
            return None
        return self.model.embedding.word.weight

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Clip by the norm over every stage and TP shard (a parameter held by several
        stages, the tied embedding or T5's relative-bias tables, counted on its owner
        only); returns the norm before clipping."""
        split_names = set(tensor_parallel_partition(self.model)) if self.state.sizes.tp > 1 else ()
        experts = ep.expert_parameters(self.model) if self.state.sizes.ep > 1 else {}
        # TP-split, replicated, and (under EP) this EP rank's experts; FSDP rows apart.
        totals = torch.zeros(3, dtype=torch.float32, device=self.device)
        rows = torch.zeros(3, dtype=torch.float32, device=self.device)
        for name, param in self.model.named_parameters():
            if param.grad is None or not self._owned(name):
                continue
            square = local_tensor(param.grad.detach()).float().square().sum()
            if name in experts and not is_dtensor(param.grad):
                kind = 2  # this EP rank's experts (under FSDP their rows count as rows)
            else:
                kind = 0 if name in split_names else 1
            (rows if is_dtensor(param.grad) else totals)[kind] += square
        if self.sharded:  # each data-parallel rank holds its rows of those gradients
            dist.all_reduce(rows, group=self.state.dp_cp_group)
            totals += rows
        if experts:
            expert_total = totals[2:].clone()
            dist.all_reduce(expert_total, group=self.state.ep_group)
            totals[2] = expert_total[0]
        if self.state.sizes.tp > 1:
            split = totals[:1].clone()
            dist.all_reduce(split, group=self.state.tp_group)
            totals[0] = split[0]
        total = totals.sum().reshape(1)
        dist.all_reduce(total, group=self.state.pp_group)
        norm = total[0].sqrt()
        if max_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, as without pipeline parallelism.
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for param in self.model.parameters():
                if param.grad is not None:
                    local_tensor(param.grad).mul_(scale)
        return norm

    # ---------------------------------------------------------------- validation

    @torch.no_grad()
    def forward_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """One micro-batch's mean loss, forward only through every virtual stage; the
        value is on the last stage (zero elsewhere: combine with :meth:`from_last_stage`)."""
        inputs, kwargs, labels = self.split.schedule_inputs([batch], self.device)
        counted = (labels != IGNORE_INDEX).sum().clamp(min=1)  # over the whole sequence
        inputs, kwargs, labels = self._context_parallel_part(inputs, kwargs, labels)
        pp, group = self.state.sizes.pp, self.state.pp_group
        shards = self.state.sizes.tp if self.config.parallel.sequence_parallel else 1
        shards *= self.state.sizes.cp  # a CP rank's part of the sequence
        hidden = self.model_config.hidden_size
        shapes = self.split.activation_shapes(batch, hidden, shards)
        dtype = next(self.model.parameters()).dtype
        loss, xs = self._zero(), inputs
        for chunk, stage in zip(self.chunks, self.virtual_stages, strict=True):
            if stage > 0:
                xs = tuple(torch.empty(s, dtype=dtype, device=self.device) for s in shapes)
                for x in xs:
                    dist.recv(x, group_src=(stage - 1) % pp, group=group)
            out = chunk(*xs, **kwargs)
            if stage < self.num_virtual - 1:
                for x in out if isinstance(out, tuple) else (out,):
                    dist.send(x.to(dtype).contiguous(), group_dst=(stage + 1) % pp, group=group)
            else:
                loss = self._validation_loss(chunk, out, labels, counted)
        self.reshard()
        return loss

    def _validation_loss(
        self, chunk: nn.Module, out: Tensor, labels: Tensor, counted: Tensor
    ) -> Tensor:
        """The micro-batch's mean loss; under CP, ``CP ·`` this part's sum over the whole
        sequence's count, whose mean over the CP ranks (the trainer takes it over data ×
        context) is the micro-batch's mean, however unevenly the part holds its targets."""
        cp_size = self.state.sizes.cp
        with self.precision.autocast():
            if cp_size == 1:
                return chunk.output.loss(out, labels)
            losses = chunk.output.loss(out, labels, reduction="none")
        return losses.float().sum() * cp_size / counted

    # ---------------------------------------------------------------- whole tensors

    def _owner(self, name: str) -> int:
        return self.split.owner(name, self.counts, self.state.sizes.pp, self.model_config)

    def owner_stage(self, name: str) -> int:
        """The pipeline rank that saves parameter ``name`` (sharded checkpoints)."""
        return self._owner(name)

    def _to_rank0(self, local: dict[str, Tensor], wanted: list[tuple[str, torch.Size]]):
        """Collective: whole tensors on rank 0 (``None`` elsewhere), TP shards gathered and
        pipeline stages' tensors sent in the order of ``wanted``.

        ``local`` maps names this rank owns to its (TP-sharded) tensors, in an order
        its TP peers share; ranks off the first data-parallel replica only return."""
        coords = self.state.coords
        local = {n: whole_tensor(t) for n, t in local.items()}  # FSDP rows: collective
        if self.state.sizes.ep > 1:  # every EP rank's experts: collective over EP
            local = {n: ep.whole_experts(n.split("/")[0], t, self.state) for n, t in local.items()}
        if coords.dp or coords.cp:
            return None
        if self.state.sizes.tp == 1:
            whole = {n: t.detach().cpu() for n, t in local.items()}
        else:
            whole = {
                n: tp.gather_whole(n.split("/")[0], t, self.model_config, self.state)
                for n, t in local.items()
            }
        if coords.tp:
            return None
        rank0 = self.state.pp_rank == 0
        result = {}
        for name, shape_dtype in wanted:
            owner = self._owner(name.split("/")[0])
            if owner == 0:
                if rank0:
                    result[name] = whole[name]
                continue
            src = self._global_rank(owner)
            if rank0:
                shape, dtype = shape_dtype
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(buffer, src=src)
                result[name] = buffer.cpu()
            elif self.state.pp_rank == owner:
                dist.send(whole[name].to(self.device).contiguous(), dst=0)
        return result if rank0 else None

    def _global_rank(self, pp_rank: int) -> int:
        s = self.state.sizes
        return pp_rank * s.dp * s.cp * s.tp

    def _owned(self, name: str) -> bool:
        return self._owner(name) == self.state.pp_rank

    @contextlib.contextmanager
    def whole_model(self, is_main: bool) -> Iterator[GPTModel | T5Model | None]:
        """The whole single-process model on CPU on rank 0 (None elsewhere); collective."""
        local = {n: p for n, p in self.model.named_parameters() if self._owned(n)}
        reference = _meta_model(self.model_config)
        wanted = [(n, (p.shape, p.dtype)) for n, p in reference.named_parameters()]
        tensors = self._to_rank0(local, wanted)
        if not is_main:
            yield None
            return
        # RoPE tables (buffers) are on every stage.
        yield model_from_tensors(self.model_config, tensors, dict(self.model.named_buffers()))

    def load(self, path: str | Path, optimizer: Any, param_names: list[str]) -> dict[str, Any]:
        """Load this rank's part of a whole checkpoint (written at any layout) into the
        stage model and optimizer, and restore the RNG; returns state.json."""
        path = Path(path)
        if self.sharded:
            raise MegalithError(
                f"{path}: a whole-tensor (v1) checkpoint does not resume under "
                "parallel.data_parallel_mode=fsdp with pipeline stages; resume it once with ddp "
                "(the next checkpoint is sharded, v2), then switch to fsdp"
            )
        index, saved = verify_checkpoint_state(path, self.config.checkpoint.require_signature)
        tensors = read_checkpoint_tensors(path / "model.safetensors", index)

        def mine(name: str, tensor: Tensor) -> Tensor:
            return ep.shard_loaded(name, tensor, self.model_config, self.state)

        model_tensors = {n: mine(n, tensors[n]) for n, _ in self.model.named_parameters()}
        load_model_tensors(self.model, model_tensors, path)
        moments = read_checkpoint_tensors(path / "optimizer.safetensors", index)
        per_param = {}
        for position, name in enumerate(param_names):
            if f"{name}/step" in moments:
                per_param[position] = {
                    key: mine(name, moments[f"{name}/{key}"]) for key in STATE_KEYS
                }
        checked = saved_param_groups(saved, optimizer, f"{path}/state.json")
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": indices}
            for g, indices in zip(checked, optimizer_group_indices(optimizer), strict=True)
        ]
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
        restore_rng_state(read_checkpoint_tensors(path / "rng.safetensors", index), saved["rng"])
        return saved

    def gather_grads(self) -> dict[str, Tensor] | None:
        """The whole model's gradients on rank 0 by single-process name (tests); collective."""
        local = {n: p.grad for n, p in self.model.named_parameters() if self._owned(n)}
        reference = _meta_model(self.model_config)
        wanted = [(n, (p.shape, p.dtype)) for n, p in reference.named_parameters()]
        return self._to_rank0(local, wanted)


def _meta_model(config: ModelConfig) -> GPTModel | T5Model:
    return meta_model(config)


def whole_param_names(config: ModelConfig) -> list[str]:
    """The single-process optimizer's parameter order (decay group, then no-decay)."""
    model = _meta_model(config)
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in param_groups(model, 0.0) for p in g["params"]]


def pipeline_stats(records: list[dict[str, Any]], warmup: int = 2) -> dict[str, float]:
    """Mean step time and bubble of ``metrics.jsonl`` records after ``warmup`` steps
    (for GPU measurements)."""
    steady = records[warmup:] or records
    mean = lambda key: sum(r[key] for r in steady) / len(steady)  # noqa: E731
    return {
        "step_time_s": mean("step_time_s"),
        "pipeline_bubble": mean("pipeline_bubble"),
        "pipeline_idle": mean("pipeline_idle"),
        "pipeline_imbalance": mean("pipeline_imbalance"),
        "pipeline_bubble_theory": steady[0]["pipeline_bubble_theory"],
    }
