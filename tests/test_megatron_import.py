"""`megalith import megatron` on checkpoints written by Megatron-LM's own save path.

tests/data/megatron/ holds tiny GPT checkpoints that Megatron-LM (tag core_v0.16.1) wrote
with ``save_checkpoint`` under torchrun, in the legacy ``torch`` format and in ``torch_dist``,
for TP=1, TP=2, PP=2, TP2xPP2 and an uneven pipeline split, Llama-style (RMSNorm, SwiGLU,
RoPE, GQA, untied), with ``--use-rope-scaling``, with ``--no-rope-freq 2`` (NoPE layers), and GPT-style with megatron-core's default
fused (tanh) GELU and with exact GELU (``--no-bias-gelu-fusion``); beside each, the logits
megatron-core computes for fixed tokens after loading the torch_dist copy at TP=1.
tests/data/megatron/make_fixtures.py made them (its docstring has the command). The
import must reproduce those logits.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import types
from pathlib import Path

import pytest
import torch
from bad_checkpoints import WritesMarker
from safetensors.torch import load_file

from pipelines.cli import main
from training.interop.megatron import (
    MegatronImportError,
    import_megatron,
    load_torch_file,
    model_config_from_args,
)
from training.interop.megatron_export import megatron_args
from training.models.package import load_model_package

DATA = Path(__file__).parent / "data/megatron"
# fp32 on CPU: megatron-core's unfused attention/softmax vs our SDPA differ by rounding only.
ATOL = 1e-4
CASES = [
    ("llama", "tp1_pp1"),
    ("llama", "tp2_pp1"),
    ("llama", "tp1_pp2"),
    ("llama", "tp2_pp2"),
    ("llama_uneven_pp", "tp1_pp2"),
    ("llama_rope_scaling", "tp1_pp1"),
    ("llama_nope", "tp1_pp1"),
    ("gpt_gelu_tanh", "tp1_pp1"),
    ("gpt_gelu_tanh", "tp2_pp1"),
    ("gpt_gelu_erf", "tp1_pp1"),
]


def logit_diff(package: Path, case: Path) -> float:
    """max |our logits - megatron-core's| on the case's reference tokens."""
    reference = load_file(str(case / "reference.safetensors"))
    model, _, _ = load_model_package(package)
    with torch.no_grad():
        ours = model(reference["tokens"])
    return (ours - reference["logits"]).abs().max().item()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize(("name", "layout"), CASES)
def test_import_matches_megatron_logits(
    tokenizer_file: Path, tmp_path: Path, name: str, layout: str, fmt: str
) -> None:
    case = DATA / name / layout
    out = tmp_path / "pkg"
    argv = ["import", "megatron", str(case / fmt), str(out), "--tokenizer", str(tokenizer_file)]
    assert main(argv) == 0
    diff = logit_diff(out, case)
    print(f"{name} {layout} {fmt}: max |logit difference| vs megatron-core {diff:.2e}")
    assert diff < ATOL, f"{name} {layout} {fmt}: logits differ from Megatron's by {diff}"


def real_args(fmt: str = "torch") -> argparse.Namespace:
    if fmt == "torch":
        path = DATA / "llama/tp1_pp1/torch/iter_0000010/mp_rank_00/model_optim_rng.pt"
        return load_torch_file(path)["args"]
    path = DATA / "gpt_gelu_tanh/tp1_pp1/torch_dist/iter_0000010/common.pt"
    return load_torch_file(path, model=False)["args"]


def test_real_args_carry_the_types_megatron_writes() -> None:
    """The fixtures' args hold what current Megatron-LM puts there, admitted as themselves."""
    for fmt in ("torch", "torch_dist"):
        args = real_args(fmt)
        assert isinstance(args.exit_signal, signal.Signals)
        assert args.exit_signal == signal.SIGTERM


