"""The typed config tree: YAML recipes, error messages that name the key, --set overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalith.config import (
    ConfigError,
    DataConfig,
    MegalithConfig,
    ModelConfig,
    TokenizerConfig,
    dump_config,
    load_config,
)
from megalith.errors import MegalithError

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text), overrides)
    return str(caught.value)


# ---------------------------------------------------------------- recipes


def test_there_are_recipes() -> None:
    assert any(path.name == "sample-data.yaml" for path in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES, ids=[path.name for path in RECIPES])
def test_every_recipe_validates(recipe: Path, tmp_path: Path) -> None:
    config = load_config(recipe)
    assert isinstance(config, MegalithConfig)
    assert config != MegalithConfig()  # a recipe sets something
    # Dumped to YAML and loaded again, it is the same tree.
    assert load_config(write(tmp_path, dump_config(config))) == config


def test_sample_recipe_values() -> None:
    config = load_config(REPO / "configs" / "sample-data.yaml")
    assert config.name == "sample-data"
    assert config.tokenizer.vocab_size == 2048
    assert config.tokenizer.model_type == "bpe"
    assert config.data.inputs == ["preprocessing/sample_corpus/stories.jsonl"]
    assert config.data.shards == 4
    assert config.data.on_bad_record == "skip"
    assert config.data.split == (0.9, 0.05, 0.05)
    assert (REPO / config.data.inputs[0]).is_file()


def test_empty_recipe_gives_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config == MegalithConfig()
    assert config.data.on_bad_record == "fail"
    assert config.data.append_eod is True
    assert config.tokenizer.special_tokens[0] == "<|eod|>"


# ---------------------------------------------------------------- errors name the key


def test_unknown_key_names_its_path(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  shardz: 4\n")
    assert "data.shardz: unknown key" in message
    assert str(tmp_path / "recipe.yaml") in message


def test_unknown_section_names_it(tmp_path: Path) -> None:
    assert "datta: unknown key" in config_error(tmp_path, "datta:\n  shards: 4\n")


def test_unknown_key_inside_a_list_names_the_index(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  blend:\n    - {path: a, wieght: 2}\n")
    assert "data.blend.0.wieght: unknown key" in message


def test_unknown_key_says_what_was_expected(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  shardz: 4\n")
    line = next(line for line in message.splitlines() if "data.shardz" in line)
    assert "shards" in line.replace("shardz", "")


def test_wrong_type_names_key_expected_type_and_value(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  shards: four\n")
    assert "1 problem(s)" in message
    assert "data.shards:" in message
    assert "valid integer" in message
    assert "'four'" in message


def test_wrong_choice_lists_the_choices(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  on_bad_record: maybe\n")
    assert "data.on_bad_record:" in message
    assert "'fail' or 'skip'" in message
    assert "'maybe'" in message


def test_out_of_range_says_the_bound(tmp_path: Path) -> None:
    message = config_error(tmp_path, "tokenizer:\n  vocab_size: 10\n")
    assert "tokenizer.vocab_size:" in message
    assert "greater than or equal to 64" in message


def test_every_problem_is_listed(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  shards: x\n  workers: y\n  bogus: 1\n")
    assert "3 problem(s)" in message
    for key in ("data.shards", "data.workers", "data.bogus"):
        assert f"  {key}:" in message


def test_section_of_wrong_type(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data: 3\n")
    assert "data:" in message
    assert "valid dictionary" in message


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert "expected a mapping" in config_error(tmp_path, "- a\n- b\n")


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data: [unclosed\n")
    assert "not valid YAML" in message


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


def test_config_errors_are_megalith_errors() -> None:
    # The command line prints MegalithError as one line instead of a traceback.
    assert issubclass(ConfigError, MegalithError)


# ---------------------------------------------------------------- safe_load


def test_python_object_tag_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"name: !!python/object/apply:os.system ['touch {marker}']\n"
    message = config_error(tmp_path, text)
    assert "not valid YAML" in message
    assert "python/object" in message
    assert not marker.exists()


def test_python_object_tag_is_refused_in_overrides(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, [f"name=!!python/object/apply:os.system ['touch {marker}']"])
    assert not marker.exists()


# ---------------------------------------------------------------- --set overrides


def test_override_beats_recipe(tmp_path: Path) -> None:
    recipe = write(tmp_path, "data:\n  shards: 2\n  workers: 1\n")
    config = load_config(recipe, ["data.shards=8"])
    assert config.data.shards == 8
    assert config.data.workers == 1


def test_override_values_are_yaml(tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            "data.inputs=[a.jsonl, 's3://b/c/*.jsonl']",
            "data.append_eod=false",
            "data.split=[0.8, 0.1, 0.1]",
            "tokenizer.character_coverage=1.0",
            "name=run 7",
        ],
    )
    assert config.data.inputs == ["a.jsonl", "s3://b/c/*.jsonl"]
    assert config.data.append_eod is False
    assert config.data.split == (0.8, 0.1, 0.1)
    assert config.tokenizer.character_coverage == 1.0
    assert config.name == "run 7"


def test_override_creates_nested_keys() -> None:
    config = load_config(None, ["data.storage_options.endpoint_url=http://127.0.0.1:9000"])
    assert config.data.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}


def test_override_list_of_sections() -> None:
    config = load_config(None, ["data.blend=[{path: a, weight: 2}, {path: b}]"])
    assert [(s.path, s.weight) for s in config.data.blend] == [("a", 2.0), ("b", 1.0)]


def test_later_override_wins() -> None:
    assert load_config(None, ["data.shards=2", "data.shards=3"]).data.shards == 3


def test_explicit_values_beat_overrides() -> None:
    # What dedicated command-line flags set (--shards) is applied after --set.
    config = load_config(None, ["data.shards=2"], {"data.shards": 5, "data.inputs": ["x y"]})
    assert config.data.shards == 5
    assert config.data.inputs == ["x y"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.shards", "expected KEY=VALUE"),
        ("=3", "empty key"),
        ("data.inputs=[a", "not valid YAML"),
    ],
)
def test_bad_override_syntax(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert expected in str(caught.value)
    assert repr(override) in str(caught.value)


def test_override_into_a_value_is_refused(tmp_path: Path) -> None:
    message = config_error(tmp_path, "data:\n  shards: 2\n", ["data.shards.x=3"])
    assert "data.shards is a value, not a section" in message


def test_override_of_unknown_key_names_it() -> None:
    with pytest.raises(ConfigError, match=r"data\.shardz: unknown key"):
        load_config(None, ["data.shardz=3"])


def test_override_of_wrong_type_names_it() -> None:
    with pytest.raises(ConfigError, match=r"data\.workers: .*greater than or equal to 1"):
        load_config(None, ["data.workers=0"])


# ---------------------------------------------------------------- sections


def test_split_must_have_a_positive_share() -> None:
    with pytest.raises(ConfigError, match="split"):
        load_config(None, ["data.split=[0, 0, 0]"])


def test_training_sources_default_to_output() -> None:
    assert [s.path for s in DataConfig(output="out").training_sources()] == ["out"]
    with pytest.raises(ConfigError, match="nothing to train on"):
        DataConfig().training_sources()


def test_assignment_is_validated() -> None:
    config = TokenizerConfig()
    with pytest.raises(ValueError, match="vocab_size"):
        config.vocab_size = "many"  # type: ignore[assignment]


# ---------------------------------------------------------------- size limits, suggestions


@pytest.mark.parametrize(
    ("text", "key", "limit"),
    [
        ("model:\n  num_layers: 10000000\n", "model.num_layers", "1024"),
        (
            "model:\n  max_position_embeddings: 10000000000\n",
            "model.max_position_embeddings",
            "16777216",
        ),
        ("model:\n  num_experts: 1000000\n", "model.num_experts", "4096"),
        ("model:\n  vocab_size: 1000000000\n", "model.vocab_size", "2097152"),
        ("data:\n  seq_length: 100000000000\n", "data.seq_length", "16777216"),
        ("data:\n  workers: 100000\n", "data.workers", "1024"),
    ],
)
def test_sizes_beyond_the_limits_are_refused_naming_key_and_limit(
    tmp_path: Path, text: str, key: str, limit: str
) -> None:
    message = config_error(tmp_path, text)
    assert f"{key}:" in message
    assert f"less than or equal to {limit}" in message


def test_the_largest_public_models_fit_the_limits() -> None:
    llama_405b = ModelConfig(
        num_layers=126,
        hidden_size=16384,
        num_attention_heads=128,
        num_query_groups=8,
        ffn_hidden_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
    )
    assert 4.0e11 < llama_405b.approximate_parameters() < 4.1e11
    deepseek_v3 = ModelConfig(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        ffn_hidden_size=18432,
        num_experts=256,
        moe_top_k=8,
        moe_ffn_hidden_size=2048,
        vocab_size=129280,
        max_position_embeddings=163840,
    )
    assert deepseek_v3.num_experts == 256


def test_a_model_too_large_in_total_is_refused(tmp_path: Path) -> None:
    text = "model:\n  num_layers: 1024\n  hidden_size: 65536\n  num_attention_heads: 512\n"
    message = config_error(tmp_path, text)
    assert "model:" in message
    assert "parameters, more than the 1e+13 limit" in message


def test_mistyped_recipe_key_suggests_the_nearest(tmp_path: Path) -> None:
    message = config_error(tmp_path, "model:\n  num_layer: 2\n")
    assert "model.num_layer: unknown key (did you mean model.num_layers?)" in message


def test_mistyped_override_suggests_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"did you mean model\.num_layers\?"):
        load_config(None, ["model.num_layer=2"])
    with pytest.raises(ConfigError, match=r"modle: unknown key \(did you mean model\?\)"):
        load_config(None, ["modle.num_layers=2"])


def test_unknown_key_far_from_every_key_suggests_nothing() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["model.zzzzzz=2"])
    assert "did you mean" not in str(caught.value)
    assert "expected one of: family" in str(caught.value)


def test_a_boolean_where_a_number_belongs_is_refused(tmp_path: Path) -> None:
    message = config_error(tmp_path, "model:\n  num_layers: true\n")
    assert "model.num_layers:" in message
    assert "not a boolean" in message
