"""Tensor and sequence parallelism with the Transformer Engine backend
(training/parallel/te_tensor_parallel.py), in two halves like tests/test_te_backend.py.

Wiring, on any machine: two gloo processes build the model with
``TETensorParallelBackend`` over a stand-in for TE's tensor-parallel modules (a few
lines of torch with TE 2.x's constructor arguments and its collectives: inputs flattened
to ``[tokens, features]``, the sequence all-gathered and reduce-scattered along that
first dimension, the row-parallel bias added after the reduction, replicated parameters'
gradients left unreduced). Against the single-process torch model with the same weights
(fp32): the loss, every gradient as the slice of the whole gradient, the split
parameters (the names and boxes of sharded checkpoints), and that every engine ran on
the model's own parameters. It proves our layout changes and SP reductions around
TE's modules, not TE's kernels.

Real Transformer Engine, marked ``gpu``: the same two processes on one GPU (gloo with
CUDA tensors: NCCL refuses two ranks on one device), TE TP=2 against TE TP=1 holding
the same weights, in bf16 and under fp8 (TE recipes ``tensorwise`` = Float8CurrentScaling
and ``delayed`` = DelayedScaling), with and without SP. Each side's error is measured
against the fp32 torch model; TP=2 must be as close to it as TP=1 is (within 1.5× its
error plus 2e-3), and the direct TP=2 vs TP=1 gap is reported. Figures:
benchmarks/RESULTS.md ("Transformer Engine tensor parallelism").
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from parallel_helpers import init_gloo, mismatch
from test_te_backend import _DotProductAttention, _LayerNormMLP, stand_in_norm
from torch import nn

from megalith.config import ModelConfig, load_config
from megalith.errors import MegalithError
from training.models import GPTModel, TorchBackend, layers
from training.models import backend as backend_module
from training.models.te_backend import TEAttention, TEFusedMLP, TransformerEngineBackend
from training.models.tp_backend import TensorParallelBackend
from training.parallel.data_parallel import shard_model
from training.parallel.groups import ParallelSizes, build_parallel_state
from training.parallel.support import check_trainer_support
from training.parallel.te_tensor_parallel import (
    CommOverlap,
    TETensorParallelBackend,
    sequence_from_te,
    sequence_to_te,
    tensor_parallel_backend,
)
from training.parallel.tensor_parallel import (
    partition_spec,
    shard_full_state_dict,
    tensor_parallel_partition,
)
from training.parallel.tensor_parallel.mappings import (
    _GatherReduceScatter,
    _ReduceScatter,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)

WORLD = 2
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}


# --- a stand-in for TE's tensor-parallel modules ------------------------------------------


class _ParallelLinear(nn.Module):
    """``te.Linear``'s tensor-parallel contract: global sizes in, local weights; column:
    the input copied (no SP) or all-gathered along the flattened first dimension (SP);
    row: the output all-reduced or reduce-scattered, then the bias added."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda",
                 parallel_mode=None, tp_group=None, tp_size=1, sequence_parallel=False,
                 **userbuffers):  # fmt: skip
        super().__init__()
        self.mode, self.group, self.sp = parallel_mode, tp_group, sequence_parallel
        self.userbuffers = userbuffers  # TE's ub_* arguments: same math, other schedule
        out_local = out_features // tp_size if parallel_mode == "column" else out_features
        in_local = in_features // tp_size if parallel_mode == "row" else in_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local, device=device))
        self.bias = nn.Parameter(torch.empty(out_local, device=device)) if bias else None

    def _input(self, x):
        if self.mode == "column":
            gather = _GatherReduceScatter.apply(x, 0, self.group) if self.sp else None
            return gather if self.sp else copy_to_tensor_parallel_region(x, self.group)
        return x

    def _linear(self, x2d, shape):
        if self.mode != "row":
            return F.linear(self._input(x2d), self.weight, self.bias).view(
                -1, *shape[1:-1], self.weight.size(0)
            )
        y = F.linear(x2d, self.weight)
        y = (
            _ReduceScatter.apply(y, 0, self.group)
            if self.sp
            else reduce_from_tensor_parallel_region(y, self.group)
        )
        y = y if self.bias is None else y + self.bias
        return y.view(-1, *shape[1:-1], y.size(-1))  # fmt: skip

    def forward(self, x):
        return self._linear(x.reshape(-1, x.size(-1)), x.shape)


