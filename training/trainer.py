"""The training loop, on one device or data-parallel over many.

``train(config, output)`` builds the model, data and optimizer from the config,
trains for ``training.train_iters`` optimizer steps with gradient accumulation,
validates periodically, checkpoints, and writes ``metrics.jsonl``. With
``checkpoint.resume`` it continues from the latest checkpoint so that the loss
curve equals that of an uninterrupted run.

Under torchrun (torch.distributed initialised by the caller, see
``training.runtime.distributed``) each data-parallel rank reads its own slice of every
global batch, gradients are averaged by DDP (``training.parallel.data_parallel``),
and rank 0 alone writes metrics and the model package and talks to MLflow; every rank
writes its own shards of a checkpoint (``training.checkpoint.sharded_files``, in a background
thread with ``checkpoint.async_save``), which loads into any other layout. Tensor (and
sequence) parallel peers read the same batches and hold shards of the model
(``training.parallel.tensor_parallel_training``); the package holds whole tensors.
Context-parallel peers read the same batches too and each keeps its load-balanced part
of every sequence (``training.parallel.context_parallel``).
With ``model.family: t5`` the samples are span-corrupted windows of the same shards and
the model an encoder-decoder (``training.objectives.t5``).
Pipeline stages run the micro-batches through a 1F1B schedule
(``training.parallel.pipeline``). Mixture-of-experts models add their load-balancing
loss to the training loss; expert-parallel ranks hold a share of the experts
(``training.parallel.expert_parallel_training``). ``training.parallel.support`` lists
the combinations that are refused.
With ``finetune.base`` the architecture and the initial weights come from a base model,
and with ``finetune.lora`` only low-rank adapters train (``training.finetune``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from megalith.config import MegalithConfig, ModelConfig, dump_config
from megalith.errors import MegalithError
from megalith.storage import atomic_write_bytes, atomic_write_json
from training.checkpoint.async_save import Checkpointer, checkpoint_group
from training.checkpoint.format import load_checkpoint
from training.checkpoint.sharded_files import as_location
from training.checkpoint.sharded_index import is_sharded, latest_sharded_checkpoint, read_index
from training.checkpoint.sharded_reader import load_sharded_checkpoint
from training.checkpoint.sharded_writer import SaveRequest
from training.data.shard_set import open_source
from training.families import model_family
from training.finetune.session import FineTune
from training.metrics.memory import cuda_alloc_retries, resident_memory_gb
from training.metrics.pending import PendingMetrics
from training.metrics.run_logger import MetricsFile, NullLogger, RunLogger, read_metrics
from training.models import backend_name
from training.models.layers import attention_kernels
from training.models.moe import moe_aux_loss
from training.models.package import TrainingData, save_model_package
from training.objectives import sft
from training.optim.adamw import folds_clipping, step_with_clipping, zero_grads
from training.optim.schedule import learning_rate
from training.parallel import data_parallel as dp
from training.parallel import expert_parallel_training as ep
from training.parallel.dtensor import is_dtensor
from training.parallel.groups import ParallelState, build_parallel_state, validate_layout
from training.parallel.parallelize import parallelize
from training.parallel.support import check_trainer_support
from training.precision.mixed import Precision, resolve_precision
from training.runtime.distributed import env_from_torchrun, local_device

logger = logging.getLogger(__name__)

PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16, the brief's MFU denominator


@dataclass
class TrainResult:
    output: Path
    steps: int
    final_loss: float
    val_loss: float | None
    tokens_per_s: float
    checkpoint: Path | None
    model_package: Path | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    adapter: Path | None = None  # a LoRA fine-tune's adapter alone (training.finetune)

    def summary(self) -> dict[str, Any]:
        """What ``result.json`` holds: small, JSON-only, for flows and scripts."""
        return {
            "output": str(self.output),
            "steps": self.steps,
            "final_loss": self.final_loss,
            "val_loss": self.val_loss,
            "tokens_per_s": self.tokens_per_s,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "model_package": str(self.model_package) if self.model_package else None,
            "adapter": str(self.adapter) if self.adapter else None,
        }


def format_record(record: dict[str, Any], total_steps: int) -> str:
    """One log line per step for logs (Prefect, torchrun) where no progress bar shows."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"grad_norm {record['grad_norm']:.3f}"]
    parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return " | ".join(parts)


