"""What the trainer does differently when ``finetune.base`` is set.

:class:`FineTune` is created by :class:`training.trainer.Trainer` (every rank) and is
called at four points:

1. ``model_config``: the base's architecture (recipe conflicts refused, data checked
   against the base's tokenizer and vocabulary), used instead of the recipe's;
2. :meth:`FineTune.prepare`, after the model is built and before DDP and the
   optimizer: the base weights are copied in, each rank reading only its boxes of each
   base tensor (its TP shard, experts or FSDP rows; one box at a time), and with
   ``finetune.lora`` adapters are added and every base parameter frozen, so the
   optimizer (``param_groups`` skips frozen ones) holds the adapters alone;
3. :meth:`FineTune.lineage`: MLflow tags for the run and the package's ``lineage``;
4. :meth:`FineTune.package_model` and :meth:`FineTune.save_adapter` at the end: the
   model package holds the merged weights (``W + scale · B A``, a normal package that
   exports to Hugging Face as any other) and ``OUTPUT/adapter/`` the adapter alone.

Checkpoints need nothing special: they hold every parameter, frozen base weights and
adapters alike, and the AdamW state of the trainable ones, so a LoRA run resumes
exactly (the base is read again at start-up, then overwritten by the checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megalith.config import MegalithConfig
from megalith.storage import sha256_of_file
from training.data.shard_set import open_source
from training.finetune.adapter import save_adapter
from training.finetune.base import (
    BaseModelError,
    BaseWeights,
    check_data_matches,
    finetune_model_config,
    load_base,
)
from training.finetune.base_tensors import BaseTensors, TensorDict
from training.finetune.lora import (
    adapters_of,
    apply_lora,
    initialize_shards,
    is_adapter_param,
    merge_into,
    merged,
    trainable_summary,
)
from training.mlflow_store.runs import resolve_tracking_uri
from training.models import model_from_tensors
from training.models.package import DTYPES
from training.parallel import data_parallel as dp
from training.parallel import tensor_parallel_training as tp
from training.parallel.dtensor import local_tensor, whole_tensor
from training.parallel.groups import ParallelState
from training.parallel.shard_specs import model_specs

logger = logging.getLogger(__name__)


class FineTune:
    """The base model of a fine-tune and the hooks the trainer calls (module docstring)."""

    def __init__(self, config: MegalithConfig, base: BaseWeights | None = None):
        self.config = config
        self.lora = config.finetune.lora
        self.base = base or load_base(
            config.finetune.base,
            tracking_uri=_tracking_uri(config),
            require_signature=config.checkpoint.require_signature,
        )
        self.model_config = finetune_model_config(config, self.base.config)
        self._manifests = self._check_data()
        self._adapter_tensors: dict[str, Tensor] | None = None

    def _check_data(self) -> list[str]:
        """The training data's manifests; each must fit the base (tokenizer, vocabulary)."""
        data = self.config.data
        urls = []
        for source in data.training_sources():
            shard_set = open_source(source, data)
            tokenizer = shard_set.manifest.tokenizer
            check_data_matches(self.base, tokenizer.id, tokenizer.vocab_size, source.path)
            urls.append(source.record_file)
        return urls

    # ------------------------------------------------------------------ start

    def prepare(self, model: nn.Module, parallel: ParallelState) -> None:
        """Base weights into ``model`` (this rank's shards); with LoRA, adapters added
        and the base frozen. Before DDP and the optimizer, or, when FSDP built the model
        on meta, after the sharding: then the adapters are there already (added on meta,
        frozen base) and each rank fills its rows of them from their seeded init."""
        sharded_adapters = bool(adapters_of(model))
        load_base_weights(model, self.base.tensors, parallel, lambda n: not is_adapter_param(n))
        # What this rank read (rank 0 reads every tensor again later, one at a time, for
        # the base's content id in its lineage).
        self.load_stats = dataclasses.replace(self.base.tensors.stats)
        seed = self.config.training.seed
        if self.lora is not None and sharded_adapters:
            initialize_shards(model, seed, parallel)
        elif self.lora is not None:
            apply_lora(model, self.lora, seed)
        trainable, total = trainable_summary(model)
        logger.info(
            "fine-tuning from %s (%s): %d of %d parameters train on this rank",
            self.base.uri,
            "LoRA" if self.lora else "full",
            trainable,
            total,
        )

    @functools.cached_property
    def _lineage(self) -> dict[str, str]:
        storage = self.config.data.storage_options
        return {
            **self.base.lineage(),
            "megalith.finetune.method": "lora" if self.lora else "full",
            "megalith.data.manifests": ",".join(self._manifests),
            "megalith.data.manifest_sha256": ",".join(
                sha256_of_file(url, storage) for url in self._manifests
            ),
        }

    def lineage(self) -> dict[str, str]:
        """Tags for the MLflow run and the model package: base, method, data manifests."""
        return dict(self._lineage)

    # ------------------------------------------------------------------ end

    @contextlib.contextmanager
    def package_model(
        self,
        model: nn.Module,
        parallel: ParallelState,
        whole_model: Callable[[], contextlib.AbstractContextManager],
    ) -> Iterator[Any]:
        """The whole plain model with the adapters merged, on rank 0 (None elsewhere).

        Collective like ``whole_model``; the adapters are gathered first (kept for
        :meth:`save_adapter`). ``model``'s own weights are unchanged afterwards."""
        if self.lora is None:
            with whole_model() as whole:
                yield whole
            return
        self._adapter_tensors = gather_adapters(model, parallel)
        if dp.is_sharded(model):  # FSDP: folded into the whole copy rank 0 gathers
            with whole_model() as whole:
                if whole is not None:
                    merge_into(whole, self._adapter_tensors, self.lora.alpha / self.lora.rank)
                yield whole
            return
        with merged(model), whole_model() as whole:
            yield None if whole is None else plain_copy(whole)

    def save_adapter(self, out_dir: str | Path) -> Path | None:
        """Rank 0, after :meth:`package_model`: the adapter alone (None without LoRA)."""
        if self.lora is None or self._adapter_tensors is None:
            return None
        return save_adapter(
            self._adapter_tensors,
            self.lora,
            self.model_config,
            self.base.lineage(),
            out_dir,
            sign=self.config.checkpoint.sign,
        )


