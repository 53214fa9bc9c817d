"""Model sizes read from files are bounded before use (issue 16, section 2).

A recipe, a model package's config.json or an HF config.json that asks for 10^7 layers
or 10^10 positions is refused by the schema in well under a second, naming the key and
the limit; a config within the limits that disagrees with the weights beside it is
refused from the safetensors header, before any model is built; no buffer is sized by
max_position_embeddings alone. Real files, the real loaders, the CLI as a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluation.cli import package_max_positions, read_prompts
from megalith.config import ConfigError, ModelConfig, OptimizerConfig, load_config
from megalith.errors import MegalithError
from tests.test_data_cli import assert_clean_error, megalith
from training.checkpoint.format import save_checkpoint
from training.finetune.base import load_base
from training.interop.export import export_hf
from training.interop.hf import HFInteropError, import_hf, model_config_from_hf
from training.mlflow_store.registered import RegistryError, check_mlmodel, verify_package
from training.models import build_model
from training.models.gpt import GPTModel
from training.models.layers import cache_rope_tables
from training.models.package import (
    PackageConfigError,
    PackageTensorError,
    load_model_package,
    save_model_package,
    sha256_file,
)
from training.optim.adamw import build_optimizer

REPO = Path(__file__).resolve().parents[1]
VOCAB = 448  # 400 SentencePiece pieces padded to a multiple of 64
HUGE = {
    "num_layers": (10**7, "1024"),
    "max_position_embeddings": (10**10, "16777216"),
    "num_experts": (10**6, "4096"),
    "vocab_size": (10**12, "2097152"),
    "hidden_size": (10**9, "65536"),
    "ffn_hidden_size": (10**9, "262144"),
}


def tiny_config(**overrides: Any) -> ModelConfig:
    values = {
        "style": "llama",
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 48,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
    }
    return ModelConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def saved_package(tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    root = tmp_path_factory.mktemp("pkg")
    return save_model_package(model, model.config, tokenizer_file, root / "pkg")


@pytest.fixture(scope="module")
def saved_hf_dir(saved_package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(saved_package, tmp_path_factory.mktemp("hf") / "hf")


@pytest.fixture
def package(saved_package: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_package, tmp_path / "pkg"))


@pytest.fixture
def hf_dir(saved_hf_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_hf_dir, tmp_path / "hf"))


def set_package_model(package: Path, **model: Any) -> None:
    """Rewrite config.json's model section and its checksum, as a crafted package would."""
    meta = json.loads((package / "config.json").read_text())
    meta["model"].update(model)
    write_package_config(package, json.dumps(meta).encode())


def write_package_config(package: Path, data: bytes) -> None:
    (package / "config.json").write_bytes(data)
    checksums = json.loads((package / "checksums.json").read_text())
    checksums["files"]["config.json"] = sha256_file(package / "config.json")
    (package / "checksums.json").write_text(json.dumps(checksums))


def set_hf_config(hf_dir: Path, **values: Any) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **values}))


def refused_within_a_second(error: type[Exception], match: str, load: Any) -> str:
    start = time.monotonic()
    with pytest.raises(error, match=match) as caught:
        load()
    assert time.monotonic() - start < 1.0
    return str(caught.value)


# ---------------------------------------------------------------- model packages


@pytest.mark.parametrize("key", sorted(HUGE))
def test_package_asking_for_an_absurd_size_is_refused_within_a_second(
    package: Path, key: str
) -> None:
    value, limit = HUGE[key]
    set_package_model(package, **{key: value})
    message = refused_within_a_second(PackageConfigError, key, lambda: load_model_package(package))
    assert "config.json" in message
    assert f"less than or equal to {limit}" in message


def test_cli_refuses_a_package_of_ten_million_layers_cleanly(package: Path, tmp_path: Path) -> None:
    set_package_model(package, num_layers=10**7)
    result = megalith("export", "hf", package, tmp_path / "out")
    assert_clean_error(result, "config.json", "num_layers", "less than or equal to 1024")
    assert not (tmp_path / "out").exists()


def test_package_saying_more_layers_than_its_weights_is_refused_before_building(
    package: Path,
) -> None:
    set_package_model(package, num_layers=1000)  # within limits; building it takes seconds
    message = refused_within_a_second(
        PackageTensorError, "model.num_layers is 1000", lambda: load_model_package(package)
    )
    assert "the weights hold blocks 0..1 under layers.*" in message


