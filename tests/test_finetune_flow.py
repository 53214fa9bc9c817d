"""The recurring fine-tune's bookkeeping: which chat files are new, on local disk and on
S3 (moto's server), and its state file. The whole flow runs in test_user_journey.py."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from pipelines.finetune import (
    FinetuneError,
    list_chat_files,
    mark_processed,
    new_chat_files,
    read_state,
)


def new_files(location: str, state: str) -> list[str]:
    return [f["path"] for f in new_chat_files(location, state)[1]]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_only_new_or_changed_chat_files_count(where: str, tmp_path: Path, request) -> None:
    root = request.getfixturevalue("s3_bucket") + "/incoming" if where == "s3" else str(tmp_path)
    state = str(tmp_path / "finetune-state.json")
    fs, base = fsspec.core.url_to_fs(root)

    def put(name: str, text: str) -> None:
        fs.makedirs(f"{base}/{Path(name).parent}", exist_ok=True)
        with fs.open(f"{base}/{name}", "w") as handle:
            handle.write(text)

    put("a.jsonl", '{"prompt": "hi", "response": "hello"}\n')
    put("notes.txt", "not chat data\n")
    put("week/b.jsonl", '{"prompt": "x", "response": "y"}\n')
    assert [Path(p).name for p in new_files(root, state)] == ["a.jsonl", "b.jsonl"]
    if where == "s3":
        assert all(p.startswith("s3://") for p in new_files(root, state))

    mark_processed.fn(state, list_chat_files(root), {"run": 1})
    assert new_files(root, state) == []
    put("a.jsonl", '{"prompt": "hi", "response": "hello there"}\n')  # changed: new again
    assert [Path(p).name for p in new_files(root, state)] == ["a.jsonl"]
    assert json.loads(Path(state).read_text())["runs"] == [{"run": 1}]


def test_a_broken_state_file_is_named(tmp_path: Path) -> None:
    state = tmp_path / "finetune-state.json"
    state.write_text("{not json")
    with pytest.raises(FinetuneError, match="finetune-state.json: not JSON"):
        read_state(str(state))
    state.write_text("[]")
    with pytest.raises(FinetuneError, match="expected an object with a 'processed' mapping"):
        read_state(str(state))
