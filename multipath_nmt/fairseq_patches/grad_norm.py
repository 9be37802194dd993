"""fairseq's gradient norm in a few kernels instead of one per parameter.

fairseq 0.12's ``utils.clip_grad_norm_`` runs at every update, also with ``--clip-norm 0`` (the
norm is logged as ``gnorm``). With NVIDIA apex installed it takes apex's fused
``multi_tensor_l2norm``; without apex, one fp32 ``torch.norm`` per parameter, then the norm of
their stack: one kernel per parameter, 258 of the 3,434 kernel launches of a train.sh update of
the base Transformer on an H200 (BENCHMARKS.md), where the host sets the pace.

Without apex, this patch gives fairseq's fused branch a PyTorch body:
``torch._foreach_norm`` (one multi-tensor kernel per device, fp32 norms as fairseq asks) and
the norm of their stack. The gradients, the clipping and the logged value are fairseq's, to
float rounding (``tests/test_grad_norm.py``). Where apex is installed, nothing changes.

Needed on: fairseq 0.12 without apex, with a torch whose ``_foreach_norm`` takes ``dtype``
(2.4 and later; on older ones the patch does nothing). Off: ``MULTIPATH_NMT_PATCHES=-grad_norm``.

Reach beyond the plug-in's own models: every ``clip_grad_norm_`` of fairseq takes its multi-tensor
branch (``utils.multi_tensor_l2norm_available`` is set), whose body is now PyTorch's: the same norm
and clipped gradients to float rounding.
Does nothing when: apex's ``amp_C`` is installed (fairseq's fused kernel is used as before); a torch
whose ``_foreach_norm`` takes no ``dtype``; a model with one gradient (fairseq's own single-tensor
branch).
"""
import functools

import torch

from multipath_nmt.fairseq_patches.wrapping import wrap


def foreach_takes_dtype():
    """Whether this torch's ``_foreach_norm`` can return fp32 norms of half-precision tensors."""
    return "dtype" in str(torch.ops.aten._foreach_norm.Scalar._schema)


def _foreach_total_norm(multi_tensor_total_norm):
    @functools.wraps(multi_tensor_total_norm)
    def foreach_total_norm(grads, chunk_size=None):
        by_device = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        first = grads[0].device
        norms = [norm.to(first) for same_device in by_device.values()
                 for norm in torch._foreach_norm(same_device, 2, dtype=torch.float32)]
        return torch.linalg.vector_norm(torch.stack(norms))

    return foreach_total_norm


def install():
    from fairseq import utils

    if utils.multi_tensor_l2norm_available or not foreach_takes_dtype():
        return  # apex's fused kernel is there already, or torch cannot keep fairseq's fp32
    if wrap(utils, "multi_tensor_total_norm", _foreach_total_norm):
        utils.multi_tensor_l2norm_available = True  # clip_grad_norm_'s branch to it