def test_t5_package_saying_more_decoder_layers_than_its_weights_names_the_key(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    config = tiny_config(family="t5", style="llama", num_query_groups=None, vocab_size=VOCAB)
    model = build_model(config)
    path = save_model_package(model, config, tokenizer_file, tmp_path / "t5")
    set_package_model(path, num_decoder_layers=500)
    refused_within_a_second(
        PackageTensorError,
        r"model.num_decoder_layers is 500, the weights hold blocks 0..1 under decoder.layers",
        lambda: load_model_package(path),
    )


def test_package_width_disagreeing_with_its_embedding_names_the_key(package: Path) -> None:
    set_package_model(package, hidden_size=64, num_attention_heads=4)
    with pytest.raises(PackageTensorError, match=r"model.hidden_size is 64.*\[448, 32\]"):
        load_model_package(package)


def test_package_ffn_disagreeing_with_a_tensor_names_the_keys(package: Path) -> None:
    set_package_model(package, ffn_hidden_size=96)
    with pytest.raises(
        PackageTensorError, match=r"tensor layers.0.mlp.fc1.linear.weight .*model.ffn_hidden_size"
    ):
        load_model_package(package)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("abc", "valid integer"), (True, "not a boolean"), (None, "valid integer")],
)
def test_package_size_of_the_wrong_type_names_file_and_key(
    package: Path, value: Any, expected: str
) -> None:
    set_package_model(package, hidden_size=value)
    with pytest.raises(PackageConfigError, match=f"(?s)config.json.*hidden_size.*{expected}"):
        load_model_package(package)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"[" * 100_000, "nested deeper than"),
        (b'{"format": ', "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b" " * (2 << 20), "larger than the"),
    ],
)
def test_package_config_json_malformed_is_refused_naming_it(
    package: Path, data: bytes, expected: str
) -> None:
    write_package_config(package, data)
    with pytest.raises(PackageConfigError, match=f"config.json.*{expected}"):
        load_model_package(package)


