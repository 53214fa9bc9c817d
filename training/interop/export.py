"""Export a model package as a Hugging Face model directory, with the converter of its
model family (GPT: :mod:`training.interop.hf`, T5: :mod:`training.interop.hf_t5`)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from megalith.errors import naming_path
from training.families import model_family
from training.interop.hf import (
    HF_WEIGHTS,
    TOKENIZER_JSON,
    TOKENIZER_MODEL,
    HFInteropError,
    fast_tokenizer_json,
)
from training.models.package import DTYPES, load_model_package, model_tensors


def export_hf(package_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the model package at ``package_dir`` as an HF model directory ``out_dir``: a
    SentencePiece tokenizer as ``tokenizer.model`` and the fast ``tokenizer.json`` made from
    it, a Hugging Face tokenizer's ``tokenizer.json`` as it is."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise HFInteropError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")
    model, config, tokenizer = load_model_package(package_dir)
    dtype = next(name for name, dt in DTYPES.items() if dt == model.embedding.word.weight.dtype)
    export = model_family(config).hf_export(config, model_tensors(model), tokenizer, dtype)
    tok_config = {**export.tokenizer_config, "model_max_length": config.max_position_embeddings}
    as_is = tokenizer.name == TOKENIZER_JSON
    fast = None if as_is else fast_tokenizer_json(tokenizer, export.template)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with naming_path(out_dir / HF_WEIGHTS):  # a full disk: one line naming the file
            save_file(export.tensors, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(tokenizer, tmp / (TOKENIZER_JSON if as_is else TOKENIZER_MODEL))
        _write_json(tmp / "config.json", export.config)
        generation = {f"{k}_token_id": v for k, v in export.special_ids.items()}
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "tokenizer_config.json", tok_config)
        if fast is not None:
            _write_json(tmp / TOKENIZER_JSON, fast)
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