def test_gelu_follows_megatron_core_and_the_override_wins(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    erf = DATA / "gpt_gelu_erf/tp1_pp1"
    wrong = import_megatron(erf / "torch", tmp_path / "tanh", tokenizer=tokenizer_file, gelu="tanh")
    assert logit_diff(wrong, erf) > ATOL  # the override is applied: tanh is not what ran
    assert load_model_package(wrong)[1].gelu_approximation == "tanh"
    args = vars(real_args("torch_dist")).copy()
    del args["bias_gelu_fusion"]  # as a converted checkpoint's args may be
    source = Path("common.pt")
    with pytest.raises(MegatronImportError, match="--gelu tanh.*--gelu erf"):
        model_config_from_args(argparse.Namespace(**args), source)
    config = model_config_from_args(argparse.Namespace(**args), source, gelu="erf")
    assert config.gelu_approximation == "none"


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_the_residual_precision_travels_with_megatron_args(fp32_residual: bool) -> None:
    """``--fp32-residual-connection`` becomes ``model.fp32_residual`` on import, and the
    exported args carry ours back (a checkpoint's args without the flag: bf16, Megatron's
    default)."""
    args = vars(real_args("torch_dist")).copy()
    args["fp32_residual_connection"] = fp32_residual
    config = model_config_from_args(argparse.Namespace(**args), Path("common.pt"))
    assert config.fp32_residual is fp32_residual
    exported = megatron_args(config, "local", torch.bfloat16)
    assert exported.fp32_residual_connection is fp32_residual
    del args["fp32_residual_connection"]
    assert not model_config_from_args(argparse.Namespace(**args), Path("x")).fp32_residual


def test_rope_scaling_is_applied(tokenizer_file: Path, tmp_path: Path) -> None:
    case = DATA / "llama_rope_scaling/tp1_pp1"
    out = import_megatron(case / "torch", tmp_path / "pkg", tokenizer=tokenizer_file)
    model, config, _ = load_model_package(out)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    model.rope.scaling = None  # unscaled frequencies: not the model Megatron ran
    reference = load_file(str(case / "reference.safetensors"))
    with torch.no_grad():
        assert (model(reference["tokens"]) - reference["logits"]).abs().max() > ATOL


def test_nope_layers_skip_rope(tokenizer_file: Path, tmp_path: Path) -> None:
    case = DATA / "llama_nope/tp1_pp1"
    out = import_megatron(case / "torch_dist", tmp_path / "pkg", tokenizer=tokenizer_file)
    model, config, _ = load_model_package(out)
    assert config.nope_layers == [1]  # --no-rope-freq 2 over 2 layers
    model.layers[1].attention.uses_rope = True  # RoPE everywhere: not the model Megatron ran
    reference = load_file(str(case / "reference.safetensors"))
    with torch.no_grad():
        assert (model(reference["tokens"]) - reference["logits"]).abs().max() > ATOL


@pytest.mark.parametrize(
    ("key", "value", "flag"),
    [
        ("no_rope_freq", 3, "--no-rope-freq"),  # 3 does not divide the 2 layers
        ("rope_scaling_factor", 32.0, "--rope-scaling-factor"),
        ("virtual_pipeline_model_parallel_size", 2, "--virtual-pipeline-model-parallel-size"),
        ("qk_layernorm", True, "--qk-layernorm"),
    ],
)
def test_unsupported_args_are_refused_by_megatron_flag_names(
    key: str, value: object, flag: str
) -> None:
    args = vars(real_args()).copy()
    args[key] = value
    if key == "rope_scaling_factor":
        args["use_rope_scaling"] = True
    with pytest.raises(MegatronImportError, match=flag):
        model_config_from_args(argparse.Namespace(**args), Path("model_optim_rng.pt"))


# --------------------------------------------------------------------------- hostile files


def copy_case(tmp_path: Path, fmt: str) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "llama/tp1_pp1" / fmt, ckpt)
    return ckpt


def calls(module: str, name: str, argument: str) -> bytes:
    """A pickle (protocol 0, by hand) whose loading calls ``module.name(argument)``."""
    return f"c{module}\n{name}\n(V{argument}\ntR.".encode()


