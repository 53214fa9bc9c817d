"""An adapter merged onto its base as a normal model package (for registering and export).

A LoRA run already writes ``OUTPUT/model`` merged; this is for an adapter kept alone
(``OUTPUT/adapter``) and put on its base later, e.g. by the recurring fine-tune flow
or before ``megalith export hf``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from training.finetune.adapter import load_adapter, merge_adapter
from training.finetune.base import BaseModelError, load_base
from training.models import model_from_tensors
from training.models.package import save_model_package


def merge_adapter_package(
    adapter_dir: str | Path,
    base: str,
    out_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    tracking_uri: str | None = None,
    allow_other_base: bool = False,
    overwrite: bool = False,
    require_signature: bool = False,
) -> Path:
    """Write ``base`` (any ``finetune.base`` form) with the adapter folded in as a package.

    The base's tensors must be the ones the adapter was trained on (same content id)
    unless ``allow_other_base``. ``tokenizer``: the tokenizer file to package,
    needed when the base is a checkpoint (packages, registered models and HF
    directories bring theirs). ``require_signature``: the adapter and the base must be
    signed (see :mod:`training.checkpoint.signing`)."""
    adapter = load_adapter(adapter_dir, require_signature)
    with tempfile.TemporaryDirectory(prefix="megalith-merge-") as workdir:
        weights = load_base(
            base, tracking_uri=tracking_uri, workdir=workdir, require_signature=require_signature
        )
        tokenizer = tokenizer or weights.tokenizer_path
        if tokenizer is None:
            raise BaseModelError(
                f"{base}: a checkpoint has no tokenizer; pass the tokenizer to package"
            )
        if weights.config.model_dump() != adapter.model.model_dump():
            raise BaseModelError(
                f"{adapter_dir}: the adapter was trained on another architecture than {base}"
            )
        check_id = None if allow_other_base else weights.content_id
        tensors = merge_adapter(adapter, weights.tensors, check_id)
        model = model_from_tensors(weights.config, tensors, {})
        lineage = {**adapter.base, "megalith.finetune.method": "lora"}
        return save_model_package(
            model, weights.config, tokenizer, out_dir, overwrite=overwrite, lineage=lineage
        )


__all__ = ["merge_adapter_package"]
