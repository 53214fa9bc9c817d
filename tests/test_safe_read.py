"""The shared JSON/YAML reader: size, nesting, alias and type limits on real files."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megalith import safe_read
from megalith.config import ConfigError, load_config
from megalith.safe_read import UnsafeFileError

BILLION_LAUGHS = """
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_a_recipe_with_a_billion_laughs_is_refused_quickly(tmp_path):
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text(BILLION_LAUGHS)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"laughs.yaml: more than 64 YAML aliases"):
        load_config(recipe)
    assert time.monotonic() - start < 1.0


def test_deep_nesting_is_refused_with_the_file_named(tmp_path):
    deep_json = tmp_path / "index.json"
    deep_json.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UnsafeFileError, match=r"index.json: JSON nested deeper than 64"):
        safe_read.read_json(deep_json)
    moderately_deep = tmp_path / "moderate.json"
    moderately_deep.write_text("[" * 200 + "]" * 200)
    with pytest.raises(UnsafeFileError, match=r"moderate.json: nested deeper than 64"):
        safe_read.read_json(moderately_deep)
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match=r"deep.yaml: YAML nested deeper than 64"):
        load_config(deep_yaml)


def test_size_limit_reads_no_more_than_the_limit(tmp_path):
    big = tmp_path / "manifest.json"
    big.write_bytes(b'{"pad": "' + b"x" * 2048 + b'"}')
    with pytest.raises(UnsafeFileError, match=r"manifest.json: larger than the 1024-byte limit"):
        safe_read.read_json(big, max_bytes=1024)


def test_device_files_and_symlinks_are_refused(tmp_path):
    link = tmp_path / "state.json"
    os.symlink("/dev/zero", link)
    start = time.monotonic()
    with pytest.raises(UnsafeFileError, match=r"state.json: is a symbolic link"):
        safe_read.read_json(link, allow_symlink=False)
    with pytest.raises(UnsafeFileError, match=r"state.json: not a regular file"):
        safe_read.read_json(link)
    assert time.monotonic() - start < 1.0


def test_wrong_types_name_the_key_and_the_expected_type():
    with pytest.raises(
        UnsafeFileError, match=r"m.json: key 'bytes' is string 'abc'; expected integer"
    ):
        safe_read.field({"bytes": "abc"}, "bytes", int, "m.json")
    with pytest.raises(UnsafeFileError, match=r"key 'bytes' is boolean True; expected integer"):
        safe_read.field({"bytes": True}, "bytes", int, "m.json")
    with pytest.raises(UnsafeFileError, match=r"key 'bytes' is -1; expected at least 0"):
        safe_read.field({"bytes": -1}, "bytes", int, "m.json", minimum=0)
    with pytest.raises(UnsafeFileError, match=r"missing key 'sha256'"):
        safe_read.field({}, "sha256", str, "m.json")
    assert safe_read.field({"bytes": 3}, "bytes", int, "m.json", minimum=0) == 3


@pytest.mark.parametrize("name", ["../x.bin", "/etc/passwd", "a/b.bin", "..", "", "a\\b", 7])
def test_names_from_files_stay_inside_their_folder(name):
    with pytest.raises(UnsafeFileError, match=r"manifest.json: file"):
        safe_read.confined_name(name, "manifest.json")


def test_digit_bombs_and_invalid_text_are_clean_errors(tmp_path):
    with pytest.raises(UnsafeFileError, match=r"x.json: not valid JSON"):
        safe_read.loads_json(b"9" * 10_000, "x.json")
    with pytest.raises(UnsafeFileError, match=r"x.json: not UTF-8"):
        safe_read.loads_json(b"\xff\xfe\x00", "x.json")
    with pytest.raises(UnsafeFileError, match=r"r.yaml: not valid YAML at line 1"):
        safe_read.loads_yaml("a: [1, 2", "r.yaml")
    with pytest.raises(UnsafeFileError, match=r"r.yaml: not valid YAML"):
        safe_read.loads_yaml("!!python/object/apply:os.system ['echo owned']", "r.yaml")


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_json_bytes_only_raise_our_error(data):
    with contextlib.suppress(UnsafeFileError):
        safe_read.loads_json(data, "fuzz.json")


@FUZZ
@given(
    st.lists(
        st.sampled_from(
            list("[]{}&*a:- ,!\n'\"|>?%@`") + ["!!python/name:os.system ", "&x ", "*x"]
        ),
        max_size=120,
    ).map("".join)
)
def test_fuzz_yaml_text_only_raises_our_error(text):
    with contextlib.suppress(UnsafeFileError):
        safe_read.loads_yaml(text, "fuzz.yaml")
