"""Meta-device init (training.parallel.meta_init): a rank's shard is materialized one
parameter at a time and holds exactly the single-process model's weights, and the RNG
ends where one process building the whole model leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parallel_helpers import init_gloo

from megalith.config import LoRAConfig, MegalithConfig, MixedPrecisionConfig, ModelConfig
from training import models
from training.finetune.lora import apply_lora, initialize_shards, is_adapter_param
from training.finetune.session import load_base_weights
from training.parallel import tensor_parallel_training as tp
from training.parallel.groups import build_parallel_state
from training.parallel.meta_init import materialize_shard
from training.parallel.parallelize import build_fsdp_on_meta
from training.parallel.tensor_parallel.sharding import shard_full_state_dict
from training.precision.mixed import resolve_precision

WORLD = 2


def tiny(family: str = "gpt", style: str = "llama", **overrides) -> ModelConfig:
    values = {
        "family": family,
        "style": style,
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2 if style == "llama" and family == "gpt" else None,
        "vocab_size": 64,
        "max_position_embeddings": 32,
    }
    return ModelConfig(**{**values, **overrides})


CONFIGS = {
    "llama": tiny(),
    "gpt2": tiny(style="gpt2"),
    "llama untied": tiny(tie_embeddings=False),
    "moe": tiny(num_experts=4),
    "t5": tiny("t5", num_decoder_layers=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_replayed_init_equals_the_seeded_model_one_parameter_at_a_time(name):
    config = CONFIGS[name]
    torch.manual_seed(3)
    reference = models.build_model(config)
    expected_rng = torch.get_rng_state()

    torch.manual_seed(3)
    with torch.device("meta"):
        model = models.build_model(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    stats = materialize_shard(lambda: models.build_model(config), model, lambda n, t: t)

    assert torch.equal(torch.get_rng_state(), expected_rng)
    want = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    # Never more than one whole parameter at once: the model is never whole.
    assert stats.peak_bytes <= stats.largest_parameter_bytes < stats.model_bytes


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    base = MegalithConfig()
    config = base.model_copy(
        update={"parallel": base.parallel.model_copy(update={"tensor": world})}
    )
    state = build_parallel_state(config)
    errors = []
    for name, model_config in CONFIGS.items():  # MoE: router and experts whole on each rank
        torch.manual_seed(5)
        shard = tp.build_model(model_config, state, True, torch.device("cpu"))
        rng = torch.get_rng_state()
        torch.manual_seed(5)
        whole = models.build_model(model_config).state_dict()
        if not torch.equal(rng, torch.get_rng_state()):
            errors.append(f"{name}: RNG state differs from one process's")
        want = shard_full_state_dict(whole, model_config, state.tp_rank, world)
        for key, value in shard.state_dict().items():
            if not torch.equal(value, want[key]):
                errors.append(f"{name}: {key} differs from the single-process shard")
    errors += _fsdp_errors(rank, world)
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(errors))


def _fsdp_errors(rank: int, world: int) -> list[str]:
    """FSDP dp=``world``, built on meta (every family, and the llama in fp8): each rank's
    local rows equal the rows of the seeded one-process model, the RNG ends where one
    process leaves it, and no more than one whole parameter (less than the model) existed
    at once."""
    base = MegalithConfig()
    config = base.model_copy(
        update={"parallel": base.parallel.model_copy(update={"data_parallel_mode": "fsdp"})}
    )
    state = build_parallel_state(config)
    cpu = torch.device("cpu")
    fp8 = MixedPrecisionConfig(dtype="bf16", fp8=True)
    builds = {name: (model_config, None) for name, model_config in CONFIGS.items()}
    builds["llama fp8"] = (CONFIGS["llama"], fp8)
    errors = []
    for name, (model_config, mixed) in builds.items():
        torch.manual_seed(5)
        precision = resolve_precision(mixed, cpu) if mixed else None
        model, stats = build_fsdp_on_meta(model_config, state, cpu, mixed, precision)
        rng = torch.get_rng_state()
        torch.manual_seed(5)
        whole = dict(models.build_model(model_config).named_parameters())
        if not torch.equal(rng, torch.get_rng_state()):
            errors.append(f"fsdp {name}: RNG state differs from one process's")
        for key, param in model.named_parameters():
            rows = whole[key].detach().chunk(world)[rank] if param.dim() else whole[key]
            if not torch.equal(param.to_local(), rows):
                errors.append(f"fsdp {name}: {key} rows differ from the single-process rows")
        if not stats.peak_bytes <= stats.largest_parameter_bytes < stats.model_bytes:
            errors.append(f"fsdp {name}: held {stats} while building")
        float8 = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
        if bool(mixed) != bool(float8):
            errors.append(f"fsdp {name}: float8 linears {float8} with fp8={bool(mixed)}")
    errors += _fine_tune_base_errors(state, rank, world)
    errors += _lora_errors(state, rank, world)
    errors += _te_kernel_errors(state, rank, world)
    errors += _expert_parallel_errors(rank, world)
    return errors


def _expert_parallel_errors(rank: int, world: int) -> list[str]:
    """EP=``world`` (any data-parallel mode) built on meta: each rank holds its experts'
    rows of the seeded one-process model and the dense weights whole, and the RNG ends
    where one process leaves it."""
    from training.parallel import expert_parallel_training as ep

    model_config = CONFIGS["moe"]
    config = MegalithConfig(model=model_config.model_dump(), parallel={"expert": world})
    state = build_parallel_state(config)
    torch.manual_seed(5)
    model = ep.build_model(model_config, state, False, torch.device("cpu"))
    rng = torch.get_rng_state()
    torch.manual_seed(5)
    whole = dict(models.build_model(model_config).named_parameters())
    errors = [] if torch.equal(rng, torch.get_rng_state()) else ["ep: RNG state differs"]
    for key, param in model.named_parameters():
        want = whole[key].detach()
        if ".experts." in key:
            want = want.chunk(world)[rank]
        if not torch.equal(param.detach(), want):
            errors.append(f"ep: {key} differs from the single-process rows")
    return errors


def _te_kernel_errors(state, rank: int, world: int) -> list[str]:
    """FSDP over Transformer Engine kernels (tests/test_te_tensor_parallel.py's stand-in
    for TE's modules) is built on meta too: the TE modules own the torch backend's
    parameters and init, so each rank's rows are the seeded torch model's, and the
    engines then run on the gathered weights (the loss is one process's)."""
    from test_te_tensor_parallel import _StandInTE
    from test_te_tensor_parallel import engines as te_engines

    from training.models import backend as backend_module
    from training.models.te_backend import TransformerEngineBackend
    from training.parallel.parallelize import _fsdp_builds_on_meta

    saved = backend_module.transformer_engine_available, backend_module.BACKENDS["te"]
    backend_module.transformer_engine_available = lambda: True
    backend_module.BACKENDS["te"] = lambda: TransformerEngineBackend(
        te=lambda: _StandInTE, devices=("cpu",)
    )
    try:
        te_config = CONFIGS["llama"].model_copy(update={"backend": "te"})
        fsdp = MegalithConfig(parallel={"data_parallel_mode": "fsdp"})
        if not _fsdp_builds_on_meta(fsdp, te_config, state):
            return ["fsdp te: not built on meta"]
        torch.manual_seed(5)
        model, stats = build_fsdp_on_meta(te_config, state, torch.device("cpu"))
        torch.manual_seed(5)
        whole = models.build_model(CONFIGS["llama"])
        errors = [
            f"fsdp te: {key} rows differ from the torch backend's seeded rows"
            for key, param in model.named_parameters()
            if not torch.equal(
                param.to_local(), dict(whole.named_parameters())[key].chunk(world)[rank]
            )
        ]
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got, want = model(tokens[:, :-1], tokens[:, 1:]), whole(tokens[:, :-1], tokens[:, 1:])
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            errors.append(f"fsdp te: loss {got.item()} against one process's {want.item()}")
        engines = te_engines(model)
        built = [engine for engine in engines if engine.module is not None]
        if len(built) != 3 * CONFIGS["llama"].num_layers:  # qkv, proj, MLP; fp32 attention: SDPA
            errors.append(f"fsdp te: {len(built)} of {len(engines)} engines ran")
        if not stats.peak_bytes <= stats.largest_parameter_bytes < stats.model_bytes:
            errors.append(f"fsdp te: held {stats} while building")
        return errors
    finally:
        backend_module.transformer_engine_available, backend_module.BACKENDS["te"] = saved


def _fine_tune_base_errors(state, rank: int, world: int) -> list[str]:
    """A full fine-tune's base loaded into the model FSDP built on meta: each rank holds
    exactly its rows of every base tensor."""
    model_config = CONFIGS["llama"]
    model, _ = build_fsdp_on_meta(model_config, state, torch.device("cpu"))
    torch.manual_seed(11)  # a base unlike the replayed init
    base = {n: p.detach() for n, p in models.build_model(model_config).named_parameters()}
    load_base_weights(model, base, state)
    return [
        f"fine-tune base {key}: rank {rank} rows differ from the base's"
        for key, param in model.named_parameters()
        if not torch.equal(
            param.to_local(), base[key].chunk(world)[rank] if param.dim() else base[key]
        )
    ]


def _lora_errors(state, rank: int, world: int) -> list[str]:
    """A LoRA fine-tune under FSDP built on meta: adapters added on meta and sharded with
    the frozen base; the replay held at most one whole parameter (never the model) and
    left the RNG where one process leaves it; then each rank's rows of the base and of
    the seeded adapters equal those of one process's model with :func:`apply_lora`."""
    model_config, lora = CONFIGS["llama"], LoRAConfig(rank=4, alpha=8)
    torch.manual_seed(5)
    model, stats = build_fsdp_on_meta(model_config, state, torch.device("cpu"), lora=lora)
    errors = (
        []
        if stats.peak_bytes <= stats.largest_parameter_bytes < stats.model_bytes
        else [f"fsdp lora: held {stats} while building"]
    )
    rng = torch.get_rng_state()
    torch.manual_seed(11)  # the base
    whole = models.build_model(model_config)
    base = {n: p.detach().clone() for n, p in whole.named_parameters()}
    load_base_weights(model, base, state, lambda n: not is_adapter_param(n))
    initialize_shards(model, 7, state)
    apply_lora(whole, lora, 7)
    torch.manual_seed(5)
    models.build_model(model_config)
    if not torch.equal(rng, torch.get_rng_state()):
        errors.append("fsdp lora: RNG state differs from one process's")
    want = dict(whole.named_parameters())
    for key, param in model.named_parameters():
        rows = want[key].detach().chunk(world)[rank] if param.dim() else want[key]
        if (
            not torch.equal(param.to_local(), rows)
            or param.requires_grad != want[key].requires_grad
        ):
            errors.append(f"fsdp lora: {key} rows differ from one process's (or its freezing)")
    if not any(is_adapter_param(key) for key, _ in model.named_parameters()):
        errors.append("fsdp lora: no adapters")
    return errors


def test_tensor_parallel_and_fsdp_shards_equal_the_single_process_model_shards(tmp_path):
    mp.spawn(_worker, args=(WORLD, str(tmp_path)), nprocs=WORLD, join=True)
    errors = [e for r in range(WORLD) for e in json.loads((tmp_path / f"rank{r}.json").read_text())]
    assert not errors, "\n".join(errors)
