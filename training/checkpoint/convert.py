"""``megalith ckpt convert``: any checkpoint to one consolidated file set.

A v2 checkpoint saved in any layout (or a v1 whole-tensor checkpoint) becomes a v2
checkpoint with one box per tensor: ``model-r00000.safetensors`` (every parameter,
whole), ``optimizer-r00000.safetensors`` (AdamW's moments and steps, whole) and
``state.json``, committed like a training save (index last, sha256 of every file,
signed when a key is set). Training resumes from it in any layout, since loading
reshards; and converting a consolidated checkpoint back into a layout is just resuming
there, so no offline "split" is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from training.checkpoint.async_save import Checkpointer
from training.checkpoint.format import (
    CheckpointError,
    read_checkpoint_tensors,
    verify_checkpoint_state,
)
from training.checkpoint.sharded_files import dtype_name, rank_file
from training.checkpoint.sharded_index import is_sharded, open_index, read_index
from training.checkpoint.sharded_reader import ShardReader, read_state, read_whole
from training.checkpoint.sharded_writer import Snapshot, index_layout
from training.checkpoint.signing import should_sign
from training.parallel.groups import single_process_state
from training.parallel.shard_specs import OPTIMIZER_PREFIX


def consolidate(
    source: str | Path,
    out_root: str | Path,
    sign: bool | None = None,
    require_signature: bool = False,
) -> str:
    """Write SOURCE (a checkpoint step directory, v1 or v2) as a consolidated v2
    checkpoint under OUT_ROOT (``OUT_ROOT/step-XXXXXXXX``); returns its location.

    SOURCE is checked as a loader checks it: its signature whenever one is present and a
    key is set (always with ``require_signature``), so a tampered checkpoint is never
    re-signed here. OUT_ROOT must hold no incomplete save (the commit would prune it)."""
    _check_out_root(Path(source), Path(out_root))
    if is_sharded(read_index(source)):
        index = open_index(source, require_signature=require_signature)
        tensors, state = _v2_tensors_and_state(source, index)
    else:
        tensors, state = _v1_tensors_and_state(Path(source), require_signature)
    model = {n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)}
    optimizer = {n: t for n, t in tensors.items() if n.startswith(OPTIMIZER_PREFIX)}
    files = {rank_file("model", 0): model, rank_file("optimizer", 0): optimizer}
    entries = {
        name: {
            "shape": list(tensor.shape),
            "dtype": dtype_name(tensor.dtype),
            "shards": [{"file": file, "key": name, "box": [[0, n] for n in tensor.shape]}],
        }
        for file, content in files.items()
        for name, tensor in content.items()
    }
    layout = index_layout(single_process_state(), "ddp")
    snapshot = Snapshot(
        root=str(out_root),
        step=int(state["step"]),
        rank=0,
        world=1,
        files={file: content for file, content in files.items() if content},
        tensors=entries,
        state={**state, "converted_from": str(source)},
        layout=layout,
        keep_last=2**31,
        sign=should_sign(sign),
    )
    return Checkpointer().save(snapshot, background=False)


def _check_out_root(source: Path, out_root: Path) -> None:
    if out_root.resolve() == source.resolve().parent:
        raise CheckpointError(f"{out_root}: holds SRC itself; write the conversion elsewhere")
    if out_root.is_dir():
        for entry in out_root.iterdir():
            if entry.name.startswith("step-") and not (entry / "index.json").is_file():
                raise CheckpointError(
                    f"{entry}: an incomplete checkpoint (a save in progress?) in OUT; "
                    "converting there would remove it"
                )


def _v2_tensors_and_state(
    source: str | Path, index: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every whole tensor and state.json, through one reader over the one verified index."""
    reader = ShardReader(source, index)
    try:
        tensors = {name: read_whole(reader, name) for name in index["tensors"]}
        return tensors, read_state(reader)
    finally:
        reader.close()


def _v1_tensors_and_state(
    source: Path, require_signature: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """v1's whole tensors under v2's global names, and its state with v2's RNG record."""
    index, state = verify_checkpoint_state(source, require_signature)
    read = lambda name: read_checkpoint_tensors(source / name, index)  # noqa: E731
    tensors = dict(read("model.safetensors"))
    for key, tensor in read("optimizer.safetensors").items():
        tensors[f"{OPTIMIZER_PREFIX}{key}"] = tensor
    rng = read("rng.safetensors")
    state["rng"] = {
        **state["rng"],
        "numpy_keys": [int(k) for k in rng["numpy_keys"].tolist()],
        "torch_cpu": rng["torch_cpu"].numpy().tobytes().hex(),
    }
    if "torch_cuda_0" in rng:  # rank 0's own device: the state every rank shares
        state["rng"]["torch_cuda"] = rng["torch_cuda_0"].numpy().tobytes().hex()
    state.get("optimizer", {}).pop("param_names", None)
    return tensors, state
