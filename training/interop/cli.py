"""``megalith export hf`` and ``megalith import hf``: model packages <-> Hugging Face directories."""

from __future__ import annotations

import argparse
import tempfile


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    export = subcommands.add_parser(
        "export",
        help="convert a model package to another format (hf, megatron)",
        description="Convert a Megalith model package to another ecosystem's format.",
    )
    export.set_defaults(group_parser=export)
    export_formats = export.add_subparsers(dest="export_command", metavar="FORMAT")
    export_hf = export_formats.add_parser(
        "hf",
        help="write a Hugging Face model directory (LlamaForCausalLM or GPT2LMHeadModel)",
        description="Convert MODEL_PACKAGE (the model/ directory `megalith train` writes) into "
        "a Hugging Face directory: config.json, generation_config.json, model.safetensors, "
        "tokenizer.model, tokenizer.json and tokenizer_config.json (a package with a Hugging Face "
        "tokenizer.json exports that file as it is). RMSNorm+SwiGLU+RoPE models "
        "become LlamaForCausalLM, LayerNorm+GELU+learned-position models GPT2LMHeadModel, "
        "T5 packages (model.family t5, relative positions) T5ForConditionalGeneration; "
        "MoE models are refused. <|eod|> is the tokenizer's bos and eos token, <|pad|> its pad "
        "token. The directory is written under a temporary name and renamed when complete.",
        epilog="example: megalith export hf runs/tiny/model hf-tiny && python -c "
        "\"import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf-tiny')\"; "
        "the champion: megalith export hf models:/megalith-demo@champion hf-champion",
    )
    export_hf.add_argument(
        "package",
        metavar="MODEL_PACKAGE",
        help="model package directory, or a registered model: models:/NAME@ALIAS or "
        "models:/NAME/VERSION (downloaded and verified first; MLFLOW_TRACKING_URI)",
    )
    export_hf.add_argument("output", metavar="OUT_DIR", help="Hugging Face directory to write")
    export_hf.add_argument(
        "--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty"
    )
    export_hf.set_defaults(handler=_export_hf)
    _register_export_megatron(export_formats)

    imp = subcommands.add_parser(
        "import",
        help="convert another format into a model package (hf, megatron)",
        description="Convert another ecosystem's model into a Megalith model package.",
    )
    imp.set_defaults(group_parser=imp)
    import_formats = imp.add_subparsers(dest="import_command", metavar="FORMAT")
    import_hf = import_formats.add_parser(
        "hf",
        help="read a Hugging Face Llama or GPT-2 directory into a model package",
        description="Convert HF_DIR (config.json with model_type llama or gpt2, and "
        "model.safetensors, a sharded model.safetensors.index.json or *.safetensors) into a "
        "model package at OUT_PACKAGE, to fine-tune or evaluate with Megalith. PyTorch .bin "
        "(pickle) weights are refused unless --allow-torch-bin, and then read only with "
        "torch.load(weights_only=True). The tokenizer is taken as it is: HF_DIR/tokenizer.model "
        "(SentencePiece), else HF_DIR/tokenizer.json (Hugging Face tokenizers), else "
        "HF_DIR/vocab.json + merges.txt (GPT-2 BPE), or --tokenizer FILE. Llama 3 RoPE scaling (rope_type llama3) is kept; other "
        "RoPE scaling types and untied q/k/v head_dim are refused.",
        epilog="example: megalith import hf ./TinyLlama-hf models/tinyllama",
    )
    import_hf.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model directory")
    import_hf.add_argument("output", metavar="OUT_PACKAGE", help="model package to write")
    import_hf.add_argument(
        "--allow-torch-bin",
        action="store_true",
        help="read pytorch_model*.bin when there are no safetensors (torch.load, "
        "weights_only=True)",
    )
    import_hf.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="a .model, tokenizer.json or *vocab.json (default: the one in HF_DIR)",
    )
    import_hf.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the package (default: that of the HF weights)",
    )
    import_hf.add_argument("--overwrite", action="store_true", help="replace OUT_PACKAGE")
    import_hf.set_defaults(handler=_import_hf)
    _register_import_megatron(import_formats)


