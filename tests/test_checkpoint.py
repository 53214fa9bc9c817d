"""Training checkpoints: round trip, tamper detection, keep-last-K, crash leftovers.

These tests save a tiny real model and AdamW optimizer with ``save_checkpoint`` and
read them back with ``load_checkpoint``; nothing is mocked.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from megalith.config import ModelConfig, OptimizerConfig
from training.checkpoint.format import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from training.models import GPTModel
from training.optim.adamw import build_optimizer

VOCAB = 128
SEQ = 16
FILES = {
    "model.safetensors",
    "optimizer.safetensors",
    "rng.safetensors",
    "state.json",
    "index.json",
}


class Run:
    """A tiny model with its optimizer, trained a step at a time on fixed batches."""

    def __init__(self, seed: int = 0, hidden_size: int = 32, num_query_groups: int = 2):
        torch.manual_seed(seed)
        config = ModelConfig(
            num_layers=1,
            hidden_size=hidden_size,
            num_attention_heads=2,
            num_query_groups=num_query_groups,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            backend="torch",
        )
        self.model = GPTModel(config)
        self.optimizer, self.names = build_optimizer(
            self.model, OptimizerConfig(lr=1e-2), torch.device("cpu")
        )
        self.steps = 0

    def step(self) -> None:
        """One optimizer step on the batch for this step number."""
        self.steps += 1
        batches = torch.Generator().manual_seed(self.steps)
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=batches)
        self.optimizer.zero_grad()
        self.model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        self.optimizer.step()

    def save(self, root: Path, step: int, keep_last: int = 3, **kwargs) -> Path:
        state = {"consumed_samples": 2 * step}
        return save_checkpoint(
            root, step, self.model, self.optimizer, self.names, state, keep_last=keep_last, **kwargs
        )

    def load(self, path: Path, **kwargs) -> dict:
        return load_checkpoint(path, self.model, self.optimizer, self.names, **kwargs)

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return {f"{i}/{key}": value for i, values in state.items() for key, value in values.items()}


# --- round trip -----------------------------------------------------------------------


def test_round_trip_restores_model_optimizer_rng_and_state(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    path = run.save(tmp_path, step=1)
    after_save = (torch.rand(3), random.random(), np.random.rand())

    assert path == tmp_path / "step-00000001"
    assert {p.name for p in path.iterdir()} == FILES  # safetensors and JSON only, no pickle
    index = json.loads((path / "index.json").read_text())
    for name, entry in index["files"].items():
        assert entry["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()
    assert json.loads((tmp_path / "latest.json").read_text())["path"] == path.name

    fresh = Run(seed=1)  # other weights, empty optimizer state, other RNG state
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    state = fresh.load(path)

    assert state["step"] == 1 and state["consumed_samples"] == 2
    assert_same_tensors(fresh.params(), run.params())
    assert_same_tensors(optimizer_tensors(fresh.optimizer), optimizer_tensors(run.optimizer))
    assert (
        fresh.optimizer.param_groups[0]["weight_decay"]
        == run.optimizer.param_groups[0]["weight_decay"]
    )
    # Every generator continues where it was at the save.
    assert torch.equal(torch.rand(3), after_save[0])
    assert random.random() == after_save[1]
    assert np.random.rand() == after_save[2]
    # And training goes on identically.
    fresh.steps = state["step"]
    run.step(), fresh.step()
    assert_same_tensors(fresh.params(), run.params())


def test_loss_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    run = Run()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    for _ in range(3):  # two clean steps double the scale, a third advances the tracker
        run.optimizer.zero_grad()
        scaler.scale(run.model(tokens[:, :-1], labels=tokens[:, 1:])).backward()
        scaler.step(run.optimizer)
        scaler.update()
    assert scaler.get_scale() == 2048.0
    path = run.save(tmp_path, step=3, scaler=scaler)
    assert json.loads((path / "state.json").read_text())["scaler"]["scale"] == 2048.0

    restored = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    Run(seed=1).load(path, scaler=restored)
    assert restored.get_scale() == 2048.0
    assert restored.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    ("shape", "tensor"),
    [
        ({"hidden_size": 64}, "embedding.word.weight"),
        # Same embedding, different QKV: the embedding must not be loaded on its own.
        ({"num_query_groups": 1}, "layers.0.attention.qkv.linear.weight"),
    ],
)
def test_a_model_of_another_shape_is_refused_and_left_untouched(
    tmp_path: Path, shape: dict[str, int], tensor: str
) -> None:
    run = Run()
    run.step()
    path = run.save(tmp_path, step=1)
    other = Run(seed=1, **shape)
    before = other.params()
    with pytest.raises(CheckpointError, match=rf"{tensor} has shape"):
        other.load(path)
    assert_same_tensors(other.params(), before)


# --- tampering ------------------------------------------------------------------------


def flip_a_byte(path: Path, tmp_path: Path) -> None:
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01  # the last tensor's data
    file.write_bytes(bytes(data))


def swap_in_another_steps_optimizer(path: Path, tmp_path: Path) -> None:
    other = tmp_path / "step-00000002" / "optimizer.safetensors"
    mine = path / "optimizer.safetensors"
    assert other.stat().st_size == mine.stat().st_size  # only the hash can tell them apart
    shutil.copyfile(other, mine)


def remove_state_json(path: Path, tmp_path: Path) -> None:
    (path / "state.json").unlink()


def remove_index_json(path: Path, tmp_path: Path) -> None:
    (path / "index.json").unlink()


def unlist_model_from_index(path: Path, tmp_path: Path) -> None:
    index = json.loads((path / "index.json").read_text())
    del index["files"]["model.safetensors"]
    (path / "index.json").write_text(json.dumps(index))


def name_a_file_outside(path: Path, tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"x")
    index = json.loads((path / "index.json").read_text())
    digest = hashlib.sha256(b"x").hexdigest()
    index["files"]["../x"] = {"sha256": digest, "bytes": 1}
    (path / "index.json").write_text(json.dumps(index))


def symlink_a_file(path: Path, tmp_path: Path) -> None:
    # Same bytes, so the hash matches: only the link itself is wrong.
    target = tmp_path / "elsewhere.safetensors"
    (path / "rng.safetensors").rename(target)
    (path / "rng.safetensors").symlink_to(target)


TAMPERING: list[tuple[Callable[[Path, Path], None], str]] = [
    (flip_a_byte, r"model\.safetensors: sha256 does not match"),
    (swap_in_another_steps_optimizer, r"optimizer\.safetensors: sha256 does not match"),
    (remove_state_json, r"state\.json: missing"),
    (remove_index_json, r"index\.json is missing"),
    (unlist_model_from_index, r"index\.json: does not list model\.safetensors"),
    (name_a_file_outside, r"index\.json: file '\.\./x' is not a plain file name"),
    (symlink_a_file, r"rng\.safetensors: a symbolic link"),
]


@pytest.mark.parametrize(
    ("tamper", "message"), TAMPERING, ids=[tamper.__name__ for tamper, _ in TAMPERING]
)
def test_tampered_checkpoint_is_refused_naming_the_file(
    tmp_path: Path, tamper: Callable[[Path, Path], None], message: str
) -> None:
    run = Run()
    run.step()
    path = run.save(tmp_path, step=1)
    run.step()
    run.save(tmp_path, step=2)
    tamper(path, tmp_path)

    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(path)
    fresh = Run(seed=1)
    before = fresh.params()
    with pytest.raises(CheckpointError, match=message):
        fresh.load(path)
    assert_same_tensors(fresh.params(), before)  # refused before anything was loaded
    assert fresh.optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize(
    ("pointer", "message"),
    [
        ("{not json", r"latest\.json: not a valid pointer"),
        ('{"step": 1, "path": "../step-00000001"}', r"is not a plain file name"),
        ('{"step": 9, "path": "step-00000009"}', r"step-00000009, which does not exist"),
    ],
)
def test_bad_latest_pointer_is_refused(tmp_path: Path, pointer: str, message: str) -> None:
    Run().save(tmp_path, step=1)
    (tmp_path / "latest.json").write_text(pointer)
    with pytest.raises(CheckpointError, match=message):
        latest_checkpoint(tmp_path)


# --- keep-last-K and crashes ----------------------------------------------------------


def test_keep_last_prunes_the_oldest_checkpoints(tmp_path: Path) -> None:
    run = Run()
    for step in range(1, 6):
        run.step()
        run.save(tmp_path, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step-00000004",
        "step-00000005",
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000005"
    assert Run(seed=1).load(latest_checkpoint(tmp_path))["step"] == 5


def test_leftover_tmp_dir_of_a_crashed_save_is_ignored(tmp_path: Path) -> None:
    run = Run()
    run.step()
    run.save(tmp_path, step=1)
    run.step()
    run.save(tmp_path, step=2)
    expected = run.params()
    # A crash while writing step 3: the staging directory holds part of its files.
    run.step()
    staging = tmp_path / "step-00000003.tmp"
    staging.mkdir()
    shutil.copyfile(tmp_path / "step-00000002" / "model.safetensors", staging / "model.safetensors")
    (staging / "state.json").write_text('{"step": 3, "consu')

    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    fresh = Run(seed=1)
    assert fresh.load(latest_checkpoint(tmp_path))["step"] == 2
    assert_same_tensors(fresh.params(), expected)

    # The staging directory counts as no checkpoint when pruning, and the next save of
    # step 3 replaces it with a complete one.
    run.save(tmp_path, step=3, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "step-00000002",
        "step-00000003",
    ]
    assert verify_checkpoint(tmp_path / "step-00000003")["files"].keys() == FILES - {"index.json"}


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    # Checkpoints of an earlier, longer run are still in the directory when a new run
    # starts there from scratch: its first checkpoint must survive pruning.
    earlier = Run()
    earlier.save(tmp_path, step=100, keep_last=2)
    earlier.save(tmp_path, step=200, keep_last=2)
    run = Run(seed=1)
    run.step()
    path = run.save(tmp_path, step=50, keep_last=2)

    assert path.is_dir()
    assert latest_checkpoint(tmp_path) == path
    fresh = Run(seed=2)
    assert fresh.load(path)["step"] == 50
    assert_same_tensors(fresh.params(), run.params())