def test_rope_table_is_sized_by_the_positions_used_not_the_config(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    """A package may say 16M positions (within limits, RoPE needs no weights for them):
    loading it and running 8 tokens must not build a 16M-row cos/sin table (8 GB)."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config(max_position_embeddings=1 << 24))
    path = save_model_package(model, model.config, tokenizer_file, tmp_path / "pkg")
    loaded, config, _ = load_model_package(path)
    assert config.max_position_embeddings == 1 << 24
    x = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))
    assert loaded.rope._table[0].shape == (4096, config.head_dim)


def test_a_compiled_forward_keeps_no_rope_table_made_inside_its_graph() -> None:
    """Compiled, RoPE computes its cos/sin in the graph and caches nothing on the module: a
    cached graph output is overwritten by the next replay under CUDA graphs
    (``training.compile_mode=reduce-overhead``). The logits are the eager model's."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config()).eval()
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        compiled = torch.compile(model, backend="aot_eager")(x)
        assert model.rope._table is None
        torch.testing.assert_close(compiled, model(x), rtol=1e-5, atol=1e-5)
    assert model.rope._table is not None  # eager runs keep their table


def test_a_table_cached_before_compiling_is_read_by_the_graph_not_recomputed() -> None:
    """``cache_rope_tables`` (called before ``torch.compile`` by ``parallelize``): the
    compiled forward slices the cached table, so no sin or cos of the angles is left in
    its graph for Inductor to fuse into every kernel that applies RoPE; same logits."""
    targets: dict[bool, set[str]] = {}
    for cached in (False, True):
        torch.manual_seed(0)
        model = GPTModel(tiny_config()).eval()
        if cached:
            cache_rope_tables(model, 8, torch.device("cpu"))
        seen: set[str] = set()

        def backend(graph: torch.fx.GraphModule, inputs: list, seen: set[str] = seen):
            seen.update(str(node.target) for node in graph.graph.nodes)
            return graph

        x = torch.randint(0, VOCAB, (2, 8))
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
        targets[cached] = seen
    assert {"sin", "cos"} <= targets[False]
    assert not {"sin", "cos"} & targets[True]


def test_packed_documents_compiled_gather_their_angles_from_the_cached_table() -> None:
    """Packed documents (positions restart at each document) in a compiled forward with a
    cached table: the angles are gathered from it by position, no sin or cos in the graph,
    and the logits are the eager model's."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config()).eval()
    cache_rope_tables(model, 8, torch.device("cpu"))
    seen: set[str] = set()

    def backend(graph: torch.fx.GraphModule, inputs: list):
        seen.update(str(node.target) for node in graph.graph.nodes)
        return graph

    x = torch.randint(0, VOCAB, (2, 8))
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)(x, document_ids=documents)
        torch.testing.assert_close(compiled, model(x, document_ids=documents))
    assert seen and not {"sin", "cos"} & seen


@pytest.mark.parametrize(
    ("lie", "expected"),
    [
        ({"num_layers": 1000}, "model.num_layers is 1000, the weights hold blocks 0..1"),
        ({"ffn_hidden_size": 200_000}, r"mlp.fc1.linear.weight is \[96, 32\].*ffn_hidden_size"),
    ],
)
def test_checkpoint_base_whose_state_json_lies_about_sizes_is_refused_before_building(
    tmp_path: Path, lie: dict[str, Any], expected: str
) -> None:
    """finetune.base: a checkpoint whose state.json says more than its weights hold."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    optimizer, names = build_optimizer(model, OptimizerConfig(), torch.device("cpu"))
    state = {"consumed_samples": 0, "model_config": {**model.config.model_dump(mode="json"), **lie}}
    save_checkpoint(tmp_path / "base", 1, model, optimizer, names, state, keep_last=1)
    refused_within_a_second(
        MegalithError,
        f"state.json: model_config.*{expected}",
        lambda: load_base(str(tmp_path / "base")),
    )


# ---------------------------------------------------------------- Hugging Face import


def test_cli_refuses_an_hf_config_of_ten_billion_positions_naming_its_key(
    hf_dir: Path, tmp_path: Path
) -> None:
    set_hf_config(hf_dir, max_position_embeddings=10**10)
    result = megalith("import", "hf", hf_dir, tmp_path / "pkg")
    assert_clean_error(result, "config.json", "max_position_embeddings", "16777216")
    assert not (tmp_path / "pkg").exists()


def test_hf_config_of_ten_million_layers_is_refused_within_a_second(
    hf_dir: Path, tmp_path: Path
) -> None:
    set_hf_config(hf_dir, num_hidden_layers=10**7)
    message = refused_within_a_second(
        HFInteropError, "num_hidden_layers", lambda: import_hf(hf_dir, tmp_path / "pkg")
    )
    assert "less than or equal to 1024" in message


def test_hf_config_saying_more_layers_than_its_weights_is_refused_before_building(
    hf_dir: Path, tmp_path: Path
) -> None:
    set_hf_config(hf_dir, num_hidden_layers=1000)
    refused_within_a_second(
        HFInteropError,
        "num_hidden_layers is 1000, the weights hold 2 numbered blocks",
        lambda: import_hf(hf_dir, tmp_path / "pkg"),
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"hidden_size": "abc"}, "key 'hidden_size' is string 'abc'; expected integer"),
        ({"num_attention_heads": 0}, "key 'num_attention_heads' is 0; expected at least 1"),
        ({"num_attention_heads": True}, "key 'num_attention_heads' is boolean"),
        ({"num_hidden_layers": "two"}, r"num_hidden_layers \(num_layers\)"),
        ({"vocab_size": 512}, "vocab_size 512 and hidden_size 32 disagree"),
    ],
)
def test_hf_config_of_wrong_types_names_file_and_key(
    hf_dir: Path, tmp_path: Path, values: dict[str, Any], expected: str
) -> None:
    set_hf_config(hf_dir, **values)
    with pytest.raises(MegalithError, match=f"(?s)config.json.*{expected}"):
        import_hf(hf_dir, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize(
    "weight_map",
    [{"a": "../model.safetensors"}, {"a": ["model.safetensors"]}, {"a": 3, "b": "x"}],
)
def test_hf_index_naming_odd_files_is_refused(
    hf_dir: Path, tmp_path: Path, weight_map: dict[str, Any]
) -> None:
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(HFInteropError, match="model.safetensors.index.json: weight_map"):
        import_hf(hf_dir, tmp_path / "pkg")


# ---------------------------------------------------------------- recipes


def test_cli_refuses_a_recipe_of_ten_million_layers_and_suggests_keys(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  num_layers: 10000000\n  hidden_sise: 64\n")
    result = megalith("train", "--config", recipe)
    assert_clean_error(
        result,
        "model.num_layers: Input should be less than or equal to 1024",
        "model.hidden_sise: unknown key (did you mean model.hidden_size?)",
    )


def test_cli_suggests_the_nearest_key_for_a_mistyped_override(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  num_layers: 2\n")
    result = megalith("train", "--config", recipe, "--set", "model.num_layer=2")
    assert_clean_error(result, "model.num_layer: unknown key (did you mean model.num_layers?)")


# ---------------------------------------------------------------- registry and eval reads


def test_registry_refuses_a_billion_laughs_mlmodel(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["x", "x"]']
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 40)]
    (tmp_path / "MLmodel").write_text("\n".join(lines) + "\nflavors: *a39\n")
    with pytest.raises(RegistryError, match="MLmodel: more than 64 YAML aliases"):
        check_mlmodel(tmp_path / "MLmodel")


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "flavors: [python_function]\n", ": :\n"])
def test_registry_refuses_an_mlmodel_of_the_wrong_shape(tmp_path: Path, text: str) -> None:
    (tmp_path / "MLmodel").write_text(text)
    with pytest.raises(RegistryError, match="MLmodel"):
        check_mlmodel(tmp_path / "MLmodel")


