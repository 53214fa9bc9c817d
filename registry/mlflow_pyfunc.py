"""The MLflow ``python_function`` loader for registered Megalith model packages.

``registry.models.write_mlmodel`` names this module as the ``loader_module`` of every
registered version, so ``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` and
``mlflow models serve -m models:/NAME@ALIAS --env-manager local`` (with this project
installed in the environment) serve it. Nothing is unpickled: ``_load_pyfunc`` checks
every file against ``checksums.json`` and loads safetensors + JSON + the SentencePiece
model.

Input: a pandas DataFrame with a ``prompt`` column (or a single column), a list of
strings, a string, or ``{"prompt": [...]}``; over HTTP ``{"dataframe_split": {"columns":
["prompt"], "data": [["Once upon a time"]]}}`` or ``{"inputs": ["Once upon a time"]}``.
Output: the generated continuations, one string per prompt (``{"predictions": [...]}``).

Parameters (``params``, declared in the MLmodel's signature so MLflow passes them on):
``max_tokens`` (64), ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off),
``seed`` (1234). Prompts longer than the context keep their last tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megalith.errors import MegalithError
from training.inference.decode import (
    MAX_SEED,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingConfig,
)
from training.inference.loading import ServedModel, load_served_model
from training.mlflow_store.registered import MLFLOW_FILES, check_mlmodel, verify_package

PARAM_DEFAULTS: dict[str, int | float] = {
    "max_tokens": 64,
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "seed": 1234,
}
BATCH_SIZE = 8
# Written by mlflow.pyfunc.load_model into the downloaded directory of a models:/ URI.
MLFLOW_LOAD_FILES = frozenset({"registered_model_meta"})


class ScoringInputError(MegalithError):
    """Input or params the pyfunc model cannot generate from."""


def params_signature() -> Any:
    """The ``ModelSignature`` declaring ``PARAM_DEFAULTS`` (no input schema: see above)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ParamSchema, ParamSpec

    specs = [
        ParamSpec(name, "long" if isinstance(default, int) else "double", default)
        for name, default in PARAM_DEFAULTS.items()
    ]
    return ModelSignature(params=ParamSchema(specs))


class MegalithPyfunc:
    """What ``mlflow.pyfunc`` wraps: ``predict(prompts, params) -> texts``."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served

    def predict(self, model_input: Any, params: Mapping[str, Any] | None = None) -> list[str]:
        prompts = prompts_of(model_input)
        sampling = sampling_of(params or {}, self.served.info.max_positions)
        run = self.served.generator.generate
        result = run(
            self.served.model, self.served.tokenizer, prompts, sampling, batch_size=BATCH_SIZE
        )
        return [g.text for g in result.generations]


def _load_pyfunc(path: str, model_config: Mapping[str, Any] | None = None) -> MegalithPyfunc:
    """MLflow's entry point: ``path`` is the downloaded ``model/`` directory."""
    package = Path(path)
    verify_package(package, allowed_extra=MLFLOW_FILES | MLFLOW_LOAD_FILES)
    check_mlmodel(package / "MLmodel")
    return MegalithPyfunc(load_served_model(str(package)))


def prompts_of(model_input: Any) -> list[str]:
    """The prompts in any input form MLflow's scoring protocol delivers."""
    import numpy as np
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        if "prompt" in model_input.columns:
            values = model_input["prompt"].tolist()
        elif len(model_input.columns) == 1:
            values = model_input.iloc[:, 0].tolist()
        else:
            raise ScoringInputError(
                f"expected a 'prompt' column, got columns {list(model_input.columns)}"
            )
    elif isinstance(model_input, pd.Series | np.ndarray):
        values = np.asarray(model_input).ravel().tolist()
    elif isinstance(model_input, str):
        values = [model_input]
    elif isinstance(model_input, Mapping) and "prompt" in model_input:
        return prompts_of(pd.Series(model_input["prompt"]))
    elif isinstance(model_input, list | tuple):
        values = list(model_input)
    else:
        raise ScoringInputError(f"expected prompts, got {type(model_input).__name__}")
    bad = [v for v in values if not isinstance(v, str) or not v]
    if bad or not values:
        raise ScoringInputError(f"every prompt must be a non-empty string; got {bad[:3] or values}")
    return values


def sampling_of(params: Mapping[str, Any], max_positions: int) -> SamplingConfig:
    unknown = set(params) - set(PARAM_DEFAULTS)
    if unknown:
        raise ScoringInputError(f"unknown params {sorted(unknown)}; known: {list(PARAM_DEFAULTS)}")
    merged = {**PARAM_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    try:  # int(NaN), int("x") and int(inf) raise ValueError, ValueError and OverflowError
        max_tokens = int(merged["max_tokens"])
        temperature = float(merged["temperature"])
        top_p = float(merged["top_p"])
        if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {temperature}"
            )
        if not MIN_TOP_P <= top_p <= 1:
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1], got {top_p}")
        seed = int(merged["seed"])
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {seed}")
        if not 0 <= max_tokens < max_positions:
            raise ValueError(
                f"max_tokens must be in [0, {max_positions - 1}] (the model's context "
                f"is {max_positions}), got {max_tokens}"
            )
        return SamplingConfig(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_k=int(merged["top_k"]) or None,
            top_p=top_p,
            seed=seed,
        )
    except (ValueError, TypeError, OverflowError) as error:
        raise ScoringInputError(f"params: {error}") from None