class _ParallelLayerNormLinear(_ParallelLinear):
    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 params_dtype=None, device="cuda", **parallel):  # fmt: skip
        super().__init__(in_features, out_features, bias, params_dtype, device, **parallel)
        self.eps, self.normalization = eps, normalization
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features, device=device))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(in_features, device=device))

    def forward(self, x):
        x2d = stand_in_norm(self, x.reshape(-1, x.size(-1)))
        return self._linear(x2d, x.shape)


class _StandInTE:
    Linear = _ParallelLinear
    LayerNormLinear = _ParallelLayerNormLinear
    LayerNormMLP = _LayerNormMLP
    DotProductAttention = _DotProductAttention


def tiny(style: str) -> ModelConfig:
    values = dict(
        style=style, num_layers=2, hidden_size=32, num_attention_heads=4,
        num_query_groups=2 if style == "llama" else None, ffn_hidden_size=48, vocab_size=96,
        max_position_embeddings=32,
    )  # fmt: skip
    return ModelConfig(**values)


@dataclass(frozen=True)
class Layout:
    style: str
    sequence_parallel: bool

    @property
    def id(self) -> str:
        return f"{self.style} tp{WORLD}" + ("+sp" if self.sequence_parallel else "")


LAYOUTS = [Layout(s, sp) for s in ("llama", "gpt2") for sp in (False, True)]


def engines(model: nn.Module) -> list:
    """The engines that run ``model``: a fused MLP's in place of its fc1's and fc2's."""
    fused = [m for m in model.modules() if isinstance(m.__dict__.get("fused"), TEFusedMLP)]
    skipped = {id(part) for mlp in fused for part in (mlp.fc1, mlp.fc2)}
    mine = [m for m in model.modules() if "_engine" in m.__dict__ and id(m) not in skipped]
    return [mlp.fused.engine for mlp in fused] + [m.__dict__["_engine"] for m in mine]


def _check_stand_in(layout: Layout, group: dist.ProcessGroup) -> list[str]:
    config = tiny(layout.style)
    rank = dist.get_rank(group)
    where = f"{layout.id} rank {rank}"
    torch.manual_seed(0)
    full = GPTModel(config, TorchBackend())
    backend = TETensorParallelBackend(group, layout.sequence_parallel, te=lambda: _StandInTE,
                                      devices=("cpu",))  # fmt: skip
    model = GPTModel(config, backend)
    plain = GPTModel(config, TensorParallelBackend(group, layout.sequence_parallel))
    failures = []
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if shapes != {n: tuple(p.shape) for n, p in plain.state_dict().items()}:
        failures.append(f"{where}: state dict differs from the tensor-parallel backend's")
    expected_split = {n: s for n, _ in model.named_parameters() if (s := partition_spec(n, config))}
    if tensor_parallel_partition(model) != expected_split:
        failures.append(f"{where}: split parameters {tensor_parallel_partition(model)}")
    model.load_state_dict(shard_full_state_dict(full.state_dict(), config, rank, WORLD))

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (3, 16), generator=generator)
    labels = torch.randint(0, config.vocab_size, (3, 16), generator=generator)
    expected, got = full(tokens, labels), model(tokens, labels)
    failures += mismatch(f"{where}: loss", got, expected, LOSS_TOL)
    expected.backward()
    got.backward()
    built = [engine.module for engine in engines(model) if engine.module is not None]
    if len(built) != 3 * config.num_layers:  # qkv, proj, the MLP; fp32 attention is SDPA
        failures.append(f"{where}: engines built: {built}")
    qkv = model.layers[0].attention.qkv
    if qkv._engine.module.weight is not qkv.linear.weight:
        failures.append(f"{where}: the QKV engine does not hold the model's weight")
    whole = shard_full_state_dict(
        {n: p.grad for n, p in full.named_parameters()}, config, rank, WORLD
    )
    for name, param in model.named_parameters():
        failures += mismatch(f"{where}: gradient of {name}", param.grad, whole[name], GRAD_TOL)
    return failures


