"""`megalith memory` for T5 (training/memory/estimate.py with training/memory/t5.py): the static
rows against the real encoder-decoder and its real pipeline stages, the activation
model's structure, and the CLI on the T5-base recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalith.config import load_config
from pipelines.cli import main
from training.memory.estimate import memory_report, resolve_layout, static_memory
from training.memory.t5 import stage_layer_kinds
from training.models import T5Model
from training.parallel.groups import ParallelState, coords_of
from training.parallel.pipeline_layout import layer_counts, pipelined_layers
from training.parallel.pipeline_t5 import build_t5_stage_model
from training.parallel.tensor_parallel.sharding import shard_full_state_dict

REPO = Path(__file__).resolve().parents[1]
T5_TINY = REPO / "configs" / "t5-tiny-cpu.yaml"
T5_BASE = REPO / "configs" / "t5-base.yaml"


def tiny(*sets: str):
    base = [
        "mixed_precision.dtype=fp32",
        "model.backend=torch",
        "model.vocab_size=512",
        "training.global_batch_size=16",
        "training.micro_batch_size=4",
    ]
    return load_config(T5_TINY, [*base, *sets])


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_static_bytes_equal_the_real_t5() -> None:
    config = tiny()
    model = T5Model(config.model)
    assert static_memory(config, resolve_layout(config, 1)).parameters == param_bytes(model)


def test_tensor_parallel_shards_match_the_real_t5_split() -> None:
    config = tiny("parallel.tensor=2")
    model = T5Model(config.model)
    estimate = static_memory(config, resolve_layout(config, 2))
    for rank in range(2):
        shard = shard_full_state_dict(model.state_dict(), config.model, rank, 2)
        held = sum(t.numel() * t.element_size() for t in shard.values())
        assert estimate.parameters == held, f"TP rank {rank}"


@pytest.mark.parametrize(
    "sets",
    [
        ("parallel.pipeline=2",),
        ("parallel.pipeline=2", "parallel.pipeline_layers=[3,1]"),
        (
            "parallel.pipeline=2",
            "parallel.virtual_pipeline=2",
            "parallel.pipeline_schedule=interleaved",
        ),
    ],
)
def test_pipeline_stages_hold_what_the_real_stage_models_hold(sets: tuple[str, ...]) -> None:
    """Each rank's parameter bytes equal those of the stage model the trainer builds
    (its layers, the embedding or head where they live, both relative-bias tables)."""
    config = tiny(*sets)
    sizes = resolve_layout(config, 2)
    counts = layer_counts(
        pipelined_layers(config.model), sizes.pp, sizes.vpp, config.parallel.pipeline_layers
    )
    for rank in range(sizes.pp):
        state = ParallelState(sizes=sizes, rank=rank, coords=coords_of(sizes, rank))
        with torch.device("meta"):
            stage_model, _ = build_t5_stage_model(T5Model(config.model), state, counts)
        estimate = static_memory(config, sizes, stage=rank)
        assert estimate.parameters == param_bytes(stage_model), f"{sets} pipeline rank {rank}"


def test_activations_follow_the_layers_and_lengths() -> None:
    config = load_config(T5_BASE)
    sizes = resolve_layout(config, 1)
    acts = {
        mode: memory_report(config, sizes, micro_batch_size=4, recompute=mode).activations
        for mode in ("none", "selective", "full")
    }
    assert acts["none"] > acts["selective"] > acts["full"] > 0, acts
    # A longer decoder (more targets per sample) holds more, and scores more tokens.
    longer = load_config(T5_BASE, ["data.span_corruption.decoder_length=228"])
    base = memory_report(config, sizes, micro_batch_size=4, recompute="none")
    more = memory_report(longer, resolve_layout(longer, 1), micro_batch_size=4, recompute="none")
    assert more.activations > base.activations
    assert more.loss_buffer == 2 * base.loss_buffer
    # Pipeline: the encoder on stage 0, the decoder (and the head) on stage 1.
    pp2 = load_config(T5_BASE, ["parallel.pipeline=2"])
    sizes2 = resolve_layout(pp2, 2)
    assert stage_layer_kinds(pp2, sizes2, 0) == (12, 0)
    assert stage_layer_kinds(pp2, sizes2, 1) == (0, 12)


def test_cli_reports_a_t5(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["memory", "--config", str(T5_BASE), "--gpu-memory-gib", "80"]
    assert main(args) == 0
    assert "512 enc + 114 dec" in capsys.readouterr().out
    assert main([*args, "--json", "--set", "parallel.pipeline=2", "--nproc-per-node", "2"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    with torch.device("meta"):
        whole = sum(p.numel() for p in T5Model(load_config(T5_BASE).model).parameters())
    assert 0 < report["static"]["params"] < whole
