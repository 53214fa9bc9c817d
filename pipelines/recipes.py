"""The demo's recipes and corpus: what ``megalith demo`` and the served deployments run."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from megalith.config import MegalithConfig, load_config
from megalith.errors import MegalithError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_RECIPE = REPO_ROOT / "configs" / "tiny-cpu.yaml"
FINETUNE_RECIPE = REPO_ROOT / "configs" / "finetune-chat-tiny.yaml"
FINETUNE_CRON = "0 3 * * *"


def sample_corpus() -> Path:
    return Path(str(resources.files("preprocessing") / "sample_corpus" / "stories.jsonl"))


def demo_config(recipe: str, workdir: Path, overrides: list[str]) -> MegalithConfig:
    if not Path(recipe).exists():
        raise MegalithError(
            f"recipe {recipe} not found; pass --config configs/tiny-cpu.yaml from a checkout"
        )
    return load_config(
        recipe,
        overrides,
        {"data.inputs": [str(sample_corpus())], "data.output": str(workdir / "shards")},
    )
