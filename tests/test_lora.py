"""Fine-tuning (training/finetune): LoRA adapters, merging, adapters saved alone, the
starting points (package, checkpoint, registered model, HF directory), lineage, resume
and tensor-parallel parity on real torchrun + gloo.

One tiny base run and one LoRA run per module (the tiny shard set, pretraining data);
the tests read them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from parallel_helpers import (
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
    run_trainer_worker,
    trainer_settings,
)

from megalith.config import ConfigError, LoRAConfig, ModelConfig
from training.checkpoint.sharded_reader import read_global_tensors
from training.finetune.adapter import AdapterError, attach_adapter, load_adapter
from training.finetune.base import content_id
from training.finetune.lora import apply_lora, is_adapter_param
from training.finetune.merge import merge_adapter_package
from training.finetune.session import FineTune
from training.models import GPTModel
from training.models.flops import param_groups
from training.models.package import load_model_package, model_tensors
from training.trainer import Trainer

LORA = {"finetune.lora.rank": 4, "finetune.lora.alpha": 8, "finetune.lora.dropout": 0.0}


@pytest.fixture(scope="module")
def base(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretraining run: checkpoints at steps 2 and 4, its package at base/model."""
    return fit_one_process(trainer_settings(shards), tmp_path_factory.mktemp("base") / "run")


def lora_settings(shards: Path, base: Path, **extra) -> dict:
    return trainer_settings(shards, {"finetune.base": str(base / "model"), **LORA, **extra})


