"""`megalith import megatron`: a real megatron-core GPTModel, saved as Megatron-LM saves a
legacy checkpoint, imports into a package whose logits match megatron-core's forward.

megatron-core runs on CPU here with a one-process gloo group for its parallel state;
its local (non-Transformer-Engine) layer spec; two CUDA-only calls in its forward
(``torch.cuda.current_device`` for the RoPE table, the RNG tracker's fork around
attention dropout, which is 0) are bypassed in the test process only. TP=2 rank files
are the TP=1 model's tensors split as megatron-core shards them (:func:`tp_shards`),
and the import must reproduce the TP=1 model's logits.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipelines.cli import main
from training.interop.megatron import MegatronImportError, import_megatron
from training.models.package import load_model_package

mcore = pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, LAYERS = 448, 16, 2
# fp32 on CPU: megatron-core's unfused attention/softmax vs our SDPA differ by rounding only.
ATOL = 1e-4


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory):
    """megatron-core's parallel state on a one-process gloo group (TP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    patches = pytest.MonkeyPatch()
    patches.setattr(torch.cuda, "current_device", lambda: "cpu")
    patches.setattr(
        mrandom.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext()
    )
    yield parallel_state
    patches.undo()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def build_mcore() -> torch.nn.Module:
    """A Llama-style megatron-core GPT (RMSNorm, SwiGLU, RoPE, GQA, untied), seed 0 on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        layernorm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    with torch.no_grad():  # norms away from 1, so their mapping is tested
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def tp_shards(model: torch.nn.Module, tp: int) -> list[dict]:
    """The state dicts a TP=``tp`` Megatron run holds for ``model``: vocab-parallel embedding
    and output, column-parallel QKV (whole KV groups) and fc1 (each rank its own slice of
    gate and of up, stored [gate_r; up_r]: megatron-core's fc1 stride 2), row-parallel
    proj and fc2 (along the input dim), norms replicated."""
    return tp_shards_of(model.state_dict(), tp)


def tp_shards_of(state: dict, tp: int) -> list[dict]:
    shards: list[dict] = [{} for _ in range(tp)]
    for name, value in state.items():
        if value is None or name.endswith("_extra_state"):
            parts = [value] * tp
        elif name.endswith("linear_fc1.weight"):
            gate, up = value.chunk(2)
            parts = [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
        elif name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
            parts = value.chunk(tp, dim=0)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = value.chunk(tp, dim=1)
        else:
            parts = [value] * tp
        for rank, part in enumerate(parts):
            shards[rank][name] = part.clone() if isinstance(part, torch.Tensor) else part
    return shards


def pp_stages(state: dict, pp: int) -> list[dict]:
    """Per pipeline stage: its layers renumbered from 0 (megatron-core's local numbering),
    the embedding on the first stage, the final norm and output layer on the last."""
    per_stage = LAYERS // pp
    stages: list[dict] = [{} for _ in range(pp)]
    for name, value in state.items():
        if name.startswith("decoder.layers."):
            index, rest = name.removeprefix("decoder.layers.").split(".", 1)
            stage, local = divmod(int(index), per_stage)
            stages[stage][f"decoder.layers.{local}.{rest}"] = value
        else:
            stages[0 if name.startswith("embedding.") else pp - 1][name] = value
    return stages


def megatron_args(tp_size: int) -> argparse.Namespace:
    """``args`` as Megatron-LM's argument parser leaves them (the fields the import reads,
    plus a few of the others, including one of Megatron's enums)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=48,
        padded_vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        add_bias_linear=False,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=True,
        norm_epsilon=1e-5,
        init_method_std=0.02,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        attention_backend=AttnBackend.auto,
        tokenizer_model="/data/tokenizer.model",
        save="/ckpt",
    )


def save_legacy(
    root: Path, models: list[dict], iteration: int = 100, stages: list[list[dict]] | None = None
) -> Path:
    """What Megatron-LM's save_checkpoint writes with --ckpt-format torch: ``models`` per TP
    rank (mp_rank_XX), or ``stages[pp][tp]`` (mp_rank_XX_YYY)."""
    (root / "latest_checkpointed_iteration.txt").parent.mkdir(parents=True, exist_ok=True)
    ranks = {f"mp_rank_{t:02d}": m for t, m in enumerate(models)}
    for p, row in enumerate(stages or []):
        ranks.update({f"mp_rank_{t:02d}_{p:03d}": m for t, m in enumerate(row)})
    for rank_dir, model_state in ranks.items():
        directory = root / f"iter_{iteration:07d}" / rank_dir
        directory.mkdir(parents=True)
        state = {
            "args": megatron_args(len(models) or len(stages[0])),
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model_state,
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
            "opt_param_scheduler": {"num_steps": iteration},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {},
                }
            ],
            "num_floating_point_operations_so_far": 0,
        }
        torch.save(state, directory / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def mcore_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    length = tokens.size(1)
    positions = torch.arange(length).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, length, length), diagonal=1).bool()
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2)])
def test_import_matches_megatron_core_logits(
    megatron, tokenizer_file: Path, tmp_path: Path, tp: int, pp: int
) -> None:
    reference = build_mcore()
    if pp == 1:
        ckpt = save_legacy(tmp_path / "ckpt", tp_shards(reference, tp))
    else:
        stages = [tp_shards_of(s, tp) for s in pp_stages(reference.state_dict(), pp)]
        ckpt = save_legacy(tmp_path / "ckpt", [], stages=stages)
    out = tmp_path / "pkg"
    assert (
        main(["import", "megatron", str(ckpt), str(out), "--tokenizer", str(tokenizer_file)]) == 0
    )
    model, config, _ = load_model_package(out)
    assert (config.num_query_groups, config.tie_embeddings, config.style) == (2, False, "llama")
    x = tokens()
    ours, theirs = model(x), mcore_logits(reference, x)
    diff = (ours - theirs).abs().max().item()
    print(f"TP={tp} PP={pp}: max |logit difference| vs megatron-core {diff:.2e}")
    assert diff < ATOL, f"TP={tp} PP={pp}: logits differ from megatron-core's by {diff}"


