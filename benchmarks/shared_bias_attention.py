"""T5's biased attention, forward + backward, one GPU: SDPA as the model called it before
(`sdpa-per-sample`: the bias expanded to every sample by the padding mask;
`sdpa-broadcast`: one bias ``[1, heads, T, S]``) against the shared-bias op
(:mod:`training.models.shared_bias_attention`) over cuDNN or the memory-efficient kernel,
with the bias's gradient from :mod:`training.models.bias_grad`. Checks each against fp32.

    python3 benchmarks/shared_bias_attention.py --out results/
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.models import bias_grad, shared_bias_attention  # noqa: E402

SHAPES = {
    # name: (batch, heads, queries, keys, head_dim, causal); T5-base, span corruption 512 -> 114
    "encoder": (32, 12, 512, 512, 64, False),
    "decoder": (32, 12, 114, 114, 64, True),
}


def inputs(shape: tuple, dtype: torch.dtype, seed: int = 0):
    batch, heads, queries, keys, head_dim, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, device="cuda", generator=gen, dtype=torch.float32)

    q, k, v = (
        rand(batch, heads, queries, head_dim),
        rand(batch, heads, keys, head_dim),
        rand(batch, heads, keys, head_dim),
    )
    bias = rand(1, heads, queries, keys)
    grad_out = rand(batch, heads, queries, head_dim)
    return [t.to(dtype) for t in (q, k, v, bias, grad_out)], causal


def causal_bias(bias: torch.Tensor, causal: bool) -> torch.Tensor:
    if not causal:
        return bias
    keep = torch.ones(bias.shape[-2:], dtype=torch.bool, device=bias.device).tril()
    return bias.masked_fill(~keep, torch.finfo(bias.dtype).min)


def run(variant: str, q, k, v, bias, causal: bool):
    scale = q.size(-1) ** -0.5
    if variant == "sdpa-per-sample":
        allowed = torch.ones(q.size(0), 1, 1, k.size(2), dtype=torch.bool, device=q.device)
        mask = causal_bias(bias, causal).masked_fill(~allowed, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if variant == "sdpa-broadcast":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_bias(bias, causal), scale=scale
        )
    if variant == "math-fp32":
        mask = causal_bias(bias.float(), causal)
        scores = scale * q.float() @ k.float().transpose(-1, -2) + mask
        return torch.softmax(scores, -1) @ v.float()
    kernel = variant.removeprefix("op-")
    shared_bias_attention.set_kernel(kernel)
    return shared_bias_attention.shared_bias_attention(
        q, k, v, causal_bias(bias, causal), scale=scale
    )


def grads(variant: str, tensors, causal: bool):
    q, k, v, bias, grad_out = (
        t.detach().clone().requires_grad_(i < 4) for i, t in enumerate(tensors)
    )
    out = run(variant, q, k, v, bias, causal)
    out.backward(grad_out.to(out.dtype))
    return out, q.grad, k.grad, v.grad, bias.grad


def time_ms(fn, iters: int = 20, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument(
        "--variants", default="sdpa-per-sample,sdpa-broadcast,op-efficient,op-cudnn"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, shape in SHAPES.items():
        tensors, causal = inputs(shape, torch.bfloat16)
        reference = grads("math-fp32", [t.float() for t in tensors], causal)
        for variant in args.variants.split(","):
            row = {"shape": name, "variant": variant}
            try:
                result = grads(variant, tensors, causal)
                labels = ("out", "dq", "dk", "dv", "dbias")
                for label, got, want in zip(labels, result, reference, strict=True):
                    row[f"err_{label}"] = (
                        got.float() - want
                    ).abs().max().item() / want.abs().max().item()
                row["fwd_bwd_ms"] = time_ms(functools.partial(grads, variant, tensors, causal))
            except Exception as error:  # report and go on to the next variant
                row["error"] = f"{type(error).__name__}: {error}"[:500]
            print(json.dumps(row), flush=True)
            rows.append(row)
        q, k, v, bias, grad_out = tensors
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias(bias, causal))
        lse = torch.logsumexp(
            (q.float() @ k.float().transpose(-1, -2)) * q.size(-1) ** -0.5
            + causal_bias(bias.float(), causal),
            -1,
        )
        scale = q.size(-1) ** -0.5
        call = functools.partial(
            bias_grad.bias_grad,
            q,
            k,
            v,
            out,
            grad_out,
            lse,
            causal_bias(bias, causal)[0],
            scale=scale,
        )
        ms = time_ms(call)
        rows.append({"shape": name, "variant": "bias_grad kernel alone", "ms": ms})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "shared_bias_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
