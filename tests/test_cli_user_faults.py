"""Small faults a new user meets, tried as the user meets them: ``megalith`` run as a
subprocess. A mistyped subcommand names the nearest valid one; ``serve`` and
``registry`` find the store ``megalith demo`` wrote (or say where they looked) and never
create an empty one; stopping ``megalith ui`` stops every server it started."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.servers import run_group

MEGALITH = [sys.executable, "-m", "pipelines.cli"]


def megalith(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None):
    """``megalith ARGS`` with no MLFLOW_TRACKING_URI unless ``env`` sets one."""
    environment = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    environment.update(env or {})
    return run_group([*MEGALITH, *args], environment, timeout_s=120, cwd=cwd)


@pytest.mark.parametrize(
    ("typed", "suggested"),
    [
        (["trian"], "train"),
        (["data", "prepair"], "prepare"),
        (["registry", "promot", "m", "1"], "promote"),
        (["serve", "--model", "m", "--precision", "fp23"], "fp32"),
    ],
)
def test_a_mistyped_choice_suggests_the_nearest_one(typed: list[str], suggested: str) -> None:
    result = megalith(*typed)
    assert result.returncode == 2, result.stderr
    assert f"did you mean '{suggested}'?" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) < 200  # one short line, not a list


def test_a_choice_nothing_resembles_lists_the_choices() -> None:
    result = megalith("xyzzy")
    assert result.returncode == 2
    assert "did you mean" not in result.stderr and "'train'" in result.stderr
