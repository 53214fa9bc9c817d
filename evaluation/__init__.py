"""Evaluation of model packages: perplexity, multiple-choice tasks, sampled generations.

Modules: ``perplexity`` (held-out loss on a shard set), ``tasks`` (zero-shot
multiple choice from jsonl), ``generate`` (sampling with a KV cache), ``report``
(``evaluate_model``: all of them into one JSON report and a table), ``cli``
(``megalith eval``) and ``lm_eval_adapter`` (the ``megalith`` model type of
lm-evaluation-harness, the ``eval`` extra). Importing this package stays light; torch
loads with the modules.
"""

from megalith.errors import MegalithError


class EvaluationError(MegalithError):
    """Evaluation inputs that cannot be used (empty split, mismatched tokenizer, bad file)."""


__all__ = ["EvaluationError"]