def _register_export_megatron(formats: argparse._SubParsersAction) -> None:
    megatron = formats.add_parser(
        "megatron",
        help="write a Megatron-LM GPT checkpoint (torch_dist or torch format)",
        description="Convert MODEL_PACKAGE into a Megatron-LM checkpoint directory OUT_DIR "
        "(latest_checkpointed_iteration.txt 'release' and release/): --ckpt-format torch_dist "
        "(default; Megatron reshards it to any TP/PP size on load) or torch (mp_rank_00, "
        "TP=1 and PP=1 only). Tensor names follow megatron-core's GPTModel for "
        "--transformer-impl transformer_engine (default, Megatron-LM's) or local; common.pt "
        "or the .pt file holds args with the architecture's flags, so Megatron-LM can load "
        "it with --use-checkpoint-args (add --no-load-optim --no-load-rng, or --finetune). "
        "T5 and MoE models are refused.",
        epilog="example: megalith export megatron runs/tiny/model ckpt-megatron && "
        "torchrun pretrain_gpt.py --load ckpt-megatron --use-checkpoint-args --finetune ...",
    )
    megatron.add_argument("package", metavar="MODEL_PACKAGE", help="model package directory")
    megatron.add_argument("output", metavar="OUT_DIR", help="Megatron-LM checkpoint to write")
    megatron.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist")
    megatron.add_argument(
        "--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine"
    )
    megatron.add_argument("--overwrite", action="store_true", help="replace OUT_DIR")
    megatron.set_defaults(handler=_export_megatron)


def _export_megatron(args: argparse.Namespace) -> int:
    from training.interop.megatron_export import export_megatron

    out = export_megatron(
        args.package,
        args.output,
        ckpt_format=args.ckpt_format,
        transformer_impl=args.transformer_impl,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}")
    return 0


def _register_import_megatron(formats: argparse._SubParsersAction) -> None:
    megatron = formats.add_parser(
        "megatron",
        help="read a Megatron-LM GPT checkpoint (torch_dist or torch format) into a model package",
        description="Convert a Megatron-LM GPT checkpoint (megatron-core model) into a model "
        "package: --ckpt-format torch_dist (iter_N/.metadata, *.distcp, common.pt) or torch "
        "(iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt), any TP and PP size, uneven pipeline "
        "splits included. No pickle is unpickled freely: .pt files go through "
        "torch.load(weights_only=True) with an allow-list (argparse.Namespace, "
        "types.SimpleNamespace, signal.Signals, pathlib.PosixPath; megatron.*, numpy.* and "
        "_io.BytesIO as inert placeholders), DCP's .metadata through an unpickler that admits "
        "only DCP's metadata dataclasses and torch dtypes/sizes; a file naming anything else is "
        "refused with the list. Only the model tensors and the architecture in args are used; "
        "what Megalith cannot compute exactly (MoE, virtual pipeline stages, QK layernorm, "
        "...) is refused by Megatron-LM's flag name.",
        epilog="example: megalith import megatron ./gpt-ckpt models/gpt --tokenizer tok.model",
    )
    megatron.add_argument("ckpt_dir", metavar="CKPT_DIR", help="Megatron-LM --save directory")
    megatron.add_argument("output", metavar="OUT_PACKAGE", help="model package to write")
    megatron.add_argument(
        "--tokenizer",
        required=True,
        metavar="FILE",
        help="the tokenizer of the model (.model, tokenizer.json or *vocab.json)",
    )
    megatron.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the package (default: that of the checkpoint's embedding)",
    )
    megatron.add_argument(
        "--gelu",
        choices=["tanh", "erf"],
        help="GELU of a GPT-style (non-SwiGLU) model, where args cannot tell (default: "
        "megatron-core's rule: tanh when --bias-gelu-fusion was on with biases, erf otherwise)",
    )
    megatron.add_argument("--overwrite", action="store_true", help="replace OUT_PACKAGE")
    megatron.set_defaults(handler=_import_megatron)


def _export_hf(args: argparse.Namespace) -> int:
    from training.interop.export import export_hf

    if not args.package.startswith("models:/"):
        out = export_hf(args.package, args.output, overwrite=args.overwrite)
    else:
        from training.mlflow_store.registered import load_registered_model

        with tempfile.TemporaryDirectory(prefix="megalith-export-") as tmp:
            package = load_registered_model(args.package, tmp)
            out = export_hf(package, args.output, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from training.interop.hf import import_hf

    out = import_hf(
        args.hf_dir,
        args.output,
        allow_torch_bin=args.allow_torch_bin,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}")
    return 0


def _import_megatron(args: argparse.Namespace) -> int:
    from training.interop.megatron import import_megatron

    out = import_megatron(
        args.ckpt_dir,
        args.output,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        gelu=args.gelu,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}")
    return 0