def test_a_simple_namespace_carrying_code_is_refused_and_never_runs(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    ckpt = copy_case(tmp_path, "torch")
    path = ckpt / "iter_0000010/mp_rank_00/model_optim_rng.pt"
    marker = tmp_path / "pwned"
    args = argparse.Namespace(  # the admitted types, and a namespace carrying a call
        exit_signal=signal.SIGTERM,
        save=Path("/ckpt"),
        extra=types.SimpleNamespace(hook=WritesMarker(marker)),
    )
    torch.save({"args": args, "model": {}}, path)
    with pytest.raises(
        MegatronImportError,
        match=r"outside the allow-list[^.]*\['builtins\.getattr', 'pathlib\.Path'\]",
    ):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)
    assert not marker.exists()
    assert not (tmp_path / "pkg").exists()


def test_torch_dist_common_pt_naming_code_is_refused(tokenizer_file: Path, tmp_path: Path) -> None:
    ckpt = copy_case(tmp_path, "torch_dist")
    marker = tmp_path / "pwned"
    torch.save({"args": WritesMarker(marker)}, ckpt / "iter_0000010/common.pt")
    with pytest.raises(MegatronImportError, match=r"common\.pt.*outside the allow-list"):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)
    assert not marker.exists()


def test_dcp_metadata_naming_code_is_refused_and_never_runs(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    ckpt = copy_case(tmp_path, "torch_dist")
    marker = tmp_path / "pwned"
    metadata = ckpt / "iter_0000010/.metadata"
    metadata.write_bytes(calls("os", "system", f"touch {marker}"))
    with pytest.raises(MegatronImportError, match=r"\.metadata.*os\.system is not allowed"):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)
    assert not marker.exists()
    # a torch dtype is a value the metadata may hold; torch functions are not
    metadata.write_bytes(calls("torch", "load", str(metadata)))
    with pytest.raises(MegatronImportError, match=r"torch\.load is not allowed"):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)


def test_dcp_storage_outside_the_directory_is_refused(tokenizer_file: Path, tmp_path: Path) -> None:
    ckpt = copy_case(tmp_path, "torch_dist")
    metadata = ckpt / "iter_0000010/.metadata"
    data = metadata.read_bytes()
    assert b"__0_0.distcp" in data
    metadata.write_bytes(data.replace(b"__0_0.distcp", b"../__0_0.dcp"))  # same length
    (ckpt / "__0_0.dcp").write_bytes(b"")
    with pytest.raises(MegatronImportError, match=r"not a file in this directory"):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)


def write_dcp_metadata(directory: Path, meta) -> None:
    """Write ``meta`` as ``.metadata`` through DCP's own FileSystemWriter (no pickle here)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.storage import WriteResult

    results = [WriteResult(k, v.length, v) for k, v in meta.storage_data.items()]
    writer = FileSystemWriter(str(directory))
    writer.set_up_storage_writer(is_coordinator=True)
    writer.finish(meta, [results])


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ("size", r"exceeds the \.distcp files"),  # would allocate 400 GB
        ("offset", r"falls outside"),
    ],
)
def test_dcp_metadata_that_lies_about_shapes_is_refused(
    tokenizer_file: Path, tmp_path: Path, change: str, error: str
) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from training.interop.dcp import read_metadata

    ckpt = copy_case(tmp_path, "torch_dist")
    directory = ckpt / "iter_0000010"
    meta = read_metadata(directory)
    key = "embedding.word_embeddings.weight"
    item = meta.state_dict_metadata[key]
    if change == "size":
        item.size = torch.Size([10**10, 32])
    else:
        (chunk,) = item.chunks
        moved = torch.Size([5, 0])
        item.chunks = [ChunkStorageMetadata(moved, chunk.sizes)]
        meta.storage_data[MetadataIndex(key, moved)] = meta.storage_data[
            MetadataIndex(key, chunk.offsets)
        ]
    write_dcp_metadata(directory, meta)
    with pytest.raises(MegatronImportError, match=error):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)
