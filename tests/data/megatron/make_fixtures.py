"""Write the Megatron-LM checkpoints under tests/data/megatron/ with Megatron-LM's own code.

Megatron-LM tag ``core_v0.16.1`` (the newest tags in the mirror go to core_v0.19.0; 0.16.1 is
the version of the pip ``megatron-core`` in the test extra, used as ``megatron.core``: the
tag's own core), its training package and GPT builder taken from the tag. Regenerate with::

    mkdir -p /tmp/mlm && git --git-dir=MEGATRON_LM.git archive core_v0.16.1 megatron/training \\
        megatron/legacy megatron/rl megatron/post_training gpt_builders.py model_provider.py \\
        | tar -x -C /tmp/mlm
    MEGATRON_LM=/tmp/mlm python tests/data/megatron/make_fixtures.py tests/data/megatron [NAME...]

Megatron-LM's training loop needs CUDA, so this drives its checkpointing functions directly,
on CPU, under ``torchrun --nproc-per-node TP*PP`` with gloo, as ``pretrain`` would: ``args``
come from Megatron's own ``parse_args`` + ``validate_args`` on a tiny argument list (so they
carry every field and type a real run's do: ``exit_signal`` a ``signal.Signals``,
``AttnBackend`` enums, dtypes, ...), the model from Megatron-LM's ``gpt_builder`` (local
layer spec), and ``megatron.training.checkpointing.save_checkpoint`` writes it, once with
``--ckpt-format torch`` and once with ``torch_dist``, optimizer state left out
(``--no-save-optim``, to keep the files small), RNG state in. Stand-ins for CUDA-only calls
(this process only): ``torch.cuda.get_rng_state`` returns the CPU generator's state,
``torch.cuda.synchronize`` does nothing, ``torch.cuda.current_device`` is ``"cpu"``,
``validate_args`` sees device arch 9 (a Hopper), the CUDA RNG tracker's ``fork`` around
attention dropout (0 here) is a no-op;
``batch_invariant_kernels`` (imports triton, absent here) is replaced by an empty module.

Then, in one process, each torch_dist checkpoint is loaded by megatron-core's
``dist_checkpointing.load`` (what Megatron-LM's ``load_checkpoint`` calls for torch_dist; it
reshards; ``load_checkpoint`` itself needs CUDA) into a TP=1, PP=1 model whose logits on
:data:`TOKENS` are written as ``reference.safetensors`` beside the checkpoints: the legacy
checkpoint of the same run holds the same weights.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import types
from pathlib import Path

VOCAB, SEQ = 448, 16  # 448: the test tokenizer has 400 pieces
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ),
    "--max-position-embeddings",
    str(SEQ),
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--train-iters",
    "1",
    "--lr",
    "1e-4",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    str(VOCAB - 1),
    "--make-vocab-size-divisible-by",
    "32",  # 448 at TP=1 and TP=2
    "--transformer-impl",
    "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-rope-fusion",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--attention-backend",
    "unfused",
    "--no-save-optim",
    "--save-interval",
    "10",
    "--seed",
    "1234",
    "--init-method-std",
    "0.2",
]
LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--ffn-hidden-size",
    "48",
]
# name: (model args, [(TP, PP, extra layout args)])
FIXTURES = {
    "llama": (LLAMA, [(1, 1, []), (2, 1, []), (1, 2, []), (2, 2, [])]),
    "llama_uneven_pp": (
        LLAMA + ["--num-layers", "3"],
        [(1, 2, ["--decoder-first-pipeline-num-layers", "1"])],
    ),
    "llama_rope_scaling": (
        LLAMA + ["--use-rope-scaling", "--rope-scaling-factor", "8", "--rotary-base", "500000"],
        [(1, 1, [])],
    ),
    "llama_nope": (LLAMA + ["--no-rope-freq", "2"], [(1, 1, [])]),  # layer 1 without RoPE
    "gpt_gelu_tanh": ([], [(1, 1, []), (2, 1, [])]),  # bias-GELU fusion on (default): tanh
    "gpt_gelu_erf": (["--no-bias-gelu-fusion"], [(1, 1, [])]),
}


def layout_name(tp: int, pp: int) -> str:
    return f"tp{tp}_pp{pp}"


def tokens():
    import torch

    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def import_megatron_training() -> None:
    import torch

    sys.path.insert(0, os.environ["MEGATRON_LM"])
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = stub.is_batch_invariant_mode_enabled = lambda *a, **k: False
    sys.modules[stub.__name__] = stub
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def megatron_args(argv: list[str]):
    from megatron.training import arguments
    from megatron.training.arguments import parse_args, validate_args

    arguments.get_device_arch_version = lambda: 9  # a Hopper's, for validate_args' TP check
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.training.global_vars import set_global_variables

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=True)
    return args


def build_model(args):
    from gpt_builders import gpt_builder
    from megatron.core import parallel_state

    model = gpt_builder(
        args,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model


def init_parallel(args) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.training.initialize import _set_random_seed

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        create_gloo_process_groups=True,
    )
    import random

    import numpy
    import torch

    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed), numpy.random.seed(seed), torch.manual_seed(seed)
    del tensor_parallel, _set_random_seed


def save(out: Path, argv: list[str]) -> None:
    """One rank of a torchrun job: build the model, save it in both formats."""
    import torch

    import_megatron_training()
    from megatron.training.arguments import update_use_dist_ckpt
    from megatron.training.checkpointing import save_checkpoint

    args = megatron_args([*argv, "--save", str(out / "torch"), "--ckpt-format", "torch"])
    init_parallel(args)
    model = build_model(args)
    with torch.no_grad():  # norms away from 1, so their mapping is tested
        for name, param in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    save_checkpoint(10, [model], None, None, 0)
    args.save, args.ckpt_format = str(out / "torch_dist"), "torch_dist"
    update_use_dist_ckpt(args)
    save_checkpoint(10, [model], None, None, 0)


def reference(out: Path, argv: list[str]) -> None:
    """One process: Megatron's load_checkpoint of the torch_dist copy at TP=1 PP=1; logits."""
    import torch
    from safetensors.torch import save_file

    import_megatron_training()
    from megatron.core import dist_checkpointing, tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1")
    args = megatron_args(
        [
            *argv,
            "--load",
            str(out / "torch_dist"),
            "--ckpt-format",
            "torch_dist",
        ]
    )
    init_parallel(args)
    model = build_model(args).eval()
    iteration = (out / "torch_dist/latest_checkpointed_iteration.txt").read_text().strip()
    path = out / f"torch_dist/iter_{int(iteration):07d}"
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(state["model"], strict=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # attention dropout is 0
    x = tokens()
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    with torch.no_grad():
        logits = model(x, torch.arange(SEQ).expand_as(x), attention_mask=mask)
    save_file({"tokens": x, "logits": logits.contiguous()}, str(out / "reference.safetensors"))


def main(root: Path, names: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.environ["MEGATRON_LM"]}
    for name, (model_args, layouts) in FIXTURES.items():
        if names and name not in names:
            continue
        for tp, pp, layout_args in layouts:
            out = root / name / layout_name(tp, pp)
            argv = [*TINY, *model_args, *layout_args]
            argv += [
                "--tensor-model-parallel-size",
                str(tp),
                "--pipeline-model-parallel-size",
                str(pp),
            ]
            run = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={tp * pp}",
                "--master-port=29530",
                __file__,
                "save",
                str(out),
                *argv,
            ]
            subprocess.run(run, check=True, env=env)
            one = [sys.executable, __file__, "reference", str(out), *TINY, *model_args]
            subprocess.run(one, check=True, env=env)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1] == "reference":
        reference(Path(sys.argv[2]), sys.argv[3:])
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
