"""Fine-tuning: start from trained weights, train every parameter or LoRA adapters.

- :mod:`.base`: the starting point (``finetune.base``): a checkpoint, a model package,
  a registered model (``models:/NAME@ALIAS``) or a Hugging Face directory, as whole
  tensors, a model config and a content id.
- :mod:`.lora`: adapters on plain and tensor-parallel linears, merging.
- :mod:`.adapter`: an adapter saved alone (safetensors + JSON with sha256), loaded back
  onto its base, merged into a model package (:func:`.merge.merge_adapter_package`).
- :mod:`.session`: the hooks :class:`training.trainer.Trainer` calls.

A fine-tune is an ordinary ``megalith train`` run with ``finetune.base`` set (see
``configs/finetune-lora-tiny.yaml``). Torch is imported by the submodules only.
"""