# TE's userbuffers arguments per GEMM of a block (parallel.tp_comm_overlap).
OVERLAPPED = {
    "attention.qkv": dict(
        ub_name="qkv", ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True
    ),
    "attention.proj": dict(ub_name="proj", ub_overlap_rs=True, ub_overlap_ag=True),
    "mlp.fc1": dict(ub_name="fc1", ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    "mlp.fc2": dict(ub_name="fc2", ub_overlap_rs=True, ub_overlap_ag=True),
}
# te.LayerNormMLP names its GEMMs fc1_* / fc2_* itself and takes both linears' overlaps.
FUSED_MLP_OVERLAP = dict(
    ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_overlap_rs=True
)


def _overlapped_engines(layer: nn.Module) -> dict[str, tuple]:
    """A block's engines that training forwards run, each with the userbuffers arguments
    it must have been built with: the fused MLP's in place of fc1's and fc2's."""
    fused = layer.mlp.__dict__.get("fused")
    expected = dict(OVERLAPPED)
    if isinstance(fused, TEFusedMLP):
        del expected["mlp.fc1"], expected["mlp.fc2"]
        found = {"mlp": (fused.engine, FUSED_MLP_OVERLAP)}
    else:
        found = {}
    for path, arguments in expected.items():
        found[path] = (layer.get_submodule(path).__dict__["_engine"], arguments)
    return found


def _check_comm_overlap(style: str) -> list[str]:
    """``parallel.tp_comm_overlap`` over the stand-in (TP=2 + SP): training forwards run
    engines built with TE's userbuffers arguments, named as TE's tables name a block's
    GEMMs, with one process's loss and gradients; a forward without gradients of another
    shape (validation) runs the plain engines; a training forward of another shape is
    refused, naming the keys."""
    config, group = tiny(style), dist.group.WORLD
    rank = dist.get_rank(group)
    where = f"{style} overlap rank {rank}"
    torch.manual_seed(0)
    full = GPTModel(config, TorchBackend())
    overlap = CommOverlap(tokens=3 * 16, hidden=config.hidden_size)
    backend = TETensorParallelBackend(
        group, True, te=lambda: _StandInTE, devices=("cpu",), overlap=overlap
    )
    model = GPTModel(config, backend)
    model.load_state_dict(shard_full_state_dict(full.state_dict(), config, rank, WORLD))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (3, 16), generator=generator)
    labels = torch.randint(0, config.vocab_size, (3, 16), generator=generator)
    expected, got = full(tokens, labels), model(tokens, labels)
    failures = mismatch(f"{where}: loss", got, expected, LOSS_TOL)
    expected.backward()
    got.backward()
    whole = shard_full_state_dict(
        {n: p.grad for n, p in full.named_parameters()}, config, rank, WORLD
    )
    for name, param in model.named_parameters():
        failures += mismatch(f"{where}: gradient of {name}", param.grad, whole[name], GRAD_TOL)
    if style == "llama" and "mlp" not in _overlapped_engines(model.layers[0]):
        failures.append(f"{where}: the SwiGLU MLP did not run as one te.LayerNormMLP")
    for index, layer in enumerate(model.layers):
        for path, (engine, arguments) in _overlapped_engines(layer).items():
            ran = engine.overlap_module
            if ran is None or ran.userbuffers != arguments or engine.module is not None:
                failures.append(f"{where}: layer {index} {path} ran {ran and ran.userbuffers}")

    model.eval()
    with torch.no_grad():  # validation: another shape, the plain engines
        short, short_labels = tokens[:1, :8], labels[:1, :8]
        failures += mismatch(
            f"{where}: no-grad loss",
            model(short, short_labels),
            full(short, short_labels),
            LOSS_TOL,
        )
    for path, (engine, _) in _overlapped_engines(model.layers[0]).items():
        plain = engine.module
        if plain is None or plain.userbuffers:
            failures.append(
                f"{where}: the no-grad forward ran {path} {plain and plain.userbuffers}"
            )
    model.train()
    try:
        model(tokens[:1], labels[:1])
        failures.append(f"{where}: a training forward of 16 tokens ran over 48-token buffers")
    except MegalithError as error:
        if "training.micro_batch_size x data.seq_length" not in str(error):
            failures.append(f"{where}: {error}")
    return failures


