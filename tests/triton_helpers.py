"""Runs a Triton kernel's check on the CPU through Triton's interpreter, in a subprocess
(``TRITON_INTERPRET`` is read when Triton is imported); counts a module's kernel calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(code: str) -> str:
    """``code``'s standard output; skips where Triton is not installed (CPU torch wheels)."""
    pytest.importorskip("triton")
    # The tests folder too: the checks import test modules, which import these helpers.
    paths = [str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def count_calls(monkeypatch: pytest.MonkeyPatch, module: ModuleType, *names: str) -> dict[str, int]:
    """Calls of ``module``'s functions ``names`` from now on, by name (a live dict)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        function = getattr(module, name)

        def counted(*args, name=name, function=function, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls
