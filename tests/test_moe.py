"""Mixture of experts: the router, the layer, and expert parallelism through the Trainer.

Unit tests: top-k routing, the load-balancing loss on hand-made cases, capacity
dropping, the layer against a plain loop over tokens and experts, parameter and FLOP
counts, the model package, and the layouts that are refused.

Expert parallelism on CPU with gloo (MEGALITH_TEST_DEVICE=cuda: NCCL): EP=2 carved out
of DP=2 (2 processes, each holding 2 of 4 experts; and, as a control, DP=2 with FSDP2
and every expert on both ranks) runs ``Trainer.fit`` for 4 steps
with a checkpoint at step 2 and must match the single-process run of the same config,
seed and data: losses, MoE auxiliary losses, validation losses and grad norms step by
step, the whole (gathered) weights and AdamW moments of the final checkpoint, the
logits of the model package, and one step's gradients against the unsharded ones.
Resuming the EP=2 checkpoint at EP=2 is exact; resuming it in one process matches.
A slow test runs EP=2 inside DP=4 (4 processes, two replicas of each expert) the same way.

Tolerance: EP changes only the order of fp32 sums (an expert's gradient sums the
tokens of both ranks, then DDP-style scaling; the grad norm sums per-rank squares),
~1e-7 relative per op, which Adam amplifies a little over 4 steps. Losses within
1e-5 absolute, grad norms within 1e-4 relative, tensors within rtol 1e-4 / atol 1e-5
(gradients atol 1e-6).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parallel_helpers import (
    BACKEND,
    DEVICE,
    RECIPE,
    REPO,
    RESUME_STEP,
    STEPS,
    assert_close_tensors,
    assert_metrics_match,
    assert_one_process_resume,
    assert_package_logits_match,
    assert_resume_exact,
    assert_saved_in_row_halves,
    assert_whole_checkpoint,
    config_of,
    fit_one_process,
    last_checkpoint_state,
    metrics,
    run_torchrun_worker,
    trainer_settings,
)
from safetensors.torch import load_file
from saved_tensors_probe import saved_for_backward, total_bytes

from megalith.config import ConfigError, ModelConfig, load_config
from megalith.errors import MegalithError
from training.models.flops import matmul_params, param_groups, total_params
from training.models.gpt import GPTModel
from training.models.layers import gelu, swiglu
from training.models.moe import (
    MoELayer,
    expert_capacity,
    load_balancing_loss,
    moe_aux_loss,
    route,
    within_capacity,
)
from training.models.package import load_model_package, save_model_package
from training.parallel.groups import ParallelSizes
from training.parallel.support import check_trainer_support
from training.trainer import Trainer

WORLD = 2
MOE = {
    "model.num_experts": 4,
    "model.moe_top_k": 2,
    "model.moe_ffn_hidden_size": 32,
    "model.moe_aux_loss_coeff": 0.1,
}
# Both EP cases carve EP=2 out of DP=2 (2 processes).
CASES = {
    # 3 validation batches over 2 ranks: the rank dealt one fewer runs one more forward
    # (uncounted), or the other would wait for it in the experts' all-to-all.
    "ep2": {**MOE, "parallel.expert": 2, "training.eval_iters": 3},
    "ep2-gpt2-capacity": {
        **MOE,
        "parallel.expert": 2,
        "model.style": "gpt2",  # GELU experts with biases
        "model.moe_capacity_factor": 0.75,  # drops a quarter of the assignments or more
        "model.moe_layer_frequency": 2,  # block 0 MoE, block 1 dense
        "model.activation_checkpointing": "selective",  # recomputes the all-to-alls
    },
    # No EP: experts replicated, sharded by FSDP2 like any block's weights.
    "dp2-fsdp": {**MOE, "parallel.data_parallel_mode": "fsdp"},
    # Each rank routes its part of the sequence; the load balance is the whole one's.
    "cp2": {**MOE, "parallel.context": 2},
    # Capacity decided over the whole sequence: top-1 weights all tie at 1, so which
    # assignments an expert drops follows the whole micro-batch's token order.
    "cp2-top1-capacity": {
        **MOE,
        "parallel.context": 2,
        "model.moe_top_k": 1,
        "model.moe_capacity_factor": 0.75,
    },
    # One MoE block per stage: the balance loss's gradient rides on the stage output.
    "pp2": {**MOE, "parallel.pipeline": 2},
    # Each TP rank routes its sequence shard through the whole (replicated) experts;
    # their gradients are summed over TP, the load balance is the whole sequence's.
    "tp2-sp": {**MOE, "parallel.tensor": 2, "parallel.sequence_parallel": True},
    # Capacity over the whole sequence, as one device decides it, with GELU experts
    # with biases (their gradients summed over TP too).
    "tp2-sp-gpt2-top1-capacity": {
        **MOE,
        "parallel.tensor": 2,
        "parallel.sequence_parallel": True,
        "model.style": "gpt2",
        "model.moe_top_k": 1,
        "model.moe_capacity_factor": 0.75,
    },
}


def layout(case: str) -> str:
    ep, cp, pp, tp = (
        CASES[case].get(f"parallel.{key}", 1) for key in ("expert", "context", "pipeline", "tensor")
    )
    dp = WORLD // (cp * pp * tp)
    return f"{case} (TP={tp} x EP={ep} x CP={cp} x PP={pp} x DP={dp}, {BACKEND}, {WORLD} processes)"


def tiny_model_config(**values: Any) -> ModelConfig:
    base = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "vocab_size": 64,
        "max_position_embeddings": 16,
        "num_experts": 4,
        "moe_top_k": 2,
    }
    return ModelConfig(**{**base, **values})


# ---------------------------------------------------------------- router


def test_route_picks_the_top_k_and_softmaxes_over_them() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    routing = route(logits, top_k=2)
    assert routing.experts.tolist() == [[1, 3], [0, 2]]
    want = torch.tensor([[3.0, 2.0], [5.0, 4.0]]).softmax(-1)
    torch.testing.assert_close(routing.weights, want)
    # Megatron's order (top-k, then softmax) equals softmax, top-k, renormalize.
    probs = logits.softmax(-1).gather(1, routing.experts)
    torch.testing.assert_close(routing.weights, probs / probs.sum(-1, keepdim=True))
    assert routing.keep is None


def test_load_balancing_loss_by_hand() -> None:
    # Balanced: each expert gets half the assignments and half the probability: aux = 1.
    balanced = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    routing = route(balanced, top_k=1)
    assert routing.balance_loss.item() == pytest.approx(1.0)
    # Collapsed: both tokens pick expert 0 with p0 = sigmoid(1): aux = E · (1 · p0) = 2 p0.
    collapsed = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    p0 = 1 / (1 + math.exp(-1))
    assert route(collapsed, top_k=1).balance_loss.item() == pytest.approx(2 * p0)
    # Top-2 of 3: f = (2, 1, 1)/4 by hand, P the mean softmax.
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0]])
    probs = logits.softmax(-1)
    want = 3 * sum(f * p for f, p in zip([0.5, 0.25, 0.25], probs.mean(0).tolist(), strict=True))
    experts = logits.topk(2, -1).indices
    assert load_balancing_loss(probs, experts, 3).item() == pytest.approx(want)


def test_capacity_drops_the_lowest_weights_per_expert() -> None:
    assert expert_capacity(num_tokens=8, top_k=2, num_experts=4, factor=1.0) == 4
    assert expert_capacity(num_tokens=5, top_k=1, num_experts=4, factor=1.5) == 2
    # Five single assignments to expert 0, capacity 2: the two heaviest survive.
    experts = torch.zeros(5, 1, dtype=torch.long)
    weights = torch.tensor([[0.1], [0.9], [0.3], [0.8], [0.2]])
    keep = within_capacity(weights, experts, num_experts=2, capacity=2)
    assert keep.view(-1).tolist() == [False, True, False, True, False]
    # Through route(): 4 tokens all preferring expert 0 of 2, k=1, factor 1: capacity 2.
    logits = torch.tensor([[4.0, 0.0], [1.0, 0.0], [3.0, 0.0], [2.0, 0.0]])
    routing = route(logits, top_k=1, capacity_factor=1.0)
    # Top-1 weights are all 1: the ties keep the earlier tokens.
    assert routing.keep.view(-1).tolist() == [True, True, False, False]


def reference_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, with the layer's own weights."""
    hidden = layer.norm(x).reshape(-1, x.size(-1))
    routing = route(layer.router(hidden), layer.top_k, layer.capacity_factor)
    experts, activation = layer.experts, swiglu if layer.experts.gated else gelu
    out = torch.zeros_like(hidden)
    for t in range(hidden.size(0)):
        for slot in range(layer.top_k):
            if routing.keep is not None and not routing.keep[t, slot]:
                continue
            e = routing.experts[t, slot]
            bias1 = None if experts.fc1_bias is None else experts.fc1_bias[e]
            bias2 = None if experts.fc2_bias is None else experts.fc2_bias[e]
            h = activation(F.linear(hidden[t], experts.fc1_weight[e], bias1))
            out[t] += routing.weights[t, slot] * F.linear(h, experts.fc2_weight[e], bias2)
    return out.view(x.shape)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"style": "gpt2"},
        {"moe_capacity_factor": 0.5},
        {"style": "gpt2", "moe_top_k": 1, "moe_capacity_factor": 1.0},
    ],
    ids=["llama-dropless", "gpt2-dropless", "llama-capacity", "gpt2-top1-capacity"],
)
def test_layer_matches_a_loop_over_experts(values: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = GPTModel(tiny_model_config(**values))
    layer = model.layers[0].mlp
    assert isinstance(layer, MoELayer)
    with torch.no_grad():
        for bias in (layer.experts.fc1_bias, layer.experts.fc2_bias):
            if bias is not None:
                bias.normal_()  # zero at init: make them count
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


def test_dropless_keeps_every_token_and_capacity_drops_some() -> None:
    torch.manual_seed(0)
    layer = GPTModel(tiny_model_config()).layers[0].mlp
    x = torch.randn(1, 16, 32)
    hidden = layer.norm(x).reshape(-1, 32)
    assert route(layer.router(hidden), 2).keep is None
    tight = route(layer.router(hidden), 2, capacity_factor=0.5)
    counts = torch.bincount(tight.experts[tight.keep], minlength=4)
    assert counts.max().item() <= expert_capacity(16, 2, 4, 0.5) == 4
    assert tight.keep.sum().item() < 32


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients(mode: str) -> None:
    grads, kept = {}, {}
    for checkpointing in ("none", mode):
        torch.manual_seed(0)
        model = GPTModel(tiny_model_config(activation_checkpointing=checkpointing))
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        with saved_for_backward() as saved:
            loss = model(tokens, labels=tokens)
        (loss + moe_aux_loss(model)).backward()
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters()}
        kept[checkpointing] = total_bytes(saved)
    # The blocks' activations (the experts' included) are really not kept.
    assert kept[mode] < kept["none"] / 3, kept
    for name, grad in grads["none"].items():
        torch.testing.assert_close(
            grads[mode][name], grad, msg=lambda m, n=name: f"{mode} {n}: {m}"
        )


def test_aux_loss_is_recorded_in_training_only() -> None:
    """The coefficient scales the recorded loss, whose gradient reaches every router."""

    def model_and_aux(coeff: float) -> tuple[GPTModel, torch.Tensor | None]:
        torch.manual_seed(0)
        model = GPTModel(tiny_model_config(moe_aux_loss_coeff=coeff))
        model(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
        return model, moe_aux_loss(model)

    model, aux = model_and_aux(0.5)
    assert aux is not None and aux.requires_grad
    # Two MoE layers, each 0.5 · (a value >= 1, equal to 1 when perfectly balanced).
    assert aux.item() >= 0.5 * 2 - 1e-6
    assert aux.item() == pytest.approx(0.5 * model_and_aux(1.0)[1].item(), rel=1e-6)
    assert moe_aux_loss(model) is None  # cleared
    aux.backward()
    routers = {n: p.grad for n, p in model.named_parameters() if "router" in n}
    assert len(routers) == 2 and all(g is not None and g.abs().sum() > 0 for g in routers.values())
    tokens = torch.randint(0, 64, (2, 8))
    model.eval()
    model(tokens, labels=tokens)
    assert moe_aux_loss(model) is None
    assert moe_aux_loss(GPTModel(tiny_model_config(num_experts=None))) is None


# ---------------------------------------------------------------- config, counts, package


def test_config_validation_and_layer_frequency() -> None:
    with pytest.raises(ConfigError, match="moe_top_k 3 exceeds num_experts 2"):
        load_config(None, ["model.num_experts=2", "model.moe_top_k=3"])
    config = tiny_model_config(num_layers=4, moe_layer_frequency=2, ffn_hidden_size=48)
    assert [config.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert config.moe_ffn_hidden_size == 48  # defaults to ffn_hidden_size
    assert not ModelConfig(num_experts=0).is_moe_layer(0)
    model = GPTModel(config)
    assert [type(b.mlp).__name__ for b in model.layers] == ["MoELayer", "MLP"] * 2


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_parameter_and_active_flop_counts(style: str) -> None:
    config = tiny_model_config(style=style, num_layers=3, moe_layer_frequency=2, num_experts=8)
    model = GPTModel(config)
    assert total_params(config) == sum(p.numel() for p in model.parameters())
    dense = ModelConfig(**{**config.model_dump(), "num_experts": None})
    per_expert = 32 * config.moe_ffn_hidden_size * (3 if style == "llama" else 2)
    # Two MoE blocks: their router plus top-k (2) experts replace the dense MLP.
    want = matmul_params(dense) + 2 * (32 * 8 + 2 * per_expert - per_expert)
    assert matmul_params(config) == want


def test_stacked_expert_biases_get_no_weight_decay() -> None:
    model = GPTModel(tiny_model_config(style="gpt2"))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert "layers.0.mlp.experts.fc1_bias" in {names[id(p)] for p in no_decay["params"]}
    assert "layers.0.mlp.experts.fc1_weight" in {names[id(p)] for p in decay["params"]}


def test_model_package_round_trip(tmp_path: Path) -> None:
    config = tiny_model_config(moe_capacity_factor=1.0)
    model = GPTModel(config).eval()
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"not a real tokenizer")
    save_model_package(model, config, tokenizer, tmp_path / "package")
    loaded, loaded_config, _ = load_model_package(tmp_path / "package")
    assert loaded_config == config
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens))
    # Incremental decoding goes through the MoE layers too.
    cache = loaded.new_kv_cache(2, 16)
    with torch.no_grad():
        first = loaded(tokens[:, :8], kv_cache=cache)
        torch.testing.assert_close(first, model(tokens[:, :8]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["moe-tiny-cpu", "moe-8x350m"])
def test_moe_recipes_build(name: str) -> None:
    config = load_config(REPO / "configs" / f"{name}.yaml")
    with torch.device("meta"):
        model = GPTModel(config.model)
    assert len(moe_layers_of(model)) == config.model.num_layers
    world = config.parallel.expert  # the smallest world the recipe's layout fits
    sizes = ParallelSizes(dp=world, ep=config.parallel.expert)
    check_trainer_support(config, sizes)


def moe_layers_of(model: GPTModel) -> list[MoELayer]:
    return [block.mlp for block in model.layers if isinstance(block.mlp, MoELayer)]


@pytest.mark.parametrize(
    ("values", "sizes", "message"),
    [
        ({}, ParallelSizes(dp=2, ep=2), "parallel.expert=2 needs model.num_experts"),
        (
            {"model.num_experts": 3},
            ParallelSizes(dp=2, ep=2),
            "num_experts=3 is not divisible by parallel.expert=2",
        ),
        (
            {"model.num_experts": 4},
            ParallelSizes(tp=2),
            "num_experts=4 with parallel.tensor=2 needs parallel.sequence_parallel=true",
        ),
    ],
    ids=[
        "dense",
        "indivisible",
        "tensor-without-sp",
    ],  # fmt: skip
)
def test_refused_layouts_name_the_keys(values: dict, sizes: ParallelSizes, message: str) -> None:
    config = load_config(RECIPE, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(MegalithError, match=message):
        check_trainer_support(config, sizes)


# ---------------------------------------------------------------- EP through the Trainer


def single_process(values: dict[str, Any]) -> dict[str, Any]:
    parallel = ("parallel.expert", "parallel.data_parallel_mode", "parallel.context")
    parallel += ("parallel.pipeline", "parallel.tensor", "parallel.sequence_parallel")
    return {k: v for k, v in values.items() if k not in parallel}


@pytest.fixture(scope="module")
def parallel_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both cases and the gradient capture in one torchrun job (one start-up cost)."""
    out = tmp_path_factory.mktemp("ep-runs")
    spec = {
        "recipe": str(RECIPE),
        "device": DEVICE,
        "cases": {name: trainer_settings(shards, extra) for name, extra in CASES.items()},
        "grads": trainer_settings(shards, CASES["ep2"]),
        "resume_step": RESUME_STEP,
        "out": str(out),
    }
    return run_torchrun_worker("moe_trainer_worker.py", spec, out, WORLD, "EP=2 x DP=2")


@pytest.fixture(scope="module")
def references(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The single-process runs of the same configs."""
    runs: dict[str, Path] = {}
    done: dict[str, Path] = {}
    for name, extra in CASES.items():
        values = trainer_settings(shards, single_process(extra))
        key = json.dumps(values, sort_keys=True)
        if key not in done:
            done[key] = fit_one_process(values, tmp_path_factory.mktemp(f"ep-reference-{name}"))
        runs[name] = done[key]
    return runs


def check_metrics(got_run: Path, want_run: Path, name: str) -> None:
    """Losses, MoE auxiliary losses, validation losses and grad norms step by step."""
    got = metrics(got_run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_metrics_match(got, metrics(want_run), name, losses=("loss", "moe_aux_loss", "val_loss"))
    assert "moe_aux_loss" in got[0], f"{name}: no moe_aux_loss logged"


def single_process_grads(values: dict[str, Any], out: Path) -> dict[str, torch.Tensor]:
    """Step 1's gradients in one process (after clipping), the optimizer step skipped."""
    trainer = Trainer(config_of(single_process(values)), out)
    trainer.optimizer.step = lambda: None
    trainer.train_step(trainer.train_batches())
    return {n: p.grad.detach().cpu() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_losses_match_one_process(case: str, parallel_runs: Path, references: dict) -> None:
    check_metrics(parallel_runs / case, references[case], layout(case))


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_holds_whole_single_process_tensors(
    case: str, parallel_runs: Path, references: dict
) -> None:
    assert_whole_checkpoint(parallel_runs / case, references[case], layout(case))
    state = last_checkpoint_state(parallel_runs / case)
    assert state["layout"]["parallel.expert"] == CASES[case].get("parallel.expert", 1)


@pytest.mark.parametrize("case", CASES)
def test_resume_in_the_same_layout_is_exact(case: str, parallel_runs: Path) -> None:
    assert_resume_exact(parallel_runs / case, parallel_runs / f"{case}-resumed", layout(case))


def test_one_process_resumes_an_expert_parallel_checkpoint(
    parallel_runs: Path, shards: Path, tmp_path: Path
) -> None:
    values = single_process(trainer_settings(shards, CASES["ep2"]))
    assert_one_process_resume(parallel_runs / "ep2", values, tmp_path, layout("ep2"))


@pytest.mark.parametrize("case", CASES)
def test_model_package_loads_in_one_process(
    case: str, parallel_runs: Path, references: dict
) -> None:
    assert_package_logits_match(parallel_runs / case, references[case], layout(case))


def test_step_gradients_match_unsharded(parallel_runs: Path, shards: Path, tmp_path: Path) -> None:
    """Step 1's gradients (after the EP reduction and clipping), experts gathered,
    against the single-process gradients of the same batch."""
    want = single_process_grads(trainer_settings(shards, CASES["ep2"]), tmp_path)
    got = load_file(str(parallel_runs / "grads" / "grads.safetensors"))
    assert_close_tensors(got, want, f"{layout('ep2')} step 1 gradients", atol=1e-6)


@pytest.mark.slow
def test_expert_data_parallel_matches_one_process(shards: Path, tmp_path: Path) -> None:
    """One 4-process job, each layout against one process: losses, grad norms, whole
    checkpoint tensors, an exact resume and the package's logits.

    - EP=2 inside DP=4: each expert lives on two expert-data-parallel ranks, whose
      gradients are summed over the edp group (and step 1's gradients);
    - the same with the distributed optimizer (each expert weight's AdamW state on one of
      its two expert-data ranks) and with FSDP (each layer's experts an FSDP unit over
      them); both checkpoints also resume in one process;
    - EP=2 × PP=2, with DDP and with FSDP (each stage's two data-parallel ranks exchange
      tokens by all-to-all);
    - CP=2 × PP=2, whose balance loss must cover each whole sequence;
    - TP=2 + SP × PP=2: whole experts on each TP rank, their gradients summed over TP,
      the balance over each whole sequence, inside pipeline stages; TP=2 + SP × DP=2
      FSDP (2-D: FSDP rows of each TP rank's whole experts); TP=2 + SP × EP=2 with DDP and
      with FSDP (each TP rank's EP group exchanges its sequence shard's tokens); TP=2 + SP
      × CP=2 with a capacity (each sequence in four parts: balance and capacity over
      all four)."""
    name = f"EP=2 x DP=4 (EDP=2, {BACKEND}, 4 processes)"
    values = trainer_settings(shards, {**MOE, "parallel.expert": 2, "training.eval_iters": 4})
    zero1 = {**values, "parallel.data_parallel_mode": "distributed_optimizer"}
    fsdp = {**values, "parallel.data_parallel_mode": "fsdp"}
    staged = trainer_settings(
        shards,
        {**MOE, "parallel.expert": 2, "parallel.pipeline": 2, "training.eval_iters": 4},
    )
    staged_fsdp = {**staged, "parallel.data_parallel_mode": "fsdp"}
    context_staged = trainer_settings(
        shards,
        {**MOE, "parallel.context": 2, "parallel.pipeline": 2, "training.eval_iters": 4},
    )
    tensor = {"parallel.tensor": 2, "parallel.sequence_parallel": True, "training.eval_iters": 4}
    tensor_staged = trainer_settings(shards, {**MOE, **tensor, "parallel.pipeline": 2})
    two_d = trainer_settings(shards, {**MOE, **tensor, "parallel.data_parallel_mode": "fsdp"})
    tensor_experts = trainer_settings(shards, {**MOE, **tensor, "parallel.expert": 2})
    tensor_experts_fsdp = {**tensor_experts, "parallel.data_parallel_mode": "fsdp"}
    tensor_context = trainer_settings(
        shards, {**MOE, **tensor, "parallel.context": 2, "model.moe_capacity_factor": 0.75}
    )
    spec = {
        "recipe": str(RECIPE),
        "device": DEVICE,
        "cases": {
            "ep2-dp4": values,
            "ep2-dp4-zero1": zero1,
            "ep2-dp4-fsdp": fsdp,
            "ep2-pp2": staged,
            "ep2-pp2-fsdp": staged_fsdp,
            "cp2-pp2": context_staged,
            "tp2-sp-pp2": tensor_staged,
            "tp2-sp-dp2-fsdp": two_d,
            "tp2-sp-ep2": tensor_experts,
            "tp2-sp-ep2-fsdp": tensor_experts_fsdp,
            "tp2-sp-cp2-capacity": tensor_context,
        },
        "grads": values,
        "resume_step": RESUME_STEP,
        "out": str(tmp_path / "runs"),
    }
    (tmp_path / "runs").mkdir()
    runs = run_torchrun_worker("moe_trainer_worker.py", spec, tmp_path / "runs", 4, name)
    reference = fit_one_process(single_process(values), tmp_path / "reference")
    layouts = {
        "ep2-dp4": name,
        "ep2-dp4-zero1": f"EP=2 x DP=4 distributed optimizer ({BACKEND}, 4 processes)",
        "ep2-dp4-fsdp": f"EP=2 x DP=4 FSDP ({BACKEND}, 4 processes)",
        "ep2-pp2": f"EP=2 x PP=2 ({BACKEND}, 4 processes)",
        "ep2-pp2-fsdp": f"EP=2 x PP=2 FSDP ({BACKEND}, 4 processes)",
        # the balance loss over the whole sequence
        "cp2-pp2": f"CP=2 x PP=2 ({BACKEND}, 4 processes)",
        # whole experts on each TP rank, their gradients summed over TP
        "tp2-sp-pp2": f"TP=2 + SP x PP=2 ({BACKEND}, 4 processes)",
        "tp2-sp-dp2-fsdp": f"TP=2 + SP x DP=2 FSDP ({BACKEND}, 4 processes)",
        "tp2-sp-ep2": f"TP=2 + SP x EP=2 (of DP=2) ({BACKEND}, 4 processes)",
        "tp2-sp-ep2-fsdp": f"TP=2 + SP x EP=2 (of DP=2) FSDP ({BACKEND}, 4 processes)",
    }
    # A sequence in four parts (CP chunks, each split over TP): balance and capacity over
    # all four; its own single-process reference (it has a capacity).
    tensor_context_reference = fit_one_process(
        single_process(tensor_context), tmp_path / "reference-capacity"
    )
    label = f"TP=2 + SP x CP=2, capacity 0.75 ({BACKEND}, 4 processes)"
    check_metrics(runs / "tp2-sp-cp2-capacity", tensor_context_reference, label)
    assert_resume_exact(runs / "tp2-sp-cp2-capacity", runs / "tp2-sp-cp2-capacity-resumed", label)
    assert_whole_checkpoint(runs / "tp2-sp-cp2-capacity", tensor_context_reference, label)
    for case, label in layouts.items():
        check_metrics(runs / case, reference, label)
        assert_resume_exact(runs / case, runs / f"{case}-resumed", label)
        assert_whole_checkpoint(runs / case, reference, label)
        assert_package_logits_match(runs / case, reference, label)
    want_grads = single_process_grads(values, tmp_path / "grads")
    got_grads = load_file(str(runs / "grads" / "grads.safetensors"))
    assert_close_tensors(got_grads, want_grads, f"{name} step 1 gradients", atol=1e-6)
    for case in ("ep2-dp4-zero1", "ep2-dp4-fsdp"):  # the owners' and rows' shards reassembled
        one = tmp_path / f"{case}-one"
        assert_one_process_resume(runs / case, single_process(values), one, layouts[case])
    assert_saved_in_row_halves(runs / "ep2-pp2-fsdp", layouts["ep2-pp2-fsdp"])  # dense rows too
    ran = last_checkpoint_state(runs / "ep2-pp2")["layout"]
    assert (ran["parallel.expert"], ran["parallel.pipeline"], ran["parallel.data"]) == (2, 2, 2)
