"""``megalith finetune merge``: an adapter saved alone, merged onto its base as a package.

Fine-tuning itself is ``megalith train`` with ``finetune.base`` set (and ``finetune.lora``
for adapters); a LoRA run already writes its merged package to OUTPUT/model. This
command is for an adapter kept alone (OUTPUT/adapter) and put on its base later.
"""

from __future__ import annotations

import argparse


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    group = subcommands.add_parser(
        "finetune",
        help="LoRA adapter tools (fine-tuning itself: megalith train with finetune.base)",
        description="Tools for fine-tuned models. Fine-tune with `megalith train --config "
        "configs/finetune-lora-tiny.yaml --set finetune.base=...`.",
    )
    group.set_defaults(group_parser=group)
    merge = group.add_subparsers(dest="finetune_command", metavar="COMMAND").add_parser(
        "merge",
        help="merge an adapter into its base weights as a model package",
        description="Fold ADAPTER (the adapter/ directory a LoRA run writes: safetensors + "
        "adapter.json with its sha256, checked) into BASE (a model package, a checkpoint, "
        "models:/NAME@ALIAS or a Hugging Face directory) as W + alpha/rank · B·A, and write a "
        "normal model package (registrable, exportable with `megalith export hf`). The base "
        "must hold the weights the adapter was trained on (same content id) unless "
        "--allow-other-base.",
        epilog="example: megalith finetune merge runs/ft/adapter --base runs/tiny-cpu/model "
        "--out runs/ft/merged && megalith export hf runs/ft/merged hf-ft",
    )
    merge.add_argument("adapter", metavar="ADAPTER", help="adapter directory")
    merge.add_argument("--base", required=True, metavar="BASE", help="the base model")
    merge.add_argument("--out", required=True, metavar="PKG", help="model package to write")
    merge.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="the tokenizer to package with a checkpoint base (.model, tokenizer.json, *vocab.json)",
    )
    merge.add_argument("--tracking-uri", metavar="URI", help="MLflow store of a models:/ base")
    merge.add_argument(
        "--allow-other-base", action="store_true", help="merge onto other base weights"
    )
    merge.add_argument("--overwrite", action="store_true", help="replace PKG if it exists")
    merge.add_argument(
        "--require-signature",
        action="store_true",
        help="refuse an unsigned ADAPTER or BASE (needs MEGALITH_SIGNING_KEY or "
        "MEGALITH_ED25519_PUBLIC_KEY)",
    )
    merge.set_defaults(handler=_merge)


def _merge(args: argparse.Namespace) -> int:
    from training.finetune.merge import merge_adapter_package

    package = merge_adapter_package(
        args.adapter,
        args.base,
        args.out,
        tokenizer=args.tokenizer,
        tracking_uri=args.tracking_uri,
        allow_other_base=args.allow_other_base,
        overwrite=args.overwrite,
        require_signature=args.require_signature,
    )
    print(f"merged {args.adapter} into {args.base}: model package {package}")
    return 0
