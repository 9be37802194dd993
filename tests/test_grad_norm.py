"""The grad_norm patch: fairseq's gradient norm through torch._foreach_norm, not one kernel per
parameter (multipath_nmt/fairseq_patches/grad_norm.py)."""
import pytest
import torch
from fairseq import utils

from multipath_nmt.benchmark.kernels import KernelLaunchCounter
from multipath_nmt.fairseq_patches import grad_norm

pytestmark = pytest.mark.skipif(not grad_norm.foreach_takes_dtype(),
                                reason="this torch's _foreach_norm takes no dtype")


def params_with_grads(dtype, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(512, 64), (64,), (64, 64), (1,), (3, 5, 7), (2048,)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (scale * torch.randn(shape, generator=generator)).to(dtype)
        params.append(p)
    return params


def fairseqs_own(params, max_norm, monkeypatch):
    """fairseq's clip_grad_norm_ as it ships without apex: one torch.norm per parameter."""
    with monkeypatch.context() as patched:
        patched.setattr(utils, "multi_tensor_l2norm_available", False)
        return utils.clip_grad_norm_(params, max_norm)


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1.0), (torch.float16, 1.0),
                                          (torch.float16, 3000.0), (torch.bfloat16, 1.0)])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_the_norm_and_the_clipped_gradients_are_fairseqs(dtype, scale, max_norm, monkeypatch):
    assert utils.multi_tensor_l2norm_available  # the plug-in's import installed the patch
    ours, stock = params_with_grads(dtype, scale), params_with_grads(dtype, scale)
    norm = utils.clip_grad_norm_(ours, max_norm)
    expected = fairseqs_own(stock, max_norm, monkeypatch)
    # fp32 norms, as fairseq's: 3000 x N(0, 1) over 2.7e5 fp16 entries is 1.6e6, past fp16's
    # 65504, and must not become inf
    assert norm.dtype == expected.dtype == torch.float32 and torch.isfinite(norm)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, stock):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6 if dtype == torch.float32 else 0,
                                   atol=0)


def test_a_non_finite_gradient_gives_a_non_finite_norm_as_fairseqs(monkeypatch):
    ours, stock = params_with_grads(torch.float32), params_with_grads(torch.float32)
    for params in (ours, stock):
        params[2].grad[0, 0] = float("inf")
    assert utils.clip_grad_norm_(ours, 0.0).item() == float("inf")
    assert fairseqs_own(stock, 0.0, monkeypatch).item() == float("inf")


def test_one_update_launches_a_few_norm_kernels_not_one_per_parameter(monkeypatch):
    params = params_with_grads(torch.float32)
    with KernelLaunchCounter() as ours:
        utils.clip_grad_norm_(params, 0.0)
    with KernelLaunchCounter() as stock:
        fairseqs_own(params, 0.0, monkeypatch)
    assert dict(ours.by_op) == {"_foreach_norm": 1, "stack": 1, "linalg_vector_norm": 1}
    assert stock.by_op["linalg_vector_norm"] == len(params) + 1


def test_with_apex_installed_nothing_changes(monkeypatch):
    """Where apex's fused kernel is there, install() changes nothing."""
    monkeypatch.setattr(utils, "multi_tensor_total_norm", "apex's")
    monkeypatch.setattr(utils, "multi_tensor_l2norm_available", True)
    grad_norm.install()
    assert utils.multi_tensor_total_norm == "apex's"