@pytest.fixture(scope="module")
def lora_run(shards: Path, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_one_process(lora_settings(shards, base), tmp_path_factory.mktemp("lora") / "run")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from training.mlflow_store.runs import ensure_tracking_store

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_RUN_ID"):
            env.delenv(name, raising=False)
        ensure_tracking_store(uri)
        yield uri


@pytest.fixture(scope="module")
def registered(base: Path, store: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The base package registered as tiny-base@champion; returns the models:/ URI."""
    from mlflow import MlflowClient

    from registry.models import register_model

    client = MlflowClient(tracking_uri=store)
    artifacts = tmp_path_factory.mktemp("lora-artifacts").as_uri()  # not ./mlruns in the tree
    run = client.create_run(client.create_experiment("lora-base", artifacts))
    register_model(base / "model", "tiny-base", run.info.run_id, {}, "champion", tracking_uri=store)
    return "models:/tiny-base@champion"


def tiny_model() -> GPTModel:
    config = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=64, max_position_embeddings=16,
    )  # fmt: skip
    return GPTModel(config)


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


def test_lora_starts_as_the_base_and_only_adapters_train() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    x = tokens(64)
    with torch.no_grad():
        before = model(x)
    adapters = apply_lora(model, LoRAConfig(rank=4, alpha=8), seed=1)
    assert len(adapters) == 4 * 2  # qkv, proj, fc1, fc2 in each of 2 layers
    with torch.no_grad():
        assert torch.equal(model(x), before)  # B = 0: the base function exactly
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_param(n) for n in trainable)
    grouped = {id(p) for group in param_groups(model, 0.1) for p in group["params"]}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    a = adapters["layers.0.attention.proj"].a
    assert a.abs().sum() > 0 and adapters["layers.0.attention.proj"].b.abs().sum() == 0

    with pytest.raises(ConfigError, match=r"\['attn'\] match no linear layer.*fc1"):
        apply_lora(tiny_model(), LoRAConfig(target_modules=["attn"]), seed=1)


def test_lora_run_changes_only_the_adapters(base: Path, lora_run: Path) -> None:
    base_tensors = model_tensors(load_model_package(base / "model")[0])
    saved = read_global_tensors(lora_run / "checkpoints" / f"step-{STEPS:08d}")
    adapters = {n for n in saved if is_adapter_param(n) and not n.startswith("optimizer/")}
    assert len(adapters) == 2 * 4 * 2  # A and B of 4 targets in 2 layers, in the checkpoint
    for name, tensor in base_tensors.items():
        assert torch.equal(saved[name], tensor), f"frozen base weight {name} changed"
    assert all(saved[n].abs().sum() > 0 for n in adapters if n.endswith(".lora.b"))
    moments = {n.split("/")[1] for n in saved if n.startswith("optimizer/")}
    assert moments == adapters  # AdamW state for the adapters alone
    summary = json.loads((lora_run / "result.json").read_text())
    assert summary["adapter"] == str(lora_run / "adapter")


def test_merged_package_equals_the_adapter_on_its_base(
    base: Path, lora_run: Path, tmp_path: Path
) -> None:
    from training.interop.export import export_hf
    from training.interop.hf import import_hf

    merged, config, _ = load_model_package(lora_run / "model")
    model, _, _ = load_model_package(base / "model")
    attach_adapter(model, load_adapter(lora_run / "adapter"))
    x = tokens(config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), model(x), rtol=0, atol=1e-5)
    meta = json.loads((lora_run / "model" / "config.json").read_text())
    assert meta["lineage"]["megalith.finetune.method"] == "lora"
    # A merged package is a normal one: HF export and back give the same logits.
    hf = export_hf(lora_run / "model", tmp_path / "hf")
    again, _, _ = load_model_package(import_hf(hf, tmp_path / "pkg"))
    with torch.no_grad():
        torch.testing.assert_close(again(x), merged(x), rtol=0, atol=1e-6)


def test_adapter_alone_round_trips_and_refuses_tampering(
    base: Path, lora_run: Path, tmp_path: Path
) -> None:
    adapter = load_adapter(lora_run / "adapter")
    saved = read_global_tensors(lora_run / "checkpoints" / f"step-{STEPS:08d}")
    assert_close_tensors(adapter.tensors, {n: saved[n] for n in adapter.tensors}, "adapter", 0, 0)
    adapter_bytes = (lora_run / "adapter" / "adapter.safetensors").stat().st_size
    assert adapter_bytes * 5 < (lora_run / "model" / "model.safetensors").stat().st_size
    record = json.loads((lora_run / "adapter" / "adapter.json").read_text())
    base_id = content_id(model_tensors(load_model_package(base / "model")[0]))
    assert record["base"]["megalith.base.content_id"] == base_id

    # Merged from the adapter directory onto the base (megalith finetune merge): the
    # run's own merged package.
    from pipelines.cli import main

    package = tmp_path / "m"
    assert main(["finetune", "merge", str(lora_run / "adapter"), "--base", str(base / "model"),
                 "--out", str(package)]) == 0  # fmt: skip
    got = model_tensors(load_model_package(package)[0])
    want = model_tensors(load_model_package(lora_run / "model")[0])
    assert_close_tensors(got, want, "merged from the adapter dir", 0, 1e-6)
    with pytest.raises(AdapterError, match="trained on base weights"):
        merge_adapter_package(lora_run / "adapter", str(lora_run / "model"), tmp_path / "x")

    tampered = tmp_path / "tampered"
    shutil.copytree(lora_run / "adapter", tampered)
    weights = tampered / "adapter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="sha256"):
        load_adapter(tampered)


def test_lora_checkpoint_resumes_exactly(
    shards: Path, base: Path, lora_run: Path, tmp_path: Path
) -> None:
    assert_one_process_resume(lora_run, lora_settings(shards, base), tmp_path, "LoRA")


def v1_checkpoint(package: Path, root: Path) -> Path:
    """PACKAGE's weights as a v1 (whole-tensor) checkpoint step directory."""
    from training.checkpoint.format import save_checkpoint
    from training.optim.adamw import build_optimizer

    model, config, _ = load_model_package(package)
    optimizer, names = build_optimizer(model, config_of({}).optimizer, torch.device("cpu"))
    state = {"model_config": config.model_dump(mode="json"), "consumed_samples": 0}
    return save_checkpoint(root, STEPS, model, optimizer, names, state)


def test_every_starting_point_gives_the_same_model(
    shards: Path, base: Path, registered: str, store: str, tmp_path: Path
) -> None:
    from training.interop.export import export_hf

    sources = {
        "package": str(base / "model"),
        "checkpoint": str(base / "checkpoints"),  # v2, the root: its latest step (4)
        "checkpoint-v1": str(v1_checkpoint(base / "model", tmp_path / "v1")),
        "registered": registered,
        "hf": str(export_hf(base / "model", tmp_path / "hf")),
    }
    losses, ids = {}, {}
    for kind, uri in sources.items():
        settings = trainer_settings(
            shards, {"finetune.base": uri, "logging.tracking_uri": store, **LORA}
        )
        trainer = Trainer(config_of(settings), tmp_path / kind)
        assert trainer.finetune.base.kind == kind.split("-")[0]
        ids[kind] = trainer.finetune.base.content_id
        losses[kind] = trainer.evaluate()
    assert len(set(ids.values())) == 1, ids
    assert len(set(losses.values())) == 1, losses
    # The base's own validation loss at its end: the same model.
    assert losses["package"] == pytest.approx(metrics(base)[-1]["val_loss"], abs=1e-6)


def test_full_finetune_from_a_registered_model_records_lineage(
    shards: Path, base: Path, registered: str, store: str, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from training.mlflow_store.runs import open_run_logger

    settings = trainer_settings(
        shards,
        {
            "finetune.base": registered,
            "logging.tracking_uri": store,
            "logging.mlflow": "true",
            "training.train_iters": 2,
            "checkpoint.interval": 0,
        },
    )
    config = config_of(settings)
    run_logger = open_run_logger(config.logging, "full-ft", 0, system_metrics=False)
    result = Trainer(config, tmp_path / "run", run_logger).fit(show_progress=False)
    run_logger.close()
    assert result.adapter is None
    tuned = model_tensors(load_model_package(result.model_package)[0])
    start = model_tensors(load_model_package(base / "model")[0])
    assert all(not torch.equal(tuned[n], start[n]) for n in start), "a parameter did not train"

    tags = MlflowClient(tracking_uri=store).get_run(run_logger.run_id).data.tags
    assert tags["megalith.base.name"] == "tiny-base" and tags["megalith.base.version"] == "1"
    assert tags["megalith.base.uri"] == registered
    assert tags["megalith.finetune.method"] == "full"
    manifest = shards / "manifest.json"
    from megalith.storage import sha256_of_file

    assert tags["megalith.data.manifest_sha256"] == sha256_of_file(str(manifest))
    lineage = json.loads((result.model_package / "config.json").read_text())["lineage"]
    assert lineage["megalith.base.content_id"] == tags["megalith.base.content_id"]


def test_model_keys_that_conflict_with_the_base_are_named(shards: Path, base: Path) -> None:
    settings = lora_settings(shards, base, **{"model.hidden_size": 64, "model.dropout": 0.1})
    with pytest.raises(ConfigError, match=r"model\.hidden_size = 64 \(the base has 32\)") as err:
        FineTune(config_of(settings))
    assert "dropout" not in str(err.value)  # a runtime key may differ
    with pytest.raises(ConfigError, match="finetune.lora needs finetune.base"):
        config_of(trainer_settings(shards, LORA))


def assert_reads_its_share(run: Path, base: Path, world: int, most: float, layout: str) -> None:
    """Each rank read at most ``most`` of the base's bytes to load it, one tensor's share
    at a time (one read: at most ``most`` of the largest tensor), and together they read
    all of it."""
    whole = model_tensors(load_model_package(base / "model")[0]).values()
    total, largest = sum(t.nbytes for t in whole), max(t.nbytes for t in whole)
    reads = [json.loads((run / f"base_reads_rank{r}.json").read_text()) for r in range(world)]
    assert sum(r["bytes"] for r in reads) >= total, f"{layout}: {reads} of {total} bytes"
    for rank, read in enumerate(reads):
        assert read["bytes"] <= most * total, f"{layout} rank {rank}: {read} of {total} bytes"
        assert read["largest_bytes"] <= most * largest, f"{layout} rank {rank}: {read}"


def test_tensor_and_data_parallel_lora_match_one_process(
    shards: Path, base: Path, lora_run: Path, tmp_path: Path
) -> None:
    """TP=2 (and with sequence parallelism), DP=2 with ZeRO-1, and FSDP=2 built on meta
    (adapters added on meta, sharded with their block, each rank's rows drawn from their
    seeded init), on torchrun + gloo: the same losses, grad norms, whole checkpoint
    (under TP the adapters are split: B of qkv/fc1 on rows, A of proj/fc2 on columns),
    exact resume, merged package and adapter as one process; under TP and FSDP each rank
    read half the base."""
    cases = {
        "tp2": lora_settings(shards, base, **{"parallel.tensor": 2}),
        "tp2-sp": lora_settings(
            shards, base, **{"parallel.tensor": 2, "parallel.sequence_parallel": "true"}
        ),
        # Data parallel with ZeRO-1 over the adapters alone (frozen base beside them).
        "dp2-zero1": lora_settings(
            shards, base, **{"parallel.data_parallel_mode": "distributed_optimizer"}
        ),
        "fsdp2": lora_settings(shards, base, **{"parallel.data_parallel_mode": "fsdp"}),
    }
    run_trainer_worker(tmp_path, cases, world=2, label="LoRA TP=2 / DP=2 / FSDP=2")
    for layout in cases:
        run = tmp_path / layout
        recorded = last_checkpoint_state(run)["layout"]
        tp = 2 if layout.startswith("tp2") else 1
        assert (recorded["parallel.tensor"], recorded["parallel.data"]) == (tp, 2 // tp), recorded
        assert_metrics_match(metrics(run), metrics(lora_run), layout)
        assert_whole_checkpoint(run, lora_run, layout)
        assert_resume_exact(run, tmp_path / f"{layout}-resumed", layout)
        assert_package_logits_match(run, lora_run, layout)
        # TP splits the linears and the vocabulary (the norms are replicated), FSDP every
        # tensor's rows; DP reads all.
        assert_reads_its_share(run, base, 2, 1.0 if layout == "dp2-zero1" else 0.51, layout)
        assert_close_tensors(
            load_adapter(run / "adapter").tensors,
            load_adapter(lora_run / "adapter").tensors,
            f"{layout} adapter",
        )


@pytest.mark.slow
def test_lora_under_fsdp_times_tensor_parallelism_matches_one_process(
    shards: Path, base: Path, lora_run: Path, tmp_path: Path
) -> None:
    """TP=2 × FSDP=2 (4 processes, 2-D): adapters split by TP and then by FSDP rows; the
    same losses, grad norms, whole checkpoint, exact resume, merged package and adapter
    (gathered over FSDP rows, then TP shards) as one process."""
    layout = "tp2-fsdp2"
    settings = {"parallel.tensor": 2, "parallel.data_parallel_mode": "fsdp"}
    cases = {layout: lora_settings(shards, base, **settings)}
    run_trainer_worker(tmp_path, cases, world=4, label="LoRA TP=2 x FSDP=2")
    run = tmp_path / layout
    recorded = last_checkpoint_state(run)["layout"]
    assert (recorded["parallel.tensor"], recorded["parallel.data"]) == (2, 2), recorded
    assert_metrics_match(metrics(run), metrics(lora_run), layout)
    assert_whole_checkpoint(run, lora_run, layout)
    assert_resume_exact(run, tmp_path / f"{layout}-resumed", layout)
    assert_package_logits_match(run, lora_run, layout)
    assert_close_tensors(
        load_adapter(run / "adapter").tensors,
        load_adapter(lora_run / "adapter").tensors,
        f"{layout} adapter",
    )


def test_full_finetune_under_fsdp_built_on_meta_matches_one_process(
    shards: Path, base: Path, tmp_path: Path
) -> None:
    """Full fine-tuning with FSDP over 2 gloo processes: the model is built on meta and
    sharded, each rank reads and copies only its rows of the base over the replayed
    init (about half the base's bytes, one tensor's rows at a time), and the
    run gives one process's losses, grad norms and whole checkpoint, and resumes exactly."""
    settings = trainer_settings(shards, {"finetune.base": str(base / "model")})
    reference = fit_one_process(settings, tmp_path / "one")
    cases = {"fsdp": {**settings, "parallel.data_parallel_mode": "fsdp"}}
    run_trainer_worker(tmp_path, cases, world=2, label="full fine-tune FSDP DP=2")
    run = tmp_path / "fsdp"
    assert last_checkpoint_state(run)["layout"]["parallel.data"] == 2
    assert_metrics_match(metrics(run), metrics(reference), "fsdp full fine-tune")
    assert_whole_checkpoint(run, reference, "fsdp full fine-tune")
    assert_resume_exact(run, tmp_path / "fsdp-resumed", "fsdp full fine-tune")
    assert_reads_its_share(run, base, 2, 0.51, "fsdp full fine-tune")  # its rows alone


@pytest.mark.slow
def test_finetunes_in_pipeline_stages_match_one_process(
    shards: Path, base: Path, lora_run: Path, tmp_path: Path
) -> None:
    """Full and LoRA fine-tuning with PP=2 (2 gloo processes): each stage reads its own
    layers of the base (together all of it, each less); the runs give one process's losses,
    grad norms and whole checkpoint and resume exactly; LoRA's adapter (gathered from both
    stages) and merged package equal one process's."""
    settings = trainer_settings(shards, {"finetune.base": str(base / "model")})
    reference = fit_one_process(settings, tmp_path / "one")
    cases = {
        "full-pp2": {**settings, "parallel.pipeline": 2},
        "lora-pp2": lora_settings(shards, base, **{"parallel.pipeline": 2}),
    }
    run_trainer_worker(tmp_path, cases, world=2, label="fine-tunes PP=2")
    whole = sum(t.nbytes for t in model_tensors(load_model_package(base / "model")[0]).values())
    for layout, one in (("full-pp2", reference), ("lora-pp2", lora_run)):
        run = tmp_path / layout
        assert last_checkpoint_state(run)["layout"]["parallel.pipeline"] == 2
        assert_metrics_match(metrics(run), metrics(one), layout)
        assert_whole_checkpoint(run, one, layout)
        assert_resume_exact(run, tmp_path / f"{layout}-resumed", layout)
        reads = [
            json.loads((run / f"base_reads_rank{r}.json").read_text())["bytes"] for r in (0, 1)
        ]
        assert sum(reads) >= whole and max(reads) < whole, (layout, reads, whole)
    assert_package_logits_match(tmp_path / "lora-pp2", lora_run, "lora-pp2")
    assert_close_tensors(
        load_adapter(tmp_path / "lora-pp2" / "adapter").tensors,
        load_adapter(lora_run / "adapter").tensors,
        "lora-pp2 adapter",
    )


@pytest.mark.slow
def test_finetunes_in_fsdp_pipeline_stages_match_one_process(
    shards: Path, base: Path, lora_run: Path, tmp_path: Path
) -> None:
    """Full and LoRA fine-tuning with PP=2 × DP=2 under FSDP (4 gloo processes): each
    stage reads its layers of the base, then FSDP shards them over the data-parallel ranks
    (LoRA: the frozen base and its adapters in the same units); losses, grad norms, whole
    checkpoint, exact resume, adapter and merged package equal one process's."""
    settings = trainer_settings(shards, {"finetune.base": str(base / "model")})
    reference = fit_one_process(settings, tmp_path / "one")
    fsdp = {"parallel.pipeline": 2, "parallel.data_parallel_mode": "fsdp"}
    cases = {
        "full-pp2-dp2-fsdp": {**settings, **fsdp},
        "lora-pp2-dp2-fsdp": lora_settings(shards, base, **fsdp),
    }
    run_trainer_worker(tmp_path, cases, world=4, label="fine-tunes PP=2 x DP=2 FSDP")
    for layout, one in (("full-pp2-dp2-fsdp", reference), ("lora-pp2-dp2-fsdp", lora_run)):
        run = tmp_path / layout
        state = last_checkpoint_state(run)
        assert (state["layout"]["parallel.pipeline"], state["layout"]["parallel.data"]) == (2, 2)
        assert_metrics_match(metrics(run), metrics(one), layout)
        assert_whole_checkpoint(run, one, layout)
        assert_resume_exact(run, tmp_path / f"{layout}-resumed", layout)
        assert_saved_in_row_halves(run, layout)
    assert_package_logits_match(tmp_path / "lora-pp2-dp2-fsdp", lora_run, "lora-pp2-dp2-fsdp")
    assert_close_tensors(
        load_adapter(tmp_path / "lora-pp2-dp2-fsdp" / "adapter").tensors,
        load_adapter(lora_run / "adapter").tensors,
        "lora-pp2-dp2-fsdp adapter",
    )


def test_megalith_train_runs_the_finetune_recipe(shards: Path, base: Path, tmp_path: Path) -> None:
    """``megalith train --config configs/finetune-lora-tiny.yaml --set finetune.base=...``."""
    from parallel_helpers import REPO, set_args, tiny_settings

    from pipelines.cli import main

    settings = tiny_settings(
        shards, {"finetune.base": str(base / "model"), "training.train_iters": 2}
    )
    recipe = REPO / "configs" / "finetune-lora-tiny.yaml"
    out = tmp_path / "run"
    assert (
        main(
            ["train", "--config", str(recipe), "--output", str(out), "--quiet", *set_args(settings)]
        )
        == 0
    )
    summary = json.loads((out / "result.json").read_text())
    assert summary["steps"] == 2 and summary["adapter"] == str(out / "adapter")
    record = json.loads((out / "adapter" / "adapter.json").read_text())
    assert record["lora"]["rank"] == 8 and record["lora"]["target_modules"] == [
        "qkv",
        "proj",
        "fc1",
        "fc2",
    ]
