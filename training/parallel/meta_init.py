"""Materialize this rank's shard of a model without building the whole model.

The single-device model is built on the meta device under :class:`_InitRecorder`, which
records every in-place initialisation op its modules run (``normal_``, ``fill_``,
``zero_``, ...) in order. :func:`materialize_shard` then replays those ops on the CPU,
one whole parameter at a time, in the order the single-device init ran them, so every
parameter draws exactly the random numbers it draws when one process builds the model
from the seed (and the default generator ends in the same state). As soon as a
parameter's last op has run, this rank's part of it is cut out and copied into the
rank's shard model, and the whole tensor is dropped: at most the parameters whose
initialisation interleaves (in practice one) exist whole at once, never the model.
This is Megatron's ``_initialize_affine_weight_cpu`` generalised to any module's init.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from training.parallel.dtensor import is_dtensor


@dataclass(frozen=True)
class _InitOp:
    func: Any  # an in-place aten op overload
    target: Tensor  # the meta tensor it ran on
    args: tuple[Any, ...]  # the arguments after the target (scalars)
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class MaterializeStats:
    """What :func:`materialize_shard` held at once: its peak of whole tensors."""

    peak_bytes: int
    largest_parameter_bytes: int
    model_bytes: int


class _InitRecorder(TorchDispatchMode):
    """Records the in-place ops run on meta tensors while a model is constructed."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_InitOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        on_meta = str(kwargs.get("device")) == "meta" or any(
            isinstance(a, Tensor) and a.is_meta for a in (*args, *kwargs.values())
        )
        if name in ("empty", "empty_strided") or not on_meta:
            return out  # allocation, or work on real tensors (not the model's init)
        if not name.endswith("_") or any(
            isinstance(a, Tensor) for a in (*args[1:], *kwargs.values())
        ):
            # A value computed from other tensors (or a random factory) cannot be replayed
            # one parameter at a time: refuse rather than leave a parameter uninitialised.
            raise NotImplementedError(
                f"meta-device init cannot replay {func} during model construction"
            )
        self.ops.append(_InitOp(func, args[0], tuple(args[1:]), dict(kwargs)))
        return out


def materialize_shard(
    build: Callable[[], nn.Module],
    shard: nn.Module,
    cut: Callable[[str, Tensor], Tensor],
    elsewhere: Callable[[str], bool] = lambda name: False,
) -> MaterializeStats:
    """Initialise ``shard`` (this rank's model, already on its device) with its parts of
    the parameters ``build()`` (the single-device model) would initialise from the
    current RNG state; ``cut(name, whole)`` is this rank's part of parameter ``name``.
    ``elsewhere(name)``: a parameter of ``shard`` that ``build()`` does not make and the
    caller initialises (LoRA adapters, from their own seeded generators).

    Advances the default generator exactly as ``build()`` on the CPU would."""
    recorder = _InitRecorder()
    with torch.device("meta"), recorder:
        whole = build()
    names = {id(p): n for n, p in whole.named_parameters()}
    if any(True for _ in whole.buffers()):
        raise NotImplementedError("meta-device init does not materialize buffers yet")
    last_op = {id(op.target): i for i, op in enumerate(recorder.ops)}
    local = {n: p for n, p in shard.named_parameters() if not elsewhere(n)}
    missing = set(local) - {names[k] for k in last_op if k in names}
    if missing:
        raise NotImplementedError(f"no initialisation recorded for {sorted(missing)}")
    live: dict[int, Tensor] = {}
    live_bytes = peak = 0
    for i, op in enumerate(recorder.ops):
        key = id(op.target)
        if key not in live:
            live[key] = torch.empty(op.target.shape, dtype=op.target.dtype)
            live_bytes += live[key].nbytes
            peak = max(peak, live_bytes)
        with torch.no_grad():
            op.func(live[key], *op.args, **op.kwargs)
        if last_op[key] == i:
            tensor = live.pop(key)
            live_bytes -= tensor.nbytes
            name = names.get(key)  # None: a tensor construction replaced (still drew RNG)
            if name is not None:
                target = local[name]
                if is_dtensor(target):  # FSDP: this rank's rows
                    target = target.to_local()
                with torch.no_grad():
                    target.copy_(cut(name, tensor))
    return MaterializeStats(
        peak_bytes=peak,
        largest_parameter_bytes=max(p.nbytes for p in whole.parameters()),
        model_bytes=sum(p.nbytes for p in whole.parameters()),
    )