def _tracking_uri(config: MegalithConfig) -> str | None:
    """The registry for ``models:/`` bases: the run's own tracking store."""
    if not (config.finetune.base or "").startswith("models:/"):
        return None

    return resolve_tracking_uri(config.logging.tracking_uri, Path.cwd())


def load_base_weights(
    model: nn.Module,
    tensors: Mapping[str, Tensor] | BaseTensors,
    parallel: ParallelState,
    names: Callable[[str], bool] = lambda name: True,
) -> None:
    """Copy this rank's parts of the base tensors into its model (its pipeline stage's
    layers, its TP shard and experts, its FSDP rows when the model was sharded on meta):
    each part is
    read as the boxes :func:`~training.parallel.shard_specs.model_specs` gives, one
    tensor at a time, so no more than one tensor's share is read at once.

    ``names``: which of the model's parameters come from the base (LoRA adapters added
    before the load do not). Every name and shape is checked before the first read."""
    source = tensors if isinstance(tensors, BaseTensors) else TensorDict(tensors)
    params = {n: p for n, p in model.named_parameters() if names(n)}
    missing = sorted(set(params) - set(source))
    # A pipeline stage holds some of the layers (under their whole-model names): the
    # base's other tensors belong to the other stages.
    unexpected = sorted(set(source) - set(params)) if parallel.sizes.pp == 1 else []
    if missing or unexpected:
        raise BaseModelError(
            f"the base weights do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    specs = model_specs(model, parallel)
    for name in params:
        if source.shape(name) != specs[name].shape:
            raise BaseModelError(
                f"base tensor {name} has shape {source.shape(name)}, the model expects "
                f"{specs[name].shape}"
            )
    with torch.no_grad():
        for name, param in params.items():
            local = local_tensor(param)
            for piece in specs[name].pieces:
                local[piece.local].copy_(source.read(name, piece.box))


def gather_adapters(model: nn.Module, parallel: ParallelState) -> dict[str, Tensor]:
    """Whole adapter tensors on CPU: collective over the FSDP ranks for their rows (which
    gives this rank's TP shard), then over the TP group for the shards, then over the
    pipeline group for the other stages' layers."""
    config, split = model.config, parallel.sizes.tp > 1
    adapters = {
        name: tp.gather_whole(name, whole_tensor(param), config, parallel)
        if split
        else whole_tensor(param).detach().cpu()
        for name, param in model.named_parameters()
        if is_adapter_param(name)
    }
    if parallel.sizes.pp == 1:
        return adapters
    device = next(model.parameters()).device
    return _gather_to_first_stage(adapters, parallel, device)


def _gather_to_first_stage(
    tensors: dict[str, Tensor], parallel: ParallelState, device: torch.device
) -> dict[str, Tensor]:
    """Every stage's ``tensors`` on the first stage of each pipeline group (the others
    keep their own). Each stage sends a JSON header of names, shapes and dtypes, then the
    tensors, over ``device`` (NCCL sends device tensors); nothing is unpickled."""
    group = parallel.pp_group
    if parallel.pp_rank != 0:
        header = json.dumps(
            [
                [name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                for name, t in tensors.items()
            ]
        ).encode()
        dist.send(torch.tensor([len(header)], device=device), group_dst=0, group=group)
        payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        dist.send(payload, group_dst=0, group=group)
        for tensor in tensors.values():
            dist.send(tensor.to(device).contiguous(), group_dst=0, group=group)
        return tensors
    gathered = dict(tensors)
    for stage in range(1, parallel.sizes.pp):
        size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(size, group_src=stage, group=group)
        header = torch.empty(int(size), dtype=torch.uint8, device=device)
        dist.recv(header, group_src=stage, group=group)
        for name, shape, dtype in json.loads(bytes(header.cpu().tolist())):
            buffer = torch.empty(shape, dtype=DTYPES[dtype], device=device)
            dist.recv(buffer, group_src=stage, group=group)
            gathered[name] = buffer.cpu()
    return gathered


def plain_copy(model: nn.Module) -> nn.Module:
    """A plain single-device copy without adapters (the model itself when it has none)."""
    if not adapters_of(model):
        return model
    params = {n: p.detach().cpu() for n, p in model.named_parameters() if not is_adapter_param(n)}
    buffers = {n: b.detach().cpu() for n, b in model.named_buffers()}
    return model_from_tensors(model.config, params, buffers)


__all__ = ["FineTune", "gather_adapters", "load_base_weights", "plain_copy"]