class ResumableSampler(Sampler[int]):
    """Global sample indices ``start, start + 1, ...``: the datasets already shuffle.

    With ``size`` data-parallel ranks, each span of ``micro_batch_size · size`` indices
    is one micro-batch per rank (Megatron's order): rank ``r`` reads the ``r``-th
    ``micro_batch_size`` of them, so the ranks' union is the single-process batch.
    """

    def __init__(
        self, start: int, stop: int, micro_batch_size: int = 1, rank: int = 0, size: int = 1
    ):
        if (stop - start) % (micro_batch_size * size):
            raise ValueError(
                f"samples {start}..{stop} do not split into micro-batches of "
                f"{micro_batch_size} over {size} ranks"
            )
        self.start, self.stop = start, stop
        self.micro, self.rank, self.size = micro_batch_size, rank, size

    def __iter__(self):
        span = self.micro * self.size
        for first in range(self.start + self.rank * self.micro, self.stop, span):
            yield from range(first, first + self.micro)

    def __len__(self) -> int:
        return (self.stop - self.start) // self.size


def resolve_model_config(config: MegalithConfig) -> ModelConfig:
    """Fill the vocabulary from the training data (T5's sentinels included: they are
    tokenizer pieces) and the context length from data.seq_length (T5: the longer of the
    encoder and decoder lengths)."""
    model = config.model
    updates: dict[str, Any] = {}
    if model.vocab_size is None:
        first = config.data.training_sources()[0]
        manifest = open_source(first, config.data).manifest
        updates["vocab_size"] = manifest.tokenizer.padded_vocab_size
    length, what = model_family(model).context_length(config.data)
    if model.max_position_embeddings is None:
        updates["max_position_embeddings"] = length
    elif model.max_position_embeddings < length:
        raise MegalithError(
            f"{what} exceeds model.max_position_embeddings {model.max_position_embeddings}"
        )
    return model.model_copy(update=updates) if updates else model


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_same_layout(config: MegalithConfig, state: ParallelState) -> None:
    """A parallel state handed to a Trainer (reused across runs in one job) must be the
    layout the config asks for; otherwise the run would silently train in another."""
    wanted = validate_layout(config, state.sizes.world)
    if wanted != state.sizes:
        raise MegalithError(
            f"the parallel state given is {state.sizes.describe()}, "
            f"the config asks for {wanted.describe()}"
        )


