"""``training.cuda_graphs`` (training/models/cuda_graphs.py), in two halves.

On any machine: what the settings need is refused before any process starts, and the
wiring around Transformer Engine's ``make_graphed_callables`` is checked with a stand-in
that records what it is given and graphs nothing: each block is captured with the
residual stream and RoPE angles a training micro-batch gives it, a training forward then
goes through the captured callables (and computes what the model computes), and every
other forward (no gradients, eval mode, another length) runs the blocks as they are.

The capture and replay themselves need CUDA and Transformer Engine: the ``gpu`` tests of
tests/test_te_backend.py compare graphed training with eager training step by step, and
benchmarks/RESULTS.md has the throughput.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from parallel_helpers import REPO, config_of, trainer_settings

from megalith.config import ModelConfig, load_config
from megalith.errors import MegalithError
from training.models import GPTModel, TorchBackend
from training.models.cuda_graphs import GraphedForward, capture_block_graphs
from training.parallel.groups import ParallelSizes
from training.parallel.parallelize import capture_cuda_graphs
from training.parallel.support import check_trainer_support
from training.precision.mixed import Precision


def test_cuda_graphs_name_what_they_need(shards: Path) -> None:
    """Each setting the graphs cannot hold is named, with the reason, before any process
    starts; a complete TE setting passes, T5 is refused, a CPU rank refuses."""
    complete = {
        **trainer_settings(shards),
        "training.cuda_graphs": True,
        "model.backend": "te",
        "training.device": "auto",
    }
    check_trainer_support(config_of(complete), ParallelSizes(tp=2, dp=2))
    for key, value, named in (
        ("model.backend", "torch", "model.backend=te"),
        ("training.device", "cpu", "training.device cuda or auto"),
        ("training.compile", True, "training.compile=false"),
        ("model.activation_checkpointing", "full", "model.activation_checkpointing=none"),
        ("model.dropout", 0.1, "model.dropout=0"),
        ("parallel.data_parallel_mode", "fsdp", "ddp or distributed_optimizer"),
        ("model.num_experts", 4, "a dense model"),
    ):
        with pytest.raises(MegalithError, match=f"training.cuda_graphs needs .*{named}"):
            check_trainer_support(config_of({**complete, key: value}), ParallelSizes(dp=2))
    for sizes, named in ((ParallelSizes(pp=2), "parallel.pipeline=1"),
                         (ParallelSizes(cp=2), "parallel.context=1")):  # fmt: skip
        with pytest.raises(MegalithError, match=named):
            check_trainer_support(config_of(complete), sizes)
    fp8 = {"mixed_precision.fp8": True, "mixed_precision.dtype": "bf16"}
    delayed = {**complete, **fp8, "mixed_precision.fp8_recipe": "delayed"}
    with pytest.raises(MegalithError, match="fp8_recipe tensorwise"):
        check_trainer_support(config_of(delayed), ParallelSizes())
    check_trainer_support(config_of({**delayed, "mixed_precision.fp8_recipe": "tensorwise"}),
                          ParallelSizes())  # fmt: skip

    t5 = load_config(
        REPO / "configs" / "t5-tiny-cpu.yaml",
        ["training.cuda_graphs=true", "model.backend=te", "training.device=auto"],
    )
    with pytest.raises(MegalithError, match="training.cuda_graphs with model.family=t5"):
        check_trainer_support(t5, ParallelSizes())
    with pytest.raises(MegalithError, match="needs CUDA; this rank runs on cpu"):
        capture_cuda_graphs(None, config_of(complete), torch.device("cpu"), None)  # type: ignore[arg-type]


class RecordingTE:
    """``make_graphed_callables`` that records its arguments and graphs nothing (as TE,
    it hands the modules back; their forward stays the eager one)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def make_graphed_callables(self, modules, sample_args, **options):
        self.calls.append({"modules": modules, "sample_args": sample_args, **options})
        return modules


def tiny_model(position_embedding: str) -> GPTModel:
    config = ModelConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        vocab_size=96, max_position_embeddings=16, position_embedding=position_embedding,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPTModel(config, TorchBackend())


@pytest.mark.parametrize("position_embedding", ["rope", "learned"])
def test_training_micro_batches_go_through_the_captured_blocks(
    position_embedding: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model(position_embedding)
    reference = tiny_model(position_embedding)  # same seed: same weights
    names = list(model.state_dict())
    te = RecordingTE()
    precision = Precision("fp32", "cpu", None)
    fp8 = object()

    assert capture_block_graphs(model, te, 2, 16, precision, fp8) == 3
    (call,) = te.calls
    assert call["enabled"] is True and call["recipe"] is fp8
    assert len(call["modules"]) == len(call["sample_args"]) == 3
    for sample in call["sample_args"]:
        hidden, *rope = sample
        assert hidden.shape == (2, 16, 32) and hidden.requires_grad
        assert [tuple(t.shape) for t in rope] == ([(16, 8), (16, 8)] if rope else [])
    hiddens = [sample[0] for sample in call["sample_args"]]
    assert len({h.data_ptr() for h in hiddens}) == 3  # one static input per block
    assert list(model.state_dict()) == names  # nothing new in the checkpoint

    tokens = torch.randint(0, 96, (2, 16))
    loss = model(tokens, tokens)
    assert torch.equal(loss, reference(tokens, tokens))
    loss.backward()
    replays = [block.forward.replays_run for block in model.layers]
    assert all(isinstance(block.forward, GraphedForward) for block in model.layers)
    assert replays == [1, 1, 1]
    assert all(p.grad is not None for p in model.parameters())

    with torch.no_grad():
        model(tokens)  # validation
    model.eval()
    model(tokens)
    model.train()
    assert [block.forward.replays_run for block in model.layers] == replays

    with caplog.at_level(logging.WARNING, logger="training.models.cuda_graphs"):
        short = tokens[:, :8]
        assert torch.equal(model(short, short), reference(short, short))
    assert [block.forward.replays_run for block in model.layers] == replays
    assert "runs without the graphs" in caplog.text
    warnings = [r for r in caplog.records if "runs without the graphs" in r.message]
    assert len(warnings) == 3  # once per block, not per call
    model(short, short)
    assert len([r for r in caplog.records if "runs without the graphs" in r.message]) == 3


def test_the_capture_runs_without_autocasts_weight_cache() -> None:
    """TE's capture refuses autocast's weight-cast cache (an entry would outlive the
    capture): the graphs are recorded under autocast with the cache off."""
    model = tiny_model("rope")
    seen = []

    class Probe(RecordingTE):
        def make_graphed_callables(self, modules, sample_args, **options):
            seen.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
            return super().make_graphed_callables(modules, sample_args, **options)

    capture_block_graphs(model, Probe(), 1, 8, Precision("bf16", "cpu", None))
    assert seen == [(True, False)]
