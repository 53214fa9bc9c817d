"""The one reader for JSON and YAML that comes from files a user or another tool wrote.

Every index, manifest, package config, checksum list, recipe and state file goes through
here, so a crafted file meets the same limits everywhere:

- size: the file is read up to ``max_bytes`` + 1 bytes and refused past the limit, so a
  file that claims to be JSON but is /dev/zero or a 50 GB blob costs nothing;
- nesting: containers deeper than ``MAX_DEPTH`` are refused (a 100k-deep ``[[[[...`` is a
  RecursionError inside ``json`` and PyYAML otherwise);
- YAML aliases: at most ``MAX_YAML_ALIASES`` (a "billion laughs" document expands every
  alias when it is validated or dumped, exponentially in the nesting);
- YAML tags: only the safe loader's plain types;
- symlinks: refused for local files when ``allow_symlink`` is false (a ``state.json``
  pointing at /dev/zero or at another run's files).

Errors are :class:`UnsafeFileError` (a :class:`MegalithError`) naming the file and what
was expected; the typed getters (:func:`field`) name the key as well.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import fsspec
import yaml

from megalith.errors import MegalithError

MAX_JSON_BYTES = 64 << 20  # the largest index we write is a few MB at 1000s of tensors
MAX_YAML_BYTES = 1 << 20  # recipes are a few KB
MAX_DEPTH = 64
MAX_YAML_ALIASES = 64
MAX_NAME_BYTES = 255  # NAME_MAX of Linux file systems


class UnsafeFileError(MegalithError, ValueError):
    """A JSON or YAML file that is too large, too deep, malformed or of the wrong shape."""


def read_bytes_bounded(
    url: str | Path,
    max_bytes: int,
    storage_options: dict[str, Any] | None = None,
    allow_symlink: bool = True,
) -> bytes:
    """The bytes of ``url``, refused when larger than ``max_bytes`` or not a regular file."""
    text_url = str(url)
    if "://" not in text_url or text_url.startswith("file://"):
        path = Path(text_url.removeprefix("file://"))
        _check_local_file(path, allow_symlink)
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    else:
        with fsspec.open(text_url, "rb", **(storage_options or {})) as handle:
            data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFileError(f"{url}: larger than the {max_bytes}-byte limit for this file")
    return data


def _check_local_file(path: Path, allow_symlink: bool) -> None:
    if not allow_symlink and path.is_symlink():
        raise UnsafeFileError(f"{path}: is a symbolic link; expected a regular file")
    mode = path.stat().st_mode  # a missing file stays FileNotFoundError: callers expect it
    if not stat.S_ISREG(mode):
        raise UnsafeFileError(f"{path}: not a regular file (a device, pipe or folder)")


def loads_json(
    data: bytes | str, source: str, max_depth: int = MAX_DEPTH, allow_nan: bool = True
) -> Any:
    """Parse JSON text from ``source`` (named in errors), with the nesting limit.
    ``allow_nan=False``: strict JSON, refusing Python's ``NaN``/``Infinity`` extension (for
    formats other readers parse strictly, such as safetensors headers)."""
    try:
        value = json.loads(data, parse_constant=None if allow_nan else _refuse_constant)
    except RecursionError:
        raise UnsafeFileError(f"{source}: JSON nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as exc:
        raise UnsafeFileError(f"{source}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise UnsafeFileError(
            f"{source}: not valid JSON ({exc.msg.removesuffix(' at')} at line {exc.lineno} column {exc.colno})"
        ) from None
    except ValueError as exc:  # e.g. an integer literal past Python's 4300-digit limit
        raise UnsafeFileError(f"{source}: not valid JSON ({_first_clause(exc)})") from None
    _check_depth(value, source, max_depth)
    return value


def read_json(
    url: str | Path,
    max_bytes: int = MAX_JSON_BYTES,
    storage_options: dict[str, Any] | None = None,
    allow_symlink: bool = True,
    expect: type | None = None,
) -> Any:
    """Read and parse a JSON file within the limits; ``expect`` checks the top-level type."""
    data = read_bytes_bounded(url, max_bytes, storage_options, allow_symlink)
    value = loads_json(data, str(url))
    if expect is not None and not isinstance(value, expect):
        raise UnsafeFileError(
            f"{url}: expected a JSON {_type_name(expect)} at the top, found {_type_name(type(value))}"
        )
    return value


class _BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a budget of aliases and of nesting."""

    def __init__(self, stream: str, source: str) -> None:
        super().__init__(stream)
        self.source = source
        self.aliases = 0
        self.depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise UnsafeFileError(
                    f"{self.source}: more than {MAX_YAML_ALIASES} YAML aliases (*name); "
                    "recipes need none or a few"
                )
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise UnsafeFileError(f"{self.source}: YAML nested deeper than {MAX_DEPTH} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def loads_yaml(text: str, source: str) -> Any:
    """Parse YAML text from ``source`` with the safe loader and the alias/nesting budget."""
    loader = None
    try:
        loader = _BoundedSafeLoader(text, source)  # refuses control characters already
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UnsafeFileError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise UnsafeFileError(f"{source}: YAML nested deeper than {MAX_DEPTH} levels") from None
    except UnsafeFileError:
        raise
    except ValueError as exc:  # an integer past Python's 4300-digit limit
        raise UnsafeFileError(f"{source}: not valid YAML ({_first_clause(exc)})") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(
    url: str | Path,
    max_bytes: int = MAX_YAML_BYTES,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    data = read_bytes_bounded(url, max_bytes, storage_options)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeFileError(f"{url}: not UTF-8 text ({exc.reason})") from None
    return loads_yaml(text, str(url))


def field(
    mapping: Any,
    key: str,
    kind: type | tuple[type, ...],
    source: str,
    default: Any = ...,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """``mapping[key]`` checked to be of ``kind`` (and within bounds), else a clean error.

    ``bool`` is never accepted where a number is asked for (JSON's true is not 1 bytes).
    """
    if not isinstance(mapping, dict):
        raise UnsafeFileError(f"{source}: expected an object holding {key!r}")
    if key not in mapping:
        if default is ...:
            raise UnsafeFileError(f"{source}: missing key {key!r}")
        return default
    value = mapping[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    wrong_bool = isinstance(value, bool) and bool not in kinds
    if wrong_bool or not isinstance(value, kinds):
        raise UnsafeFileError(
            f"{source}: key {key!r} is {_describe(value)}; expected {' or '.join(_type_name(k) for k in kinds)}"
        )
    if minimum is not None and value < minimum:
        raise UnsafeFileError(f"{source}: key {key!r} is {value}; expected at least {minimum}")
    if maximum is not None and value > maximum:
        raise UnsafeFileError(f"{source}: key {key!r} is {value}; expected at most {maximum}")
    return value


def confined_name(name: Any, source: str, key: str = "file") -> str:
    """A file name from a manifest or index that stays inside its folder: no path parts."""
    if not isinstance(name, str) or not name:
        raise UnsafeFileError(f"{source}: {key} is {_describe(name)}; expected a file name")
    if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name or os.path.isabs(name):
        raise UnsafeFileError(
            f"{source}: {key} {brief(name)} is not a plain file name inside the folder "
            "(no '/', '..' or absolute paths)"
        )
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:  # OSError: name too long
        raise UnsafeFileError(
            f"{source}: {key} {brief(name)} is longer than the {MAX_NAME_BYTES} bytes of a file name"
        )
    return name


def _check_depth(value: Any, source: str, max_depth: int) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise UnsafeFileError(f"{source}: nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


_NAMES = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _first_clause(error: Exception) -> str:
    """The error's message without Python's advice after ';' (set_int_max_str_digits)."""
    return str(error).split(";")[0]


def _type_name(kind: type) -> str:
    return _NAMES.get(kind, "null" if kind is type(None) else kind.__name__)


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: values from a file, quoted in an error
    message, must not turn it into 100 KB of text."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters, ``...`` marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(value: Any) -> str:
    return f"{_type_name(type(value))} {brief(value, 40)}"