class Trainer:
    def __init__(
        self,
        config: MegalithConfig,
        output: str | Path,
        run_logger: RunLogger | None = None,
        parallel_state: ParallelState | None = None,
    ):
        self.config = config
        self.output = Path(output)
        self.run_logger = run_logger or NullLogger()
        # torchrun's LOCAL_RANK picks the GPU; one process: training.device as given.
        self.device = local_device(env_from_torchrun(), config.training.device)
        self.parallel = parallel_state or build_parallel_state(config, self.device.type)
        if parallel_state is not None:
            check_same_layout(config, parallel_state)
        check_trainer_support(config, self.parallel.sizes)
        self.is_main = self.parallel.rank == 0
        if self.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
        self.precision: Precision = resolve_precision(config.mixed_precision, self.device)
        self.precision.attention_context = attention_kernels(config.model.attention_backend)
        # A local path or an fsspec URL (s3://...): checkpoints are sharded (format v2).
        self.checkpoint_dir = str(config.checkpoint.directory or self.output / "checkpoints")
        self.checkpointer = Checkpointer(checkpoint_group())
        self.checkpoint_read_stats: dict[str, Any] = {}  # what this rank read on resume
        seed_everything(config.training.seed)

        # Fine-tuning: the architecture and the weights come from finetune.base.
        self.finetune = FineTune(config) if config.finetune.base else None
        self.model_config = (
            self.finetune.model_config if self.finetune else resolve_model_config(config)
        )
        self.family = model_family(self.model_config)
        # This rank's model, sharded and wrapped in one documented order (parallelize).
        built = parallelize(
            config,
            self.model_config,
            self.parallel,
            self.device,
            self.precision,
            self.family,
            self.finetune,
        )
        self.model, self.dp_model = built.model, built.dp_model
        self.forward_model, self.pipeline = built.forward_model, built.pipeline
        self.optimizer, self.param_names = dp.build_optimizer(
            self.model, config.optimizer, self.device, self.parallel, config.parallel
        )
        self.clips_in_step = self._can_clip_in_step()
        # On a GPU, fit reads step k's metrics after launching step k + 1 (step_metrics);
        # on the CPU there is nothing to overlap, and a step is recorded as it ends.
        self.records_one_step_late = self.device.type == "cuda"
        # The allocator's retries are counted per process: this run's are those after here.
        self._alloc_retries_start = cuda_alloc_retries() if self.device.type == "cuda" else 0
        self._alloc_retries_reported = 0
        # The output head counts as a real matmul: that matches the reference MFU figures
        # (HF Llama 65.5k tokens/s ≈ 47% at the 1B shape). A T5 sample counts S + T tokens.
        self.tokens_per_sample, self.flops_per_token = self.family.tokens_and_flops(
            self.model_config, config.data
        )
        self.step = 0
        self.consumed_samples = 0
        self.checkpoint: Path | str | None = None  # the checkpoint of the current state
        self.train_data, self.valid_data = self._datasets()

    def _can_clip_in_step(self) -> bool:
        """Whether the fused AdamW kernel can apply the clipping (``training.optim.adamw``):
        whole gradients on this rank (no TP, PP, EP or FSDP shards) and no fp16 scaler,
        which already uses the kernel's unscaling input."""
        sizes = self.parallel.sizes
        return (
            folds_clipping(self.optimizer)
            and self.precision.scaler is None
            and sizes.tp == 1
            and sizes.pp == 1
            and sizes.ep == 1
            and not any(is_dtensor(p) for p in self.model.parameters())
        )

    # ------------------------------------------------------------------ data

    def _datasets(self) -> tuple[Dataset, Dataset | None]:
        training = self.config.training
        # Validation always scores the same first samples of the valid split, so the
        # curve compares like with like.
        valid_samples = training.eval_iters * training.micro_batch_size
        train, valid, _ = self.family.build_datasets(
            self.config.data, (training.train_iters * training.global_batch_size, valid_samples, 0)
        )
        if train is None:
            raise MegalithError(
                "the training split is empty: check data.split and the shard set size"
            )
        return train, valid

    def _loader(self, dataset: Dataset, start: int, stop: int) -> DataLoader:
        """This rank's micro-batches of global samples ``start..stop``."""
        training = self.config.training
        sampler = ResumableSampler(
            start, stop, training.micro_batch_size, self.parallel.dp_rank, self.parallel.sizes.dp
        )
        return self._sampled_loader(dataset, sampler)

    def _sampled_loader(self, dataset: Dataset, sampler: Iterable[int]) -> DataLoader:
        workers = self.config.training.num_workers
        return DataLoader(
            dataset,
            batch_size=self.config.training.micro_batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=4 if workers else None,
            # Its own generator: creating a loader must not advance the global RNG,
            # or a resumed run would see different dropout masks.
            generator=torch.Generator().manual_seed(self.config.training.seed),
        )

    def train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches from the current position to the end of training."""
        training = self.config.training
        stop = training.train_iters * training.global_batch_size
        return iter(self._loader(self.train_data, self.consumed_samples, stop))

    # ------------------------------------------------------------------ checkpoints

    def resume(self) -> bool:
        url = latest_sharded_checkpoint(self.checkpoint_dir)
        if url is None:
            return False
        path = as_location(url)
        started = time.perf_counter()
        if is_sharded(read_index(url)):  # v2: this rank's shards, resharded to this layout
            state = load_sharded_checkpoint(
                url,
                self.model,
                self.optimizer,
                self.param_names,
                self.parallel,
                self.precision.scaler,
                owner_stage=self.pipeline.owner_stage if self.pipeline is not None else None,
                stats=self.checkpoint_read_stats,
                require_signature=self.config.checkpoint.require_signature,
            )
        elif self.pipeline is not None:  # v1 (whole tensors) from here on
            state = self.pipeline.load(path, self.optimizer, self.param_names)
        else:
            state = load_checkpoint(
                path,
                self.model,
                self.optimizer,
                self.param_names,
                self.precision.scaler,
                shard=lambda name, t: ep.shard_loaded(name, t, self.model_config, self.parallel),
                require_signature=self.config.checkpoint.require_signature,
            )
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        self.checkpoint = path
        if self.is_main:
            self._truncate_metrics(self.step)
        seconds = time.perf_counter() - started
        logger.info("resumed from %s at step %d in %.1f s", path, self.step, seconds)
        return True

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics a killed run logged after its last checkpoint, so the curve stays one curve."""
        path = self.output / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line the kill cut short; it was after the checkpoint anyway
            if record["step"] <= step:
                kept.append(record)
        atomic_write_bytes(str(path), "".join(_json_line(r) for r in kept).encode())

    def save(self, background: bool = False) -> Path | str:
        """Every rank writes its own shards of the state (a sharded checkpoint). With
        ``background`` this waits only for the copy to host memory; :meth:`wait_for_save`
        (or the next save) waits for the write and the commit."""
        state = {
            "consumed_samples": self.consumed_samples,
            "config": self.config.model_dump(mode="json"),
            "model_config": self.model_config.model_dump(mode="json"),
            "layout": self.parallel.layout(),
        }
        request = SaveRequest(
            root=self.checkpoint_dir,
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            param_names=self.param_names,
            state=state,
            parallel=self.parallel,
            data_parallel_mode=self.config.parallel.data_parallel_mode,
            scaler=self.precision.scaler,
            keep_last=self.config.checkpoint.keep_last,
            owner_stage=self.pipeline.owner_stage if self.pipeline is not None else None,
            sign=self.config.checkpoint.sign,
        )
        url = self.checkpointer.save(request, background)
        self.checkpoint = as_location(url)
        return self.checkpoint

    def wait_for_save(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        self.checkpointer.wait()

    def _package_model(self) -> contextlib.AbstractContextManager:
        """The whole model for the package: a LoRA fine-tune's with its adapters merged."""
        if self.finetune is None:
            return self._whole_model()
        return self.finetune.package_model(self.model, self.parallel, self._whole_model)

    def _whole_model(self) -> contextlib.AbstractContextManager:
        """The whole model on rank 0 (collective under FSDP, TP and PP)."""
        if self.pipeline is not None:
            return self.pipeline.whole_model(self.is_main)
        return ep.full_model(self.model, self.parallel, self.is_main)

    # ------------------------------------------------------------------ steps

    def _micro_batch_loss(
        self, batch: dict[str, torch.Tensor], loss_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.pipeline is not None:  # forward only (validation); the last stage's loss
            return self.pipeline.forward_loss(batch)
        if self.config.data.format == "chat":  # assistant tokens, weighed over the step
            with self.precision.autocast():
                return self.family.chat_loss(
                    self.forward_model, batch, self.device, loss_weight, self.parallel
                )
        with self.precision.autocast():  # next tokens (GPT), span targets (T5)
            return self.family.micro_batch_loss(
                self.forward_model, batch, self.device, self.parallel
            )

    def train_step(self, batches) -> dict[str, float]:
        """One optimizer step over ``accumulation`` micro-batches; its metrics."""
        return self.launch_step(batches).result()

    def launch_step(self, batches) -> PendingMetrics:
        """One optimizer step, queued: its metrics are read later, so the host can
        prepare the next step while the GPU still runs this one."""
        training = self.config.training
        accumulation = training.global_batch_size // (
            training.micro_batch_size * self.parallel.sizes.dp
        )
        lr = learning_rate(
            self.step, self.config.scheduler, self.config.optimizer, training.train_iters
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._refresh_fp8_weights()
        resident = accumulation > 1 and training.compile_mode == "reduce-overhead"
        zero_grads(self.optimizer, self.model.parameters(), resident=resident)
        scaler = self.precision.scaler
        pipeline_metrics = {}
        total_aux = torch.zeros((), device=self.device)
        loss_weight = None  # chat: normalised by the step's global count of loss tokens
        if self.config.data.format == "chat":
            batches, loss_weight = sft.prefetch_step(
                batches, accumulation, self.parallel, self.device
            )
        if self.pipeline is not None:  # the schedule runs the accumulation micro-batches
            total_loss, pipeline_metrics = self.pipeline.forward_backward(batches, loss_weight)
        else:
            total_loss = torch.zeros((), device=self.device)
            for micro_step in range(accumulation):
                # Gradients are averaged over data-parallel ranks on the last micro-step only.
                with dp.no_sync(self.dp_model, skip=micro_step < accumulation - 1):
                    loss = self._micro_batch_loss(next(batches), loss_weight)
                    loss = loss if loss_weight is not None else loss / accumulation
                    # MoE load balancing; dense models skip the walk over their modules.
                    aux = moe_aux_loss(self.model) if self.model_config.num_experts else None
                    # Under CP every rank holds the whole sequence's value but only its
                    # tokens' gradient, and DDP averages over CP: hence the factor.
                    cp_size = self.parallel.sizes.cp
                    objective = loss if aux is None else loss + aux * cp_size / accumulation
                    (scaler.scale(objective) if scaler else objective).backward()
                total_loss += loss.detach()
                total_aux += 0.0 if aux is None else aux.detach() / accumulation
            total_loss = dp.all_reduce_mean(total_loss, self.parallel)
            if self.model_config.num_experts:  # dense models skip the walk over their modules
                ep.reduce_moe_grads(self.model, self.parallel)
        if scaler:
            scaler.unscale_(self.optimizer)
        if self.clips_in_step:
            grad_norm = dp.grad_norm(list(self.model.parameters()))
            step_with_clipping(self.optimizer, grad_norm, training.grad_clip)
        else:
            if self.pipeline is not None:
                grad_norm = self.pipeline.clip_grad_norm(training.grad_clip)
            else:
                grad_norm = ep.clip_grad_norm(self.model, training.grad_clip, self.parallel)
            if scaler:
                scaler.step(self.optimizer)
                scaler.update()
            else:
                self.optimizer.step()
        self.step += 1
        self.checkpoint = None
        self.consumed_samples += training.global_batch_size
        metrics = {"loss": total_loss, "lr": lr, "grad_norm": grad_norm}
        metrics.update(pipeline_metrics)  # pipeline stages report their moe_aux_loss
        if self.model_config.num_experts and self.pipeline is None:
            metrics["moe_aux_loss"] = dp.all_reduce_mean(total_aux, self.parallel)
        if scaler:
            metrics["loss_scale"] = scaler.get_scale()
        return PendingMetrics(metrics)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the validation micro-batches, dealt round-robin to the DP ranks."""
        if self.valid_data is None:
            return None
        micro, samples = self.config.training.micro_batch_size, len(self.valid_data)
        batches = range(math.ceil(samples / micro))
        mine = batches[self.parallel.dp_rank :: self.parallel.sizes.dp]
        indices = [i for b in mine for i in range(b * micro, min((b + 1) * micro, samples))]
        self.model.eval()
        self._refresh_fp8_weights()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for batch in self._sampled_loader(self.valid_data, indices):
            total[0] += self._micro_batch_loss(batch).double()
            total[1] += 1
        if self._forward_spans_data_ranks():
            # FSDP's all-gathers and MoE's all-to-alls need every rank in each forward:
            # ranks dealt one batch fewer run one more, uncounted.
            rounds = math.ceil(len(batches) / self.parallel.sizes.dp)
            first = range(min(micro, samples))
            for _ in range(rounds - len(mine)):
                self._micro_batch_loss(next(iter(self._sampled_loader(self.valid_data, first))))
        self.model.train()
        total = dp.all_reduce_mean(total, self.parallel)
        if self.pipeline is not None:
            total = self.pipeline.from_last_stage(total)
        return (total[0] / total[1]).item()

    def _refresh_fp8_weights(self) -> None:
        """Cast the float8 weight copies (``mixed_precision.fp8_weight_cache``) from the
        weights as they are now: after initialization, a resume or an optimizer step."""
        if self.precision.refresh_fp8_weights is not None:
            self.precision.refresh_fp8_weights()

    def _forward_spans_data_ranks(self) -> bool:
        """Whether a forward is collective over data-parallel ranks (FSDP, experts)."""
        return (
            self.config.parallel.data_parallel_mode == "fsdp" or self.parallel.sizes.ep > 1
        ) and self.parallel.sizes.dp > 1

    # ------------------------------------------------------------------ loop

    def _start_run_records(self) -> MetricsFile | None:
        """Rank 0: config.yaml, MLflow params and layout tags, a fresh or truncated metrics.jsonl."""
        if not self.is_main:
            return None
        atomic_write_bytes(str(self.output / "config.yaml"), dump_config(self.config).encode())
        # The model as built: the vocabulary and context length filled from the data.
        params = self.config.model_dump(mode="json")
        params["model"] = self.model_config.model_dump(mode="json")
        params["layout"] = self.parallel.layout()
        self.run_logger.log_params(params)
        sizes = self.parallel.sizes
        self.run_logger.set_tags(
            {
                "megalith.world_size": str(sizes.world),
                "megalith.parallel.layout": f"tp{sizes.tp}-cp{sizes.cp}-pp{sizes.pp}-dp{sizes.dp}",
                "megalith.parallel.data_parallel_mode": self.config.parallel.data_parallel_mode,
                "megalith.kernel_backend": backend_name(self.model),  # what model.backend ran
            }
        )
        if self.finetune is not None:
            self.run_logger.set_tags(self.finetune.lineage())
        if self.step == 0:
            (self.output / "metrics.jsonl").unlink(missing_ok=True)
        return MetricsFile(self.output / "metrics.jsonl")

    def fit(self, show_progress: bool = True) -> TrainResult:
        training = self.config.training
        metrics_file = self._start_run_records()
        batches = self.train_batches()
        tokens_per_step = training.global_batch_size * self.tokens_per_sample
        bar = tqdm(
            total=training.train_iters,
            initial=self.step,
            desc="training",
            unit="step",
            disable=not (show_progress and self.is_main),
            dynamic_ncols=True,
        )
        log = _FitLog(bar, metrics_file, tokens_per_step)
        last_checkpoint, val_loss, record = None, None, {}
        self.model.train()
        # The step launched last, recorded once the next one is launched (step_metrics).
        pending: PendingMetrics | None = None
        clock = time.perf_counter()
        try:
            while self.step < training.train_iters:
                launched = self.launch_step(batches)
                if pending is not None:  # the step before: finished, or nearly
                    record, clock = self._record_step(self.step - 1, pending, clock, log)
                pending = launched
                if self.records_one_step_late and not self._runs_after_step(self.step):
                    continue
                # Evaluation and checkpoints read this step's weights: record it now.
                record, clock = self._record_step(self.step, pending, clock, log)
                pending = None
                val_loss = record.get("val_loss", val_loss)
                if self._checkpoints_after(self.step):
                    last_checkpoint = self.save(background=self.config.checkpoint.async_save)
                clock = time.perf_counter()  # evaluation and saving are not the next step's time
            # A run resumed at its end has its final checkpoint already.
            last_checkpoint = self.checkpoint or self.save(
                background=self.config.checkpoint.async_save
            )
            self.wait_for_save()
        finally:
            bar.close()
            if metrics_file is not None:
                metrics_file.close()
        package = adapter = None
        # Collective under FSDP, TP, PP and EP.
        with self._package_model() as model:
            if self.is_main:
                # This run's package, like its metrics.jsonl, replaces one an earlier run left.
                package = save_model_package(
                    model,
                    self.model_config,
                    self._tokenizer_path(),
                    self.output / "model",
                    overwrite=True,
                    lineage=self.finetune.lineage() if self.finetune else None,
                    training_data=TrainingData.of(self.config.data),
                )
        if self.is_main and self.finetune is not None:
            adapter = self.finetune.save_adapter(self.output / "adapter")
        if not self.is_main:
            return TrainResult(
                output=self.output,
                steps=self.step,
                final_loss=record.get("loss", float("nan")),
                val_loss=val_loss,
                tokens_per_s=_mean_after_warmup(log.rates),
                checkpoint=last_checkpoint,
                model_package=None,
            )
        # From the file, not this process's steps: a run resumed at its end took none.
        metrics = read_metrics(self.output / "metrics.jsonl")
        val_losses = [r["val_loss"] for r in metrics if "val_loss" in r]
        result = TrainResult(
            output=self.output,
            steps=self.step,
            final_loss=metrics[-1]["loss"] if metrics else float("nan"),
            val_loss=val_losses[-1] if val_losses else None,
            tokens_per_s=_mean_after_warmup(log.rates),
            checkpoint=last_checkpoint,
            model_package=Path(package) if package else None,
            metrics=metrics,
            adapter=adapter,
        )
        atomic_write_json(str(self.output / "result.json"), result.summary())
        return result

    def _runs_after_step(self, step: int) -> bool:
        """Whether evaluation, a checkpoint or the end of training follows ``step``."""
        return (
            step >= self.config.training.train_iters
            or self._evaluates_after(step)
            or self._checkpoints_after(step)
        )

    def _evaluates_after(self, step: int) -> bool:
        training = self.config.training
        return bool(training.eval_interval) and (
            step % training.eval_interval == 0 or step == training.train_iters
        )

    def _checkpoints_after(self, step: int) -> bool:
        """A periodic checkpoint (the final one is saved after the loop)."""
        interval = self.config.checkpoint.interval
        return bool(interval) and step % interval == 0 and step < self.config.training.train_iters

    def _record_step(
        self, step: int, pending: PendingMetrics, clock: float, log: _FitLog
    ) -> tuple[dict[str, Any], float]:
        """Wait for ``step``'s metrics, add its speed (and validation, when due and
        ``step`` is the current one), write them everywhere; the record and the time it
        was ready."""
        training = self.config.training
        values = pending.result()
        ready = time.perf_counter()
        record = {"step": step, **values, **self._speed(log.tokens_per_step, ready - clock)}
        record.update(self.checkpointer.pop_timings())  # the last save's, if done
        log.rates.append(record["tokens_per_s"])
        if step == self.step and self._evaluates_after(step):
            val_loss = self.evaluate()
            if val_loss is not None:
                record["val_loss"] = val_loss
                record["val_ppl"] = math.exp(min(val_loss, 50.0))
        if log.metrics_file is not None:
            log.metrics_file.write(record)
        self.run_logger.log_metrics({k: v for k, v in record.items() if k != "step"}, step)
        log.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", refresh=False)
        log.bar.update(1)
        if (
            self.is_main
            and log.bar.disable
            and (step % training.log_interval == 0 or "val_loss" in record)
        ):
            logger.info(format_record(record, training.train_iters))
        return record, ready

    def _speed(self, tokens: int, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / seconds
        speed = {"tokens_per_s": tokens_per_s, "step_time_s": seconds}
        if self.parallel.world_size > 1:
            speed["tokens_per_s_per_device"] = tokens_per_s / self.parallel.world_size
        if self.device.type == "cuda":
            speed["mfu"] = tokens_per_s * self.flops_per_token / PEAK_BF16_FLOPS
            speed["memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
            retries = cuda_alloc_retries() - self._alloc_retries_start
            speed["cuda_alloc_retries"] = float(retries)
            if retries > self._alloc_retries_reported:
                logger.warning(
                    "the CUDA allocator emptied its cache and retried %d time(s) so far: each "
                    "retry stalls the GPU; try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                    "a smaller training.micro_batch_size or activation checkpointing",
                    retries,
                )
                self._alloc_retries_reported = retries
        else:
            speed["memory_gb"] = resident_memory_gb()
        return speed

    def _tokenizer_path(self) -> str:
        first = self.config.data.training_sources()[0]
        shard_set = open_source(first, self.config.data)
        return shard_set.manifest.tokenizer.path


@dataclass
class _FitLog:
    """Where ``fit`` records each step: progress bar, metrics file, speeds so far."""

    bar: tqdm
    metrics_file: MetricsFile | None
    tokens_per_step: int
    rates: list[float] = field(default_factory=list)


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record) + "\n"


def _mean_after_warmup(rates: list[float]) -> float:
    """Mean step speed, leaving out the first step (compilation, allocator warm-up)."""
    steady = rates[1:] or rates
    return sum(steady) / len(steady) if steady else 0.0


def train(
    config: MegalithConfig,
    output: str | Path,
    run_logger: RunLogger | None = None,
    show_progress: bool = True,
) -> TrainResult:
    trainer = Trainer(config, output, run_logger)
    if config.checkpoint.resume:
        trainer.resume()
    return trainer.fit(show_progress=show_progress)
