"""The model-family registry: every family is complete, an unknown one is refused by name,
and no stage branches on a family's name outside the family's own modules."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from evaluation.lm_eval_adapter import LM_EVAL_FAMILIES
from evaluation.perplexity import SCORERS
from evaluation.report import FAMILY_PROMPTS
from evaluation.tasks import CHOICE_LOGLIKS
from megalith.config import FAMILY_RULES, ModelConfig
from megalith.errors import MegalithError
from training.families import FAMILIES, model_family
from training.models import MODEL_CLASSES
from training.parallel.support import FAMILY_UNSUPPORTED

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("megalith", "preprocessing", "training", "evaluation", "registry", "deploy", "pipelines")
# A family's own modules may name it (T5Model refuses a config of another family);
# everything else asks the registry.
OWN_MODULES = ("training/families/", "training/models/t5.py")


def test_unknown_family_is_refused_naming_the_key_and_the_known_ones() -> None:
    with pytest.raises(MegalithError) as raised:
        model_family("mamba")
    message = str(raised.value)
    assert "model.family 'mamba'" in message
    for name in FAMILIES:
        assert name in message


def test_every_family_is_known_everywhere_a_family_is_looked_up() -> None:
    assert set(FAMILIES) == {"gpt", "t5"}
    assert set(MODEL_CLASSES) == set(FAMILIES)
    assert set(FAMILY_UNSUPPORTED) == set(FAMILIES)
    assert set(FAMILY_RULES) == set(FAMILIES)
    # evaluation (above training) keeps its per-family tables by these names
    for table in (SCORERS, CHOICE_LOGLIKS, LM_EVAL_FAMILIES, FAMILY_PROMPTS):
        assert set(table) == set(FAMILIES)
    assert set(get_args(ModelConfig.model_fields["family"].annotation)) == set(FAMILIES)
    for name, family in FAMILIES.items():
        assert family.name == name
        assert MODEL_CLASSES[name] is family.model_class


def _family_comparisons(path: Path) -> list[str]:
    """``x.family == ...`` / ``!=`` comparisons and ``"t5"``/``"gpt"`` compared in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        names_family = any(
            (isinstance(s, ast.Attribute) and s.attr == "family")
            or (isinstance(s, ast.Name) and s.id == "family")
            for s in sides
        )
        names_one = any(isinstance(s, ast.Constant) and s.value in FAMILIES for s in sides)
        if names_family or names_one:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_stage_branches_on_a_family_name() -> None:
    files = [
        path
        for stage in STAGES
        if (ROOT / stage).is_dir()
        for path in sorted((ROOT / stage).rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(OWN_MODULES)
    ]
    assert files, "no stage package found"
    branches = [hit for path in files for hit in _family_comparisons(path)]
    assert branches == [], f"branch on the family through training.families instead: {branches}"
