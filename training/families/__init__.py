"""Model families: one :class:`~training.families.spec.ModelFamily` per ``model.family``.

A family supplies its model class, datasets, loss, throughput count, pipeline split,
memory model, HF export and generator; the stages look them up here (:func:`model_family`) instead of branching on
the family's name. To add one, write ``training/families/<name>.py`` with its ``FAMILY``
and list it below (docs/architecture.md, "Model families").
"""

from __future__ import annotations

from megalith.config import MegalithConfig, ModelConfig
from megalith.errors import MegalithError
from training.families import gpt, t5
from training.families.spec import Generator, HFExport, MemoryModel, ModelFamily, PipelineSplit

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (gpt.FAMILY, t5.FAMILY)}


def model_family(config: MegalithConfig | ModelConfig | str) -> ModelFamily:
    """The spec of ``model.family`` (a config, its model section or the name)."""
    if isinstance(config, MegalithConfig):
        config = config.model
    name = config if isinstance(config, str) else config.family
    try:
        return FAMILIES[name]
    except KeyError:
        raise MegalithError(
            f"model.family {name!r} is not a known model family (known: {', '.join(FAMILIES)})"
        ) from None


__all__ = [
    "FAMILIES",
    "Generator",
    "HFExport",
    "MemoryModel",
    "ModelFamily",
    "PipelineSplit",
    "model_family",
]