def test_import_refuses_a_pickle_naming_code_and_never_runs_it(
    megatron, tokenizer_file: Path, tmp_path: Path
) -> None:
    from bad_checkpoints import WritesMarker

    ckpt = save_legacy(tmp_path / "ckpt", [build_mcore().state_dict()])
    marker = tmp_path / "pwned"
    path = ckpt / "iter_0000100/mp_rank_00/model_optim_rng.pt"
    state = {"args": megatron_args(1), "model": {"x": WritesMarker(marker)}}
    torch.save(state, path)
    with pytest.raises(MegatronImportError, match=r"outside the allow-list.*pathlib"):
        import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)
    assert not marker.exists()
    assert not (tmp_path / "pkg").exists()


def test_torch_dist_checkpoints_are_refused_with_the_reason(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    iteration = tmp_path / "ckpt" / "iter_0000100"
    iteration.mkdir(parents=True)
    (iteration / ".metadata").write_bytes(b"\x80\x04N.")
    (iteration / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(MegatronImportError, match=r"torch_dist .*\.metadata.*sandbox"):
        import_megatron(tmp_path / "ckpt", tmp_path / "pkg", tokenizer=tokenizer_file)


class _CallsNumpySave:
    """Unpickling this calls ``numpy.save(marker, 1)`` -- unless numpy.* names are bound to
    the inert placeholder, as the import does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (np.save, (str(self.marker), 1))


def test_allow_listed_names_are_inert_placeholders(
    megatron, tokenizer_file: Path, tmp_path: Path
) -> None:
    ckpt = save_legacy(tmp_path / "ckpt", [build_mcore().state_dict()])
    path = ckpt / "iter_0000100/mp_rank_00/model_optim_rng.pt"
    marker = tmp_path / "pwned.npy"
    state = {"args": megatron_args(1), "model": build_mcore().state_dict()}
    torch.save({**state, "rng_state": [_CallsNumpySave(marker)]}, path)
    assert "numpy.save" in torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    import_megatron(ckpt, tmp_path / "pkg", tokenizer=tokenizer_file)
    assert not marker.exists(), "numpy.save ran while unpickling"
    load_model_package(tmp_path / "pkg")
