"""Tensor and sequence parallelism against the single-process model.

The multi-process checks run once per module: two processes (gloo over loopback, a
file rendezvous, so no port is needed) build every layout, compare it with the
single-device model holding the same weights, and write what diverged to one JSON
file per rank; each test below then reports its own part, naming the layout, the
rank and the step or parameter that diverged.

Tolerances (fp32): losses and logits, at the first forward and at every step of
K=3 AdamW steps (lr 1e-3), within rtol 1e-5 / atol 1e-5 (measured: 5e-7 at most);
gradients of one backward within rtol 1e-4 / atol 1e-6 (TP sums partial products in
another order); after the K steps each weight within 1% (L2) of its total update,
since AdamW's ``m / sqrt(v)`` turns last-bit differences of near-zero gradients into
update differences of up to ~lr per element. Under bf16 autocast (one check) the
loss within 2% and every gradient at cosine similarity > 0.99.

Sequence-parallel dropout (no, full and selective activation checkpointing) has a
reference of its own: the masks each rank drew, gathered, replayed in one process
(loss and gradients within the same tolerances), and the masks themselves checked:
different on every sequence shard, about ``DROPOUT`` of the activations dropped.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from parallel_helpers import init_gloo, mismatch

from megalith.config import ConfigError, ModelConfig
from training.models import BackendError, GPTModel, TorchBackend
from training.models.flops import param_groups
from training.models.layers import SDPAttention
from training.models.tp_backend import TensorParallelBackend
from training.parallel.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    check_tensor_parallel,
    gather_tp_state_dict,
    partition_spec,
    shard_full_state_dict,
    squared_grad_norm,
    tensor_parallel_partition,
    vocab_parallel_cross_entropy,
)
from training.parallel.tensor_parallel.sharding import shard_tensor

WORLD = 2
VOCAB = 96
SEQ = 16
STEPS = 3
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_LOSS_TOL = {"rtol": 2e-2, "atol": 0.0}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
STEP_UPDATE_RTOL = 1e-2
DROPOUT_CHECKPOINTING = ("none", "full", "selective")


def tiny(style: str = "llama", **overrides) -> ModelConfig:
    values = {
        "style": style,
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2 if style == "llama" else None,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
    }
    return ModelConfig(**{**values, **overrides})


@dataclass(frozen=True)
class Layout:
    style: str
    sequence_parallel: bool
    checkpointing: str = "none"

    @property
    def id(self) -> str:
        name = f"{self.style} tp{WORLD}" + ("+sp" if self.sequence_parallel else "")
        return name + ("" if self.checkpointing == "none" else f"+{self.checkpointing}-ckpt")


LAYOUTS = [
    Layout("llama", False),
    Layout("llama", True),
    Layout("gpt2", False),
    Layout("gpt2", True),
    Layout("llama", True, "selective"),
]
LAYOUT_IDS = [layout.id for layout in LAYOUTS]


# ---------------------------------------------------------------------------------------
# Worker side: runs in each of the WORLD processes.


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels[0, :3] = -100
    return tokens, labels


def _models(layout: Layout, group: dist.ProcessGroup) -> tuple[ModelConfig, GPTModel, GPTModel]:
    config = tiny(layout.style, activation_checkpointing=layout.checkpointing)
    torch.manual_seed(0)
    full = GPTModel(config, TorchBackend())
    tp = GPTModel(config, TensorParallelBackend(group, layout.sequence_parallel))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tp.load_state_dict(shard_full_state_dict(full.state_dict(), config, rank, world))
    return config, full, tp


def _check_forward_and_grads(layout: Layout, group: dist.ProcessGroup) -> dict[str, list[str]]:
    config, full, tp = _models(layout, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = f"{layout.id} rank {rank}"
    report: dict[str, list[str]] = {"partition": [], "forward": [], "grads": [], "outputs": []}

    expected_split = {
        name: spec
        for name, _ in tp.named_parameters()
        if (spec := partition_spec(name, config)) is not None
    }
    if tensor_parallel_partition(tp) != expected_split:
        report["partition"].append(
            f"{where}: split parameters of the model {tensor_parallel_partition(tp)} differ "
            f"from sharding.partition_spec {expected_split}"
        )

    tokens, labels = _batch(0)
    expected, got = full(tokens, labels), tp(tokens, labels)
    report["forward"] += mismatch(f"{where}: forward loss", got, expected, LOSS_TOL)

    expected.backward()
    got.backward()
    report["grads"] += grad_mismatches(full, tp, config, rank, world, f"{where}: gradient of")
    full_norm = sum(p.grad.square().sum() for p in full.parameters())
    report["grads"] += mismatch(
        f"{where}: squared_grad_norm", squared_grad_norm(tp, group), full_norm, GRAD_TOL
    )

    with torch.no_grad():
        report["outputs"] += mismatch(
            f"{where}: logits (vocab gathered)", tp(tokens), full(tokens), LOSS_TOL
        )
        per_token = (
            tp(tokens, labels, loss_reduction="none"),
            full(tokens, labels, loss_reduction="none"),
        )
        report["outputs"] += mismatch(f"{where}: per-token losses", *per_token, LOSS_TOL)
    return report


def _check_compiled(group: dist.ProcessGroup) -> dict[str, list[str]]:
    """The tensor-parallel model under torch.compile (dynamo + AOT autograd; inductor's
    CPU code generation would only add minutes) against the eager single-process model:
    the collectives inside the graph are the functional ones (mappings.all_reduce), whose
    in-place predecessors gave wrong losses compiled on GPUs (RESULTS.md, issue 20)."""
    layout = Layout("llama", True)
    config, full, tp = _models(layout, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = f"{layout.id} compiled, rank {rank}"
    compiled = torch.compile(tp, backend="aot_eager")
    report: dict[str, list[str]] = {"forward": [], "grads": []}
    for step in range(2):  # the second call runs the cached graph
        tokens, labels = _batch(step)
        expected, got = full(tokens, labels), compiled(tokens, labels)
        report["forward"] += mismatch(f"{where}: loss of call {step}", got, expected, LOSS_TOL)
        full.zero_grad()
        tp.zero_grad()
        expected.backward()
        got.backward()
    report["grads"] += grad_mismatches(full, tp, config, rank, world, f"{where}: gradient of")
    return report


def grad_mismatches(
    full: GPTModel, tp: GPTModel, config: ModelConfig, rank: int, world: int, what: str
) -> list[str]:
    """Every TP parameter's gradient against its slice of the single-process gradient."""
    full_grads = {name: param.grad for name, param in full.named_parameters()}
    expected = shard_full_state_dict(full_grads, config, rank, world)
    return [
        problem
        for name, param in tp.named_parameters()
        for problem in mismatch(f"{what} {name}", param.grad, expected[name], GRAD_TOL)
    ]


