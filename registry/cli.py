"""``megalith registry gate|promote|rollback``: who is the ``champion``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

from megalith.config import MegalithConfig, load_config
from megalith.errors import MegalithError
from training.mlflow_store.runs import DEMO_WORKDIR, existing_store_uri


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "registry",
        help="gate, promote or roll back registered models (@candidate → @champion)",
        description="Move the @champion alias of a registered model: through the promotion "
        "gate (eval metrics against the champion, rules from the recipe's promotion section), "
        "by hand, or back to the previous champion. MLflow: --tracking-uri, else "
        "MLFLOW_TRACKING_URI, else WORKDIR/mlflow.db (the store `megalith demo` writes); a "
        "store that does not exist is an error, never created empty.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    gate = actions.add_parser(
        "gate",
        help="promote @candidate (or --version) if it beats @champion by the recipe's rules",
        description="Compare a version's eval.* tags with the champion's, rule by rule "
        "(promotion.rules of --config, else the defaults: valid_perplexity no worse, "
        "sample_facts_acc_norm at most 5%% worse), write the decision to the version's "
        "promotion.* tags and move @champion when every rule passes. Exit status 0 when "
        "promoted, 3 when not.",
    )
    gate.add_argument("name", help="registered model name")
    gate.add_argument("--version", type=int, help="version to gate (default: @candidate)")
    gate.add_argument("--config", metavar="YAML", help="recipe whose promotion rules to use")
    gate.add_argument("--dry-run", action="store_true", help="decide, change nothing")
    gate.add_argument("--json", action="store_true", help="print the decision as JSON")
    _tracking(gate)
    gate.set_defaults(handler=_gate)

    promote = actions.add_parser(
        "promote",
        help="make VERSION the @champion (no gate)",
        description="Point @champion at VERSION by hand; the previous champion is kept in "
        "the model's champion history for `rollback`.",
    )
    promote.add_argument("name")
    promote.add_argument("version", type=int)
    _tracking(promote)
    promote.set_defaults(handler=_promote)

    rollback = actions.add_parser(
        "rollback",
        help="make the previous champion the @champion again",
        description="Point @champion back at the champion before the current one.",
    )
    rollback.add_argument("name")
    _tracking(rollback)
    rollback.set_defaults(handler=_rollback)


def _tracking(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """--tracking-uri and --workdir, resolved by :func:`training.mlflow_store.runs.existing_store_uri`."""
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (else MLFLOW_TRACKING_URI)")
    parser.add_argument(
        "--workdir",
        default=DEMO_WORKDIR,
        help=f"else use WORKDIR/mlflow.db, as `megalith demo` writes (default {DEMO_WORKDIR})",
    )


def mlflow_errors_in_one_line(
    handler: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """A command handler whose MLflow refusals (an unsupported store URI, a file store in
    maintenance mode, ...) end as one error line, not a traceback."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except Exception as exc:
            # Not imported (1.6 s) to be caught: a command that never imported MLflow
            # cannot have raised its exception.
            mlflow_exceptions = sys.modules.get("mlflow.exceptions")
            if mlflow_exceptions is None or not isinstance(exc, mlflow_exceptions.MlflowException):
                raise
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MegalithError(f"MLflow: {first_line[:300]}") from None

    return run


@mlflow_errors_in_one_line
def _gate(args: argparse.Namespace) -> int:
    from registry.promotion import gate

    config = load_config(args.config) if args.config else MegalithConfig()
    decision = gate(
        args.name,
        config.promotion.rules,
        version=args.version,
        tracking_uri=existing_store_uri(args.tracking_uri, args.workdir),
        apply=not args.dry_run,
    )
    print(json.dumps(decision.as_dict(), indent=2) if args.json else decision.markdown())
    return 0 if decision.promoted else 3


@mlflow_errors_in_one_line
def _promote(args: argparse.Namespace) -> int:
    from registry.promotion import promote

    previous = promote(
        args.name, args.version, tracking_uri=existing_store_uri(args.tracking_uri, args.workdir)
    )
    was = f"v{previous}" if previous else "none"
    print(f"{args.name}@champion → v{args.version} (was {was})")
    return 0


@mlflow_errors_in_one_line
def _rollback(args: argparse.Namespace) -> int:
    from registry.promotion import rollback

    version = rollback(args.name, tracking_uri=existing_store_uri(args.tracking_uri, args.workdir))
    print(f"{args.name}@champion → v{version} (rolled back)")
    return 0
