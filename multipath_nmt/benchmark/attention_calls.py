"""What every attention call site passes to ``scaled_dot_product_attention``, and so which fused
kernels (flash, memory-efficient) it allows: :func:`attention_calls` records it while a model
runs, :func:`format_attention_calls` prints it (``scripts/gpu-check.sh``, BENCHMARKS.md).

This is the probe that shows the effect of the attention patch
(:mod:`multipath_nmt.fairseq_patches.attention`: decoder self-attention with ``is_causal``
instead of mask tensors); it patches nothing itself beyond the duration of one
:func:`attention_calls`, so it stays a library module outside the patches package.
"""
import functools
import warnings
from typing import Callable, Dict, List, Union

import torch
import torch.nn.functional as F

from fairseq.modules.multihead_attention import MultiheadAttention

from multipath_nmt.modules.multipath import MultiPathAttention


# What a mask allows: flash attention takes no mask tensor (is_causal or nothing), the
# memory-efficient kernel takes any; attention weights requested (need_weights) or fairseq's
# incremental path mean an explicit softmax, no scaled_dot_product_attention at all.
KERNELS = {
    "no mask": "flash, efficient",
    "is_causal": "flash, efficient",
    "bool mask": "efficient",
    "float mask": "efficient",
    "no SDPA (explicit softmax)": "none",
}


def flash_attention_verdict(params) -> Union[bool, str]:
    """True where flash attention can run on these ``torch.backends.cuda.SDPAParams``; else why
    not, in torch's words (the warnings of ``can_use_flash_attention(params, debug=True)``): a
    bare False at a call site does not say what to change."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        allowed = torch.backends.cuda.can_use_flash_attention(params, debug=True)
    return True if allowed else "; ".join(str(w.message).strip() for w in caught) or False


def _site(name: str, module) -> str:
    side = "decoder" if name.startswith("decoder") or ".decoder." in name else "encoder"
    kind = "cross-attn" if name.endswith("encoder_attn") else "self-attn"
    paths = " (multi-path)" if isinstance(module, MultiPathAttention) else ""
    return f"{side} {kind}{paths}"


def attention_calls(model, run: Callable[[], object]
                    ) -> Dict[str, Dict[str, Union[bool, str, None]]]:
    """What every attention call site of ``model`` (fairseq's MultiheadAttention and the
    multi-path attentions) passes to ``scaled_dot_product_attention`` while ``run()`` runs:
    {site: {mask kind: flash verdict, ...}} with the mask kinds of :data:`KERNELS`. The flash
    verdict (:func:`flash_attention_verdict` of the call's own ``SDPAParams``: True, or why not)
    needs CUDA tensors; on the CPU it is None."""
    calls: Dict[str, Dict[str, Union[bool, str, None]]] = {}
    stack: List[list] = []

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **_):
        if not stack:
            return
        if is_causal:
            kind = "is_causal"
        elif attn_mask is None:
            kind = "no mask"
        else:
            kind = "bool mask" if attn_mask.dtype == torch.bool else "float mask"
        flash = None
        if q.is_cuda:
            params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal,
                                                    False)
            flash = flash_attention_verdict(params)
        stack[-1][1] = True
        calls.setdefault(stack[-1][0], {})[kind] = flash

    def before(site, module, args):
        stack.append([site, False])

    def after(module, args, output):
        site, used_sdpa = stack.pop()
        if not used_sdpa:
            calls.setdefault(site, {})["no SDPA (explicit softmax)"] = None

    def scaled_dot_product_attention(*args, **kwargs):
        record(*args, **kwargs)
        return sdpa(*args, **kwargs)

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, (MultiheadAttention, MultiPathAttention)):
            handles.append(module.register_forward_pre_hook(
                functools.partial(before, _site(name, module))))
            handles.append(module.register_forward_hook(after))
    # through the module attribute, which torch's multi_head_attention_forward calls as well
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        run()
    finally:
        F.scaled_dot_product_attention = sdpa
        for handle in handles:
            handle.remove()
    return calls


def format_attention_calls(
        calls_by_phase: Dict[str, Dict[str, Dict[str, Union[bool, str, None]]]]) -> List[str]:
    """A markdown table of :func:`attention_calls` results, one per phase (e.g. "training",
    "inference")."""
    lines = ["| call site | phase | mask passed to SDPA | fused kernels it allows |",
             "|---|---|---|---|"]
    for phase, calls in calls_by_phase.items():
        for site, kinds in sorted(calls.items()):
            for kind, flash in sorted(kinds.items()):
                allowed = KERNELS[kind]
                if flash is True:
                    allowed += " (flash: yes)"
                elif flash is not None and "flash" in allowed:
                    allowed += f" (flash: no, {flash})"
                lines.append(f"| {site} | {phase} | {kind} | {allowed} |")
    return lines