def _check_adamw_steps(layout: Layout, group: dist.ProcessGroup) -> dict[str, list[str]]:
    config, full, tp = _models(layout, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = f"{layout.id} rank {rank}"
    initial = {name: value.clone() for name, value in tp.state_dict().items()}
    optimizers = [
        torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
        for model in (full, tp)
    ]
    failures = []
    for step in range(STEPS + 1):
        tokens, labels = _batch(step)
        losses = [model(tokens, labels) for model in (full, tp)]
        failures += mismatch(f"{where}: loss at step {step}", losses[1], losses[0], LOSS_TOL)
        if step == STEPS:
            break
        for loss, optimizer in zip(losses, optimizers, strict=True):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    expected = shard_full_state_dict(full.state_dict(), config, rank, world)
    for name, value in tp.state_dict().items():
        error = (value - expected[name]).norm()
        update = (expected[name] - initial[name]).norm()
        if error > STEP_UPDATE_RTOL * update + 1e-7:
            failures.append(
                f"{where}: {name} after {STEPS} AdamW steps differs by {error:.3g} (L2), "
                f"{error / update:.2%} of its update {update:.3g}"
            )
    return {"steps": failures}


def _check_autocast(group: dist.ProcessGroup) -> dict[str, list[str]]:
    """bf16 autocast (CPU) through the sequence-parallel linears' custom backward."""
    layout = Layout("llama", True)
    config, full, tp = _models(layout, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = f"{layout.id} rank {rank} under bf16 autocast"
    tokens, labels = _batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = full(tokens, labels), tp(tokens, labels)
    failures = mismatch(f"{where}: forward loss", got, expected, BF16_LOSS_TOL)
    expected.backward()
    got.backward()
    full_grads = {name: param.grad for name, param in full.named_parameters()}
    expected_grads = shard_full_state_dict(full_grads, config, rank, world)
    for name, param in tp.named_parameters():
        cosine = F.cosine_similarity(param.grad.flatten(), expected_grads[name].flatten(), dim=0)
        if param.grad.dtype != torch.float32 or not cosine > 0.99:
            failures.append(
                f"{where}: gradient of {name} is {param.grad.dtype} with cosine similarity "
                f"{cosine:.4f} to the unsharded one"
            )
    return {"autocast": failures}


def _check_cross_entropy(group: dist.ProcessGroup) -> dict[str, list[str]]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, VOCAB, generator=generator) * 4
    labels = torch.randint(0, VOCAB, (3, 5), generator=generator)
    labels[1, :2] = -100
    grad_out = torch.randn(3, 5, generator=generator)
    failures = []
    for with_ignored in (False, True):
        target = labels if with_ignored else labels.clamp(min=0)
        full = logits.clone().requires_grad_()
        expected = F.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none")
        expected = expected.view(target.shape)
        (expected * grad_out).sum().backward()

        local = logits.chunk(world, -1)[rank].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(local, target, group)
        (got * grad_out).sum().backward()
        what = f"vocab-parallel cross-entropy rank {rank} ({'with' if with_ignored else 'no'} ignore_index)"
        failures += mismatch(f"{what}: per-token loss", got, expected, LOSS_TOL)
        failures += mismatch(
            f"{what}: mean loss",
            got.sum() / (target != -100).sum(),
            F.cross_entropy(logits.view(-1, VOCAB), target.view(-1)),
            LOSS_TOL,
        )
        failures += mismatch(
            f"{what}: logits gradient", local.grad, full.grad.chunk(world, -1)[rank], GRAD_TOL
        )
    return {"cross_entropy": failures}


def _check_layers(group: dist.ProcessGroup) -> dict[str, list[str]]:
    """Layer options the backend does not use (gathered chunked output, reduce-scattered
    embedding) and what the sequence-parallel linear keeps for backward."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(3)
    failures = []

    weight = torch.randn(2 * 8, 6)
    x = torch.randn(2, 4, 6)
    column = ColumnParallelLinear(
        6, 16, group=group, bias=False, init_std=0.02, output_chunks=2, gather_output=True
    )
    with torch.no_grad():
        column.weight.copy_(shard_tensor(weight, 0, 2, rank, world))
    failures += mismatch(
        f"rank {rank}: ColumnParallelLinear(output_chunks=2, gather_output=True)",
        column(x),
        F.linear(x, weight),
        LOSS_TOL,
    )

    table = torch.randn(VOCAB, 6)
    tokens = torch.randint(0, VOCAB, (2, 8))
    embedding = VocabParallelEmbedding(VOCAB, 6, group=group, init_std=0.02, reduce_scatter=True)
    with torch.no_grad():
        embedding.weight.copy_(table.chunk(world, 0)[rank])
    expected = F.embedding(tokens, table).chunk(world, 1)[rank]
    failures += mismatch(
        f"rank {rank}: VocabParallelEmbedding(reduce_scatter=True)",
        embedding(tokens),
        expected,
        LOSS_TOL,
    )

    sequence_parallel = ColumnParallelLinear(
        6, 8, group=group, bias=True, init_std=0.02, sequence_parallel=True
    )
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        sequence_parallel(x.chunk(world, 1)[rank].requires_grad_())
    if (2, 4, 6) in saved:
        failures.append(
            f"rank {rank}: sequence-parallel ColumnParallelLinear saved the gathered input "
            f"for backward (saved {saved}), not its sequence shard"
        )
    return {"layers": failures}


DROPOUT = 0.1


def _record_dropout_masks(model: torch.nn.Module) -> list[torch.Tensor]:
    """The keep-mask of every ``nn.Dropout`` call, in call order (recomputations too).
    Where the input is 0 either mask gives the same output: counted as kept."""
    masks: list[torch.Tensor] = []

    def hook(module, inputs, output):
        masks.append(((output != 0) | (inputs[0] == 0)).detach().clone())

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(hook)
    return masks


def _replay_dropout_masks(model: torch.nn.Module, masks: list[torch.Tensor]) -> None:
    """Every ``nn.Dropout`` call of MODEL applies the next of MASKS instead of its own."""
    queue = iter(masks)

    def hook(module, inputs, output):
        return inputs[0] * next(queue) / (1 - module.p)

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(hook)


def _without_attention_dropout(model: torch.nn.Module) -> None:
    """Attention-probability dropout runs inside SDPA, out of a hook's reach: off here."""
    for module in model.modules():
        if isinstance(module, SDPAttention):
            module.dropout = 0.0


def _whole_masks(local: list[torch.Tensor], shapes: list[torch.Size], group, where: str):
    """Each rank's masks gathered into the unsharded activation's shape (sequence shards
    concatenated where the shapes say so); the failures of the masks themselves."""
    world, whole, failures, split = dist.get_world_size(group), [], [], 0
    if len(local) != len(shapes):
        return [], [f"{where}: {len(local)} dropout calls, one process makes {len(shapes)}"]
    for index, (mask, whole_mask) in enumerate(zip(local, shapes, strict=True)):
        shape = whole_mask.shape
        parts = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(parts, mask, group=group)
        dims = [d for d in range(mask.dim()) if mask.shape[d] != shape[d]]
        if not dims:
            whole.append(parts[0])
            if not all(torch.equal(part, parts[0]) for part in parts):
                failures.append(f"{where}: dropout {index} on a replicated tensor differs by rank")
            continue
        split += 1
        whole.append(torch.cat(parts, dim=dims[0]))
        if torch.equal(parts[0], parts[1]):
            failures.append(f"{where}: dropout {index} draws one mask on every sequence shard")
    dropped = 1 - torch.cat([m.flatten().float() for m in whole]).mean().item()
    if not split:
        failures.append(f"{where}: no dropout ran on sequence shards")
    if not 0.5 * DROPOUT < dropped < 1.5 * DROPOUT:
        failures.append(f"{where}: dropout {DROPOUT} dropped {dropped:.3f} of the activations")
    return whole, failures


def _check_dropout_against_replayed_masks(
    checkpointing: str, group: dist.ProcessGroup
) -> dict[str, list[str]]:
    """TP+SP with dropout (and CHECKPOINTING) against one process that applies the very
    masks the ranks drew, gathered: the loss, and every gradient, including what
    recomputation in backward redraws. Independent of the checkpointing modes, so a bug
    they share (a mask not applied, or not the one backward uses) fails here."""
    layout = Layout("llama", True, checkpointing)
    config = tiny("llama", activation_checkpointing=checkpointing, dropout=DROPOUT)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    where = f"{layout.id} dropout {DROPOUT} rank {rank}"
    torch.manual_seed(0)
    full = GPTModel(tiny("llama", dropout=DROPOUT), TorchBackend())
    tp = GPTModel(config, TensorParallelBackend(group, sequence_parallel=True))
    tp.load_state_dict(shard_full_state_dict(full.state_dict(), config, rank, world))
    for model in (full, tp):
        _without_attention_dropout(model)
    tokens, labels = _batch(0)

    shape_model = GPTModel(tiny("llama", dropout=DROPOUT), TorchBackend()).eval()
    shapes = _record_dropout_masks(shape_model)
    with torch.no_grad():
        shape_model(tokens, labels)

    drawn = _record_dropout_masks(tp)
    torch.manual_seed(1)
    got = tp(tokens, labels)
    forward_calls = len(drawn)
    got.backward()
    masks, failures = _whole_masks(drawn[:forward_calls], shapes, group, where)
    if failures:
        return {"dropout": failures}
    _replay_dropout_masks(full, masks)
    expected = full(tokens, labels)
    expected.backward()
    failures += mismatch(f"{where}: loss", got, expected, LOSS_TOL)
    full_grads = {name: param.grad for name, param in full.named_parameters()}
    expected_grads = shard_full_state_dict(full_grads, config, rank, world)
    for name, param in tp.named_parameters():
        what = f"{where}: gradient of {name}"
        failures += mismatch(what, param.grad, expected_grads[name], GRAD_TOL)
    return {"dropout": failures}


def _expect_error(
    what: str, error: type[Exception], needle: str, build: Callable[[], object]
) -> list[str]:
    try:
        build()
    except error as raised:
        return [] if needle in str(raised) else [f"{what}: unclear message {raised!r}"]
    return [f"{what}: no {error.__name__} raised"]


def _check_refusals(group: dist.ProcessGroup) -> dict[str, list[str]]:
    backend = TensorParallelBackend(group, sequence_parallel=True)
    failures = _expect_error(
        "one KV group over two TP ranks",
        BackendError,
        "num_query_groups (1)",
        lambda: GPTModel(tiny(num_query_groups=1), backend),
    )
    model = GPTModel(tiny(), backend)
    failures += _expect_error(
        "sequence parallel with an odd sequence length",
        ValueError,
        "cannot be split over 2 tensor-parallel ranks",
        lambda: model(torch.zeros(1, SEQ - 1, dtype=torch.long)),
    )
    return {"refusals": failures}


def _run_all(group: dist.ProcessGroup) -> dict[str, dict]:
    cases: dict[str, Callable[[], dict[str, list[str]]]] = {}
    for layout in LAYOUTS:
        cases[layout.id] = lambda layout=layout: _check_forward_and_grads(layout, group)
        cases[f"{layout.id} steps"] = lambda layout=layout: _check_adamw_steps(layout, group)
    cases["autocast"] = lambda: _check_autocast(group)
    cases["compiled"] = lambda: _check_compiled(group)
    cases["cross_entropy"] = lambda: _check_cross_entropy(group)
    cases["layers"] = lambda: _check_layers(group)
    cases["refusals"] = lambda: _check_refusals(group)
    for mode in DROPOUT_CHECKPOINTING:
        cases[f"dropout {mode}"] = lambda mode=mode: _check_dropout_against_replayed_masks(
            mode, group
        )
    results: dict[str, dict] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:  # recorded for the test that reads this case
            results[name] = {"error": traceback.format_exc()}
    return results


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    try:
        results = _run_all(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------
# Test side.


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, dict]]:
    out_dir = tmp_path_factory.mktemp("tensor_parallel")
    mp.spawn(_worker, args=(WORLD, str(out_dir)), nprocs=WORLD, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _failures(results: list[dict[str, dict]], case: str, check: str) -> str:
    messages = []
    for rank, by_case in enumerate(results):
        entry = by_case[case]
        if "error" in entry:
            messages.append(f"{case} rank {rank} raised:\n{entry['error']}")
        else:
            messages += entry[check]
    return "\n".join(messages)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_forward_loss_matches_single_process(results, layout):
    assert not (failures := _failures(results, layout, "forward")), failures


@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_gradients_are_slices_of_unsharded_gradients(results, layout):
    assert not (failures := _failures(results, layout, "grads")), failures


@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_logits_and_per_token_losses(results, layout):
    assert not (failures := _failures(results, layout, "outputs")), failures


@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_split_parameters_match_sharding_rules(results, layout):
    assert not (failures := _failures(results, layout, "partition")), failures


@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_adamw_steps_match_single_process(results, layout):
    assert not (failures := _failures(results, f"{layout} steps", "steps")), failures


def test_compiled_tensor_parallel_model_matches_single_process(results):
    for check in ("forward", "grads"):
        assert not (failures := _failures(results, "compiled", check)), failures


def test_sequence_parallel_under_bf16_autocast(results):
    assert not (failures := _failures(results, "autocast", "autocast")), failures


def test_vocab_parallel_cross_entropy_equals_cross_entropy(results):
    assert not (failures := _failures(results, "cross_entropy", "cross_entropy")), failures


def test_column_output_gather_sp_saved_shard_and_reduce_scattered_embedding(results):
    assert not (failures := _failures(results, "layers", "layers")), failures


def test_refuses_split_kv_groups_and_indivisible_sequence(results):
    assert not (failures := _failures(results, "refusals", "refusals")), failures


@pytest.mark.parametrize("checkpointing", DROPOUT_CHECKPOINTING)
def test_sequence_parallel_dropout_matches_one_process_replaying_its_masks(results, checkpointing):
    failures = _failures(results, f"dropout {checkpointing}", "dropout")
    assert not failures, failures


# ---------------------------------------------------------------------------------------
# Sharding, without processes.


def _full_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return GPTModel(config, TorchBackend()).state_dict()


@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shard_then_gather_is_identity(style, tp):
    config = tiny(style, num_query_groups=4)
    full = _full_state(config)
    shards = [shard_full_state_dict(full, config, rank, tp) for rank in range(tp)]
    assert shards[1]["layers.0.attention.proj.weight"].shape == (32, 32 // tp)
    gathered = gather_tp_state_dict(shards, config)
    assert gathered.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(gathered[name], tensor), name


def test_reshard_two_to_four_equals_direct_split():
    config = tiny(num_query_groups=4)
    full = _full_state(config)
    two = [shard_full_state_dict(full, config, rank, 2) for rank in range(2)]
    via_two = gather_tp_state_dict(two, config)
    for rank in range(4):
        direct = shard_full_state_dict(full, config, rank, 4)
        again = shard_full_state_dict(via_two, config, rank, 4)
        for name in direct:
            assert torch.equal(direct[name], again[name]), (rank, name)


def test_qkv_shards_hold_whole_kv_groups():
    config = tiny()  # 4 heads in 2 KV groups, head_dim 8
    heads, groups, dim = 4, 2, config.head_dim
    rows = (heads + 2 * groups) * dim
    weight = torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(rows, 32)
    per_group = (heads // groups + 2) * dim  # q heads of the group, then k, then v
    for rank in range(2):
        shard = shard_full_state_dict(
            {"layers.0.attention.qkv.linear.weight": weight}, config, rank, 2
        )["layers.0.attention.qkv.linear.weight"]
        assert torch.equal(shard[:, 0], weight[rank * per_group : (rank + 1) * per_group, 0])


def test_swiglu_fc1_shards_keep_gate_and_up():
    config = tiny()
    ffn = config.ffn_hidden_size
    gate = torch.randn(ffn, 32)
    up = torch.randn(ffn, 32)
    name = "layers.1.mlp.fc1.linear.weight"
    for rank in range(2):
        shard = shard_full_state_dict({name: torch.cat([gate, up])}, config, rank, 2)[name]
        half = slice(rank * ffn // 2, (rank + 1) * ffn // 2)
        assert torch.equal(shard, torch.cat([gate[half], up[half]]))


def test_replicated_and_split_parameters():
    config = tiny("gpt2")
    assert partition_spec("layers.0.attention.qkv.norm.weight", config) is None
    assert partition_spec("layers.0.attention.proj.bias", config) is None
    assert partition_spec("embedding.position.weight", config) is None
    assert partition_spec("module.layers.3.mlp.fc2.weight", config) == (1, 1)
    assert partition_spec("layers.0.mlp.fc1.linear.bias", config) == (0, 1)
    assert partition_spec("layers.0.mlp.fc1.linear.weight", tiny()) == (0, 2)


def test_check_tensor_parallel_names_the_sizes():
    check_tensor_parallel(tiny(), 2)
    with pytest.raises(ConfigError, match="num_query_groups = 2"):
        check_tensor_parallel(tiny(), 4)
    with pytest.raises(ConfigError, match="vocab_size = 99"):
        check_tensor_parallel(tiny(vocab_size=99), 2)