def _check_fsdp_over_engines(style: str) -> list[str]:
    """FSDP over the data ranks (the trainer's ``shard_model``) of a model whose linears
    run TE engines (the stand-in): FSDP swaps gathered weights into the modules before
    each forward and backward, so the engines must read those and write their gradients,
    which FSDP reduce-scatters into the shards."""
    config, rank = tiny(style), dist.get_rank()
    where = f"{style} fsdp{WORLD} over TE engines rank {rank}"
    torch.manual_seed(0)
    full = GPTModel(config, TorchBackend())
    model = GPTModel(config, TransformerEngineBackend(te=lambda: _StandInTE, devices=("cpu",)))
    model.load_state_dict(full.state_dict())
    shard_model(
        model, build_parallel_state(load_config(None, ["parallel.data_parallel_mode=fsdp"]))
    )
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2 * WORLD, 16), generator=generator)
    labels = torch.randint(0, config.vocab_size, (2 * WORLD, 16), generator=generator)
    mine = slice(2 * rank, 2 * rank + 2)  # each rank its own samples; FSDP averages
    got = model(tokens[mine], labels[mine])
    failures = mismatch(f"{where}: loss", got, full(tokens[mine], labels[mine]), LOSS_TOL)
    full.zero_grad()
    full(tokens, labels).backward()  # the whole batch: the mean of the ranks' losses
    got.backward()
    built = [engine.module for engine in engines(model) if engine.module is not None]
    if len(built) != 3 * config.num_layers:  # qkv, proj, the MLP
        failures.append(f"{where}: engines built: {len(built)}")
    whole = dict(full.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor()
        failures += mismatch(f"{where}: gradient of {name}", grad, whole[name].grad, GRAD_TOL)
    return failures


FSDP_STYLES = ("llama", "gpt2")


def _check_te_tensor_parallel_build(style: str) -> list[str]:
    """The trainer's TP build (``tensor_parallel_training.build_model``) with TE kernels
    (the stand-in): on meta, then each TP shard materialized from a replay of the
    single-device init, as with the torch kernels: the shards of the seeded torch model,
    and the RNG left where one process leaves it."""
    from training.parallel import tensor_parallel_training as tp

    config, rank = tiny(style), dist.get_rank()
    where = f"{style} tp{WORLD} TE build rank {rank}"
    saved = backend_module.transformer_engine_available, backend_module.BACKENDS["te"]
    backend_module.transformer_engine_available = lambda: True
    backend_module.BACKENDS["te"] = lambda: TransformerEngineBackend(
        te=lambda: _StandInTE, devices=("cpu",)
    )
    try:
        state = build_parallel_state(load_config(None, [f"parallel.tensor={WORLD}"]))
        te_config = config.model_copy(update={"backend": "te"})
        torch.manual_seed(5)
        model = tp.build_model(te_config, state, False, torch.device("cpu"))
        rng = torch.get_rng_state()
    finally:
        backend_module.transformer_engine_available, backend_module.BACKENDS["te"] = saved
    torch.manual_seed(5)
    whole = GPTModel(config, TorchBackend()).state_dict()
    failures = [] if torch.equal(rng, torch.get_rng_state()) else [f"{where}: RNG state"]
    if not isinstance(model.backend, TETensorParallelBackend):
        failures.append(f"{where}: built with {type(model.backend).__name__}")
    want = shard_full_state_dict(whole, config, rank, WORLD)
    for name, value in model.state_dict().items():
        if not torch.equal(value, want[name]):
            failures.append(f"{where}: {name} is not the seeded model's shard")
    return failures


def _cpu_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    results = {}
    try:
        for layout in LAYOUTS:
            try:
                results[layout.id] = _check_stand_in(layout, dist.group.WORLD)
            except Exception:
                results[layout.id] = [traceback.format_exc()]
        for style in FSDP_STYLES:
            for label, check in (
                ("fsdp", _check_fsdp_over_engines),
                ("build", _check_te_tensor_parallel_build),
                ("overlap", _check_comm_overlap),
            ):
                try:
                    results[f"{style} {label}"] = check(style)
                except Exception:
                    results[f"{style} {label}"] = [traceback.format_exc()]
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def stand_in_results(tmp_path_factory) -> list[dict[str, list[str]]]:
    out_dir = tmp_path_factory.mktemp("te_tensor_parallel")
    mp.spawn(_cpu_worker, args=(WORLD, str(out_dir)), nprocs=WORLD, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("layout", [layout.id for layout in LAYOUTS])
def test_te_tensor_parallel_wiring_matches_one_process(stand_in_results, layout: str) -> None:
    """Loss, gradients (as slices of the whole ones) and split parameters of the TE
    tensor-parallel model over the stand-in, against one process's torch model."""
    failures = [line for by_layout in stand_in_results for line in by_layout[layout]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("style", FSDP_STYLES)
def test_fsdp_over_te_engines_matches_one_process(stand_in_results, style: str) -> None:
    """FSDP2 over TE engines (the stand-in) on 2 gloo ranks: each rank's loss, and every
    reduce-scattered gradient (gathered) against one process on the whole batch. On GPUs
    with the real TE, FSDP × TP and FSDP × PP: benchmarks/RESULTS.md."""
    failures = [line for by_rank in stand_in_results for line in by_rank[f"{style} fsdp"]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("style", FSDP_STYLES)
def test_te_tensor_parallel_shards_are_materialized_from_the_replayed_init(
    stand_in_results, style: str
) -> None:
    """TE TP=2 (the stand-in) built on meta and materialized from the replayed init (no
    whole model built first): each rank's shard is the seeded single-device model's."""
    failures = [line for by_rank in stand_in_results for line in by_rank[f"{style} build"]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("style", FSDP_STYLES)
def test_te_communication_overlap_engines_match_one_process(stand_in_results, style: str) -> None:
    """``parallel.tp_comm_overlap`` over the stand-in: training forwards run engines with
    TE's userbuffers arguments (qkv/proj, and fc1/fc2 or the fused MLP: llama's runs as
    one ``te.LayerNormMLP``) and match one process; validation of
    another shape runs the plain engines; a training micro-batch of another shape is
    refused. Speed and parity with the real TE on GPUs: benchmarks/RESULTS.md."""
    failures = [line for by_rank in stand_in_results for line in by_rank[f"{style} overlap"]]
    assert not failures, "\n".join(failures)


def test_sequence_layout_round_trip() -> None:
    """TE's rank-major ``[tp·B, T/tp, F]`` and our ``[B, T, F]``: ``sequence_to_te``
    puts rank ``r``'s sequence shard of every sample in block ``r``, ``sequence_from_te``
    undoes it."""
    x = torch.arange(2 * 8 * 3).view(2, 8, 3)
    te = sequence_to_te(x, 4)
    assert te.shape == (8, 2, 3)
    assert torch.equal(te[1 * 2 + 0], x[0, 2:4]) and torch.equal(te[3 * 2 + 1], x[1, 6:8])
    assert torch.equal(sequence_from_te(te, 4), x)


def test_te_kernels_get_te_tensor_parallel_modules(monkeypatch) -> None:
    """The trainer's hook: ``model.backend`` te -> TE's TP modules (same provider and
    devices), torch -> the Megatron-style layers."""
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: True)
    kernels = TransformerEngineBackend(te=lambda: _StandInTE, devices=("cpu",))
    group = object()  # not used before a module is built
    te = tensor_parallel_backend(kernels, group, True)
    assert isinstance(te, TETensorParallelBackend) and te.sequence_parallel
    assert te.te is kernels.te and te.devices == ("cpu",) and te.name == "te"
    plain = tensor_parallel_backend(TorchBackend(), group, False)
    assert type(plain) is TensorParallelBackend


def test_an_sdpa_kernel_asked_for_replaces_te_attention_under_tensor_parallelism() -> None:
    """``model.attention_backend`` other than ``auto`` with TE's tensor-parallel modules:
    this rank's heads run SDPA (forked RNG as the torch TP backend's), not TE's attention."""
    backend = TETensorParallelBackend(object(), True, te=lambda: _StandInTE, devices=("cpu",))
    asked = backend.core_attention(4, 2, 8, dropout=0.0, attention_backend="cudnn")
    own = backend.core_attention(4, 2, 8, dropout=0.0)
    assert type(asked.module) is layers.SDPAttention, asked
    assert isinstance(own.module, TEAttention), own


def test_fp8_with_tensor_parallelism_is_accepted_with_either_backend() -> None:
    """TE's tensor-parallel modules run its fp8 recipes, and torchao's float8 matmul runs
    through our tensor-parallel linears (tests/test_fp8.py trains it), so neither pairing
    is refused at launch any more."""

    def fp8(backend: str):
        values = [
            "mixed_precision.fp8=true",
            "model.num_query_groups=2",
            f"model.backend={backend}",
        ]
        return load_config(None, values)

    for backend in ("te", "torch", "auto"):
        check_trainer_support(fp8(backend), ParallelSizes(tp=2))  # raises if refused


# --- The real Transformer Engine on one GPU (gpu) -----------------------------------------

needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or not backend_module.transformer_engine_available(),
    reason="needs transformer_engine and a CUDA GPU",
)
PRECISIONS = ("bf16", "fp8-tensorwise", "fp8-delayed")
FP8_ITERATIONS = 3  # delayed scaling uses the amax history of the iterations before
RELATIVE_SLACK, ABSOLUTE_SLACK = 1.5, 2e-3


def gpu_config() -> ModelConfig:
    # head_dim 32; every GEMM dimension a multiple of 16 on each rank (fp8)
    return ModelConfig(
        style="llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=512, vocab_size=512, max_position_embeddings=128,
    )  # fmt: skip


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


def _collective_support(group: dist.ProcessGroup) -> dict[str, str]:
    """Which of the collectives TE's TP modules call run on gloo with CUDA tensors."""
    x = torch.arange(4.0, device="cuda") + dist.get_rank(group)
    probes = {
        "all_reduce": lambda: dist.all_reduce(x.clone(), group=group),
        "all_reduce max": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX, group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            x.new_empty(4 * WORLD), x, group=group
        ),
        "all_gather_into_tensor uint8": lambda: dist.all_gather_into_tensor(
            torch.empty(4 * WORLD, dtype=torch.uint8, device="cuda"),
            x.to(torch.uint8),
            group=group,
        ),  # fmt: skip
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            x.new_empty(4 // WORLD), x, group=group
        ),
    }
    support = {}
    for name, probe in probes.items():
        try:
            probe()
            support[name] = "ok"
        except Exception as error:  # recorded: the report says what gloo lacks
            support[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return support


def _all_gather_by_all_reduce(output, x, group=None, async_op=False):
    """``all_gather_into_tensor`` through a sum (for a gloo without it on CUDA tensors)."""
    output.zero_()
    output.view(-1, *x.shape)[dist.get_rank(group)].copy_(x)
    return dist.all_reduce(output, group=group, async_op=async_op)


def _reduce_scatter_by_all_reduce(output, x, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``reduce_scatter_tensor`` through an all-reduce (likewise)."""
    total = x.clone()
    dist.all_reduce(total, op=op, group=group)
    output.copy_(total.view(-1, *output.shape)[dist.get_rank(group)])


def _emulate_missing(support: dict[str, str]) -> None:
    """Where gloo lacks a collective on CUDA tensors, TE (which looks them up on
    ``torch.distributed`` at each call) and our mappings get it built from all-reduce."""
    from training.parallel.tensor_parallel import mappings

    if support["all_gather_into_tensor"] != "ok":
        dist.all_gather_into_tensor = mappings._ALL_GATHER = _all_gather_by_all_reduce
    if support["reduce_scatter_tensor"] != "ok":
        dist.reduce_scatter_tensor = mappings._REDUCE_SCATTER = _reduce_scatter_by_all_reduce


def _step(model, tokens, labels, precision: str, fp8_context) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "fp32"):
        if fp8_context is None:
            loss = model(tokens, labels)
        else:
            with fp8_context():
                loss = model(tokens, labels)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _te_case(precision: str, sp: bool, group: dist.ProcessGroup) -> dict:
    from training.precision.fp8 import te_fp8_context

    config, rank = gpu_config(), dist.get_rank(group)
    torch.manual_seed(0)
    reference = GPTModel(config, TorchBackend()).cuda()
    one = GPTModel(config, TransformerEngineBackend()).cuda()
    one.load_state_dict(reference.state_dict())
    two = GPTModel(config, TETensorParallelBackend(group, sp)).cuda()
    two.load_state_dict(shard_full_state_dict(reference.state_dict(), config, rank, WORLD))
    fp8 = None if precision == "bf16" else te_fp8_context(precision.removeprefix("fp8-"))

    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (4, 129), generator=generator) for _ in range(FP8_ITERATIONS)]  # fmt: skip
    for batch in batches if fp8 else batches[:1]:
        tokens, labels = batch[:, :-1].cuda(), batch[:, 1:].cuda()
        exact = _step(reference, tokens, labels, "fp32", None)
        tp1 = _step(one, tokens, labels, precision, fp8)
        tp2 = _step(two, tokens, labels, precision, fp8)
    shard = lambda grads: shard_full_state_dict(grads, config, rank, WORLD)  # noqa: E731
    exact_grads, tp1_grads = shard(exact[1]), shard(tp1[1])
    report = {"loss fp32": exact[0], "loss tp1": tp1[0], "loss tp2": tp2[0], "grads": {}}
    for name, grad in tp2[1].items():
        report["grads"][name] = {
            "tp1 vs fp32": relative_error(tp1_grads[name], exact_grads[name]),
            "tp2 vs fp32": relative_error(grad, exact_grads[name]),
            "tp2 vs tp1": relative_error(grad, tp1_grads[name]),
        }
    te = __import__("transformer_engine.pytorch", fromlist=["Linear"])
    built = [e.module for e in engines(two) if e.module is not None]
    report["engines"] = sorted({type(m).__name__ for m in built})
    linears = [m for m in built if isinstance(m, (te.Linear, te.LayerNormLinear, te.LayerNormMLP))]
    report["tp_engines"] = sum(m.tp_size == WORLD for m in linears)
    report["fp8_engines"] = sum(bool(m.fp8) for m in linears)
    report["sp_engines"] = sum(bool(m.sequence_parallel) for m in linears)
    report["linears"] = len(linears)
    return report


def _gpu_worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    torch.cuda.set_device(0)
    results: dict = {"collectives": _collective_support(dist.group.WORLD)}
    _emulate_missing(results["collectives"])
    try:
        for precision in PRECISIONS:
            for sp in (False, True):
                case = f"{precision}" + (" sp" if sp else "")
                try:
                    results[case] = _te_case(precision, sp, dist.group.WORLD)
                except Exception:
                    results[case] = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def te_results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("te_tp_gpu")
    mp.spawn(_gpu_worker, args=(WORLD, str(out_dir)), nprocs=WORLD, join=True)
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    if os.environ.get("OUT"):  # the device tool's output folder: keep the measurements
        Path(os.environ["OUT"], "te_tensor_parallel.json").write_text(json.dumps(results))
    print("gloo with CUDA tensors:", results[0]["collectives"])
    return results


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_real_te_tensor_parallel_matches_te_at_tp1(te_results, precision: str, sp: bool) -> None:
    """TE TP=2 (TE's own column/row-parallel LayerNormLinear and Linear with the TP group)
    against TE TP=1 with the same weights: the loss and every gradient are as close to
    the fp32 model as TP=1's are."""
    case = f"{precision}" + (" sp" if sp else "")
    for rank, results in enumerate(te_results):
        entry = results[case]
        assert "error" not in entry, f"rank {rank}: {entry.get('error')}"
        assert entry["linears"] == 3 * gpu_config().num_layers  # qkv, proj, the fused MLP
        assert entry["tp_engines"] == entry["linears"]  # every linear is TE's TP module
        assert entry["fp8_engines"] == (0 if precision == "bf16" else entry["linears"])
        assert entry["sp_engines"] == (entry["linears"] if sp else 0)
        loss_gap = abs(entry["loss tp2"] - entry["loss tp1"])
        loss_error = abs(entry["loss tp1"] - entry["loss fp32"])
        worst = {k: max(g[k] for g in entry["grads"].values()) for k in next(iter(entry["grads"].values()))}  # fmt: skip
        print(f"{case} rank {rank}: loss fp32 {entry['loss fp32']:.5f} tp1 {entry['loss tp1']:.5f} "
              f"tp2 {entry['loss tp2']:.5f}; worst gradient error {worst}")  # fmt: skip
        assert loss_gap <= RELATIVE_SLACK * loss_error + ABSOLUTE_SLACK * entry["loss fp32"]
        for name, errors in entry["grads"].items():
            limit = RELATIVE_SLACK * errors["tp1 vs fp32"] + ABSOLUTE_SLACK
            assert errors["tp2 vs fp32"] <= limit, (name, errors)