@pytest.mark.parametrize(
    ("loader", "accepted"),
    [("registry.mlflow_pyfunc", True), ("deploy.mlflow_pyfunc", True), ("os", False)],
)
def test_registry_accepts_only_megaliths_loader_modules(
    tmp_path: Path, loader: str, accepted: bool
) -> None:
    """Versions registered before the pyfunc wrapper moved to registry/ name
    deploy.mlflow_pyfunc and still load; any other loader module is refused."""
    (tmp_path / "MLmodel").write_text(
        f"flavors:\n  python_function:\n    loader_module: {loader}\n"
    )
    if accepted:
        check_mlmodel(tmp_path / "MLmodel")
    else:
        with pytest.raises(RegistryError, match="loader 'os'"):
            check_mlmodel(tmp_path / "MLmodel")


@pytest.mark.parametrize(
    "data", [b'{"files": ["a"]}', b"[" * 100_000, b"\xff\xfe", b'{"files": {"a": 1}}']
)
def test_registry_refuses_malformed_checksums(package: Path, data: bytes) -> None:
    (package / "checksums.json").write_bytes(data)
    with pytest.raises(RegistryError, match="checksums.json"):
        verify_package(package)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("abc", "is string 'abc'; expected integer"),
        (True, "is boolean"),
        (10**10, "is 10000000000; expected at most 16777216"),
    ],
)
def test_eval_reads_the_context_length_typed_and_bounded(
    package: Path, value: Any, expected: str
) -> None:
    set_package_model(package, max_position_embeddings=value)
    with pytest.raises(
        MegalithError, match=f"config.json: model: key 'max_position_embeddings' {expected}"
    ):
        package_max_positions(str(package))


def test_eval_prompt_file_nested_too_deep_names_file_and_line(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(MegalithError, match="prompts.jsonl:2: JSON nested deeper"):
        read_prompts([str(prompts)])


# ---------------------------------------------------------------- fuzz

SIZE_KEYS = [
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "vocab_size", "max_position_embeddings", "num_experts", "moe_top_k", "moe_ffn_hidden_size",
]  # fmt: skip
NUMBERS = st.one_of(
    st.integers(min_value=-2, max_value=2**70),
    st.sampled_from([0, 1, 2, 4, 32, 48, 448, 1000, 1024, 1025, 10**7, 10**10]),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(st.dictionaries(st.sampled_from(SIZE_KEYS), NUMBERS, min_size=1, max_size=4))
def test_fuzz_package_config_sizes_only_megalith_errors(
    package: Path, model: dict[str, Any]
) -> None:
    meta = json.loads((package / "config.json").read_text())
    set_package_model(package, **model)
    start = time.monotonic()
    try:
        load_model_package(package)
    except MegalithError:
        pass
    finally:
        write_package_config(package, json.dumps(meta).encode())
    assert time.monotonic() - start < 5.0


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_package_config_bytes_only_megalith_errors(package: Path, data: bytes) -> None:
    write_package_config(package, data)
    with pytest.raises(MegalithError):
        load_model_package(package)


YAML_VALUES = st.one_of(
    NUMBERS.filter(lambda v: not isinstance(v, float)).map(json.dumps),
    st.sampled_from(["[1, 2]", "{a: 1}", "&x 3", "*y", "!!python/object:os.system x", "''", "~"]),
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from([*SIZE_KEYS, "num_layer", "style", "family", "vocab"]),
        YAML_VALUES,
        max_size=5,
    ),
    st.sampled_from(["model", "modle", "data", "training"]),
)
def test_fuzz_recipe_yaml_only_config_errors(
    tmp_path: Path, values: dict[str, str], section: str
) -> None:
    recipe = tmp_path / "fuzz.yaml"
    body = "".join(f"  {key}: {value}\n" for key, value in values.items())
    recipe.write_text(f"{section}:\n{body}" if body else f"{section}: {{}}\n")
    with contextlib.suppress(ConfigError):
        load_config(recipe)


HF_KEYS = [
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "vocab_size", "head_dim", "rope_theta",
    "rope_scaling", "n_layer", "n_embd", "n_head", "n_inner", "n_positions", "hidden_act",
]  # fmt: skip


@FUZZ
@given(
    st.sampled_from(["llama", "gpt2", None, 3, "t5"]),
    st.dictionaries(
        st.sampled_from(HF_KEYS),
        NUMBERS | st.dictionaries(st.sampled_from(["rope_type", "type"]), st.text(max_size=6)),
        max_size=8,
    ),
)
def test_fuzz_hf_config_only_megalith_errors(
    saved_hf_dir: Path, model_type: Any, values: dict[str, Any]
) -> None:
    config = json.loads((saved_hf_dir / "config.json").read_text())
    with contextlib.suppress(MegalithError):
        model_config_from_hf({**config, **values, "model_type": model_type})
