"""AdamW as one Triton launch a parameter group (training/optim/multi_tensor_adamw.py):
the same parameters and moments as torch's AdamW step after step, with and without the
folded clipping scale, its state loadable by torch's AdamW; the kernel in Triton's
interpreter on the CPU, torch's own step where the kernel cannot run, and chosen by
``optimizer.multi_tensor`` or, by default, for plain fp32 CUDA parameters. On a GPU: the
same steps against torch's fused AdamW."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import run_in_interpreter

from megalith.config import OptimizerConfig
from training.optim import multi_tensor_adamw
from training.optim.adamw import adamw, folds_clipping, step_with_clipping

SHAPES = [(3, 5000), (7,), (4096,), (1,), (64, 65)]  # ragged against the 4096 block


def seeded_params(device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(device)) for s in SHAPES]


def two_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:3], "weight_decay": 0.1},
        {"params": params[3:], "weight_decay": 0.0},
    ]


def run_steps(optimizer_class, device: str = "cpu", steps: int = 4, **kwargs):
    """Parameters and moments after ``steps`` steps on seeded gradients, the clipping scale
    folded in on the odd steps; and the optimizer."""
    params = seeded_params(device)
    optimizer = optimizer_class(two_groups(params), lr=1e-2, betas=(0.9, 0.95), **kwargs)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=generator) * 1e-2).to(device)
        if step % 2:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            step_with_clipping(optimizer, norm, max_norm=0.01)
        else:
            optimizer.step()
    moments = [optimizer.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]
    return [p.detach() for p in params], moments, optimizer


def assert_same_steps(got, want) -> None:
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-6, atol=1e-7)


def torch_adamw(groups, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW with the fused kernel's grad_scale done by hand (its single-tensor
    step takes none), as the trainer clips where the step is not fused."""

    class Clipped(torch.optim.AdamW):
        def step(self, closure=None):
            scale = self.__dict__.pop("grad_scale", None)
            if scale is not None:
                for group in self.param_groups:
                    for p in group["params"]:
                        p.grad.div_(scale)
            return super().step(closure)

    return Clipped(groups, **kwargs)


INTERPRETED = """
import torch
from tests.test_multi_tensor_adamw import assert_same_steps, run_steps, torch_adamw
from training.optim import multi_tensor_adamw
multi_tensor_adamw.eligible = lambda tensors: True  # CPU tensors, through the interpreter
got = run_steps(multi_tensor_adamw.MultiTensorAdamW)
assert_same_steps(got, run_steps(torch_adamw))
optimizer = got[2]
assert optimizer.state[optimizer.param_groups[0]["params"][0]]["step"].item() == 4
resumed = torch.optim.AdamW(optimizer.param_groups, lr=1e-2)
resumed.load_state_dict(optimizer.state_dict())
print("ok", len(optimizer._tables))
"""


def test_the_kernel_steps_as_torchs_adamw_in_the_interpreter() -> None:
    """Four steps over two groups of ragged tensors, every second one clipped through
    ``grad_scale``: the kernel's parameters and moments are torch's AdamW's (one table a
    group, built once), and its state dict loads into torch's AdamW."""
    assert run_in_interpreter(INTERPRETED).split() == ["ok", "2"]


def test_whole_blocks_compile_to_vector_loads_and_stores_for_hopper() -> None:
    """The kernel compiled for sm_90 (no GPU needed): a whole block moves its seven streams
    with 16-byte loads and stores (the first version's per-element predicates compiled to
    4-byte accesses, 1.66 TB/s on an H200); only a tensor's last block is masked."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    signature = {name: "*i64" for name in ("pointers", "numels", "block_start")}
    signature |= {"block_tensor": "*i32", "grad_scale": "*fp32"}
    signature |= dict.fromkeys(("decay_factor", "step_size", "bias_correction2_sqrt"), "fp32")
    signature |= dict.fromkeys(("beta1", "beta2", "eps"), "fp32")
    signature |= {"HAS_GRAD_SCALE": "constexpr", "BLOCK": "constexpr"}
    source = triton.compiler.ASTSource(
        fn=multi_tensor_adamw._adamw_kernel,
        signature=signature,
        constexprs={"HAS_GRAD_SCALE": True, "BLOCK": multi_tensor_adamw.BLOCK},
    )
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": multi_tensor_adamw.NUM_WARPS},
    )
    ptx = compiled.asm["ptx"]
    per_thread = multi_tensor_adamw.BLOCK // (32 * multi_tensor_adamw.NUM_WARPS) // 4
    assert ptx.count("cache_hint.v4.b32") == 4 * per_thread  # p, g, m, v
    assert ptx.count("st.global.v4.b32") == 3 * per_thread  # p, m, v


def test_where_the_kernel_cannot_run_torchs_step_runs() -> None:
    """CPU tensors: torch's single-tensor step over each group, the folded clipping scale
    applied to the gradients first, so the same values as a clipped torch AdamW."""
    assert_same_steps(run_steps(multi_tensor_adamw.MultiTensorAdamW), run_steps(torch_adamw))


def test_a_parameter_without_a_gradient_is_left_alone() -> None:
    params = seeded_params()
    before = params[1].detach().clone()
    optimizer = multi_tensor_adamw.MultiTensorAdamW(two_groups(params), lr=1e-2)
    for p in params[:1] + params[2:]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in optimizer.state
    assert not torch.equal(params[0].detach(), seeded_params()[0].detach())


def test_the_config_chooses_the_kernel_where_it_can_run() -> None:
    groups = two_groups(seeded_params())
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    chosen = adamw(groups, OptimizerConfig(multi_tensor=True), cpu)
    assert isinstance(chosen, multi_tensor_adamw.MultiTensorAdamW) and folds_clipping(chosen)
    plain = adamw(two_groups(seeded_params()), OptimizerConfig(), cpu)
    assert type(plain) is torch.optim.AdamW and not folds_clipping(plain)
    # A CUDA run whose parameters the kernel cannot take (here: on the CPU) keeps torch's
    # fused step; so does one that turns the kernel off.
    default = adamw(two_groups(seeded_params()), OptimizerConfig(), cuda)
    assert type(default) is torch.optim.AdamW and default.defaults["fused"]
    off = adamw(two_groups(seeded_params()), OptimizerConfig(multi_tensor=False), cuda)
    assert type(off) is torch.optim.AdamW and off.defaults["fused"]


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_steps_as_torchs_fused_adamw() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = []
    launch = multi_tensor_adamw.adamw_update

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    multi_tensor_adamw.adamw_update = counted
    try:
        got = run_steps(multi_tensor_adamw.MultiTensorAdamW, "cuda")
    finally:
        multi_tensor_adamw.adamw_update = launch
    assert len(calls) == 8  # one launch a group a step
    assert_same_steps(got, run_steps(torch.optim.AdamW, "cuda", fused=True))
    chosen = adamw(two_groups(seeded_params("cuda")), OptimizerConfig(), torch.device("cuda"))
    assert isinstance(chosen, multi_tensor_adamw.MultiTensorAdamW)  # the default on CUDA
