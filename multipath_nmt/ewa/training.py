"""The EWA weight averaging after an optimizer step: which weights to average, and which setups
it supports.

:func:`after_step` calls every module with an ``ewa_after_step(num_updates, master_views)``
method; :mod:`multipath_nmt.fairseq_patches.ewa_trainer` calls it after every real optimizer step
of ``fairseq-train`` (fairseq has no after-step hook for models).

``master_views`` maps each model parameter to the fp32 master copy that fairseq's
``FP16Optimizer`` (``--fp16``, ``--bf16``) keeps and copies into the half-precision model after
every step: averaging only the model's copy would be silently undone by the next step, so the
modules average the master and copy it to the model. Optimizers without master copies (fp32,
``--amp``, ``--memory-efficient-fp16``, ``--memory-efficient-bf16``) give an empty map: fp32
weights are averaged in place, half-precision ones on fp32 copies the EWA modules keep
(:class:`multipath_nmt.modules.ewa.ExpertsWeightsAveraging`).

The update is deterministic (no randomness, no communication): every data-parallel rank holds the
same weights after the synchronised optimizer step, so every rank computes the same average.
That holds for DDP, not for fully-sharded training (a rank holds a shard of the flattened
parameters, not whole experts) or BMUF (its wrapper keeps copies of the weights the averaging
does not see, and hides the fp32 masters): :func:`check_supported` refuses those.
"""
from collections import defaultdict


def master_views(optimizer):
    """{model parameter: view of its fp32 master copy} for fairseq's FP16Optimizer, else {}."""
    fp32_params = getattr(optimizer, "fp32_params", None)
    if fp32_params is None:
        return {}
    fp16_params = optimizer.fp16_params
    if isinstance(fp32_params, dict):
        # flat buffers, one per device, filled in fp16_params order (build_fp32_params)
        on_device = defaultdict(list)
        for param in fp16_params:
            on_device[param.device.index].append(param)
        views = {}
        for device, flat in fp32_params.items():
            offset = 0
            for param in on_device[device]:
                views[param] = flat.data[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
        return views
    return {param: master.data for param, master in zip(fp16_params, fp32_params)}


def check_supported(args):
    """Refuse the training setups the after-step averaging does not handle (one-line errors)."""
    if getattr(args, "ddp_backend", None) == "fully_sharded":
        raise ValueError("EWA does not support --ddp-backend fully_sharded: each rank holds only "
                         "a shard of the experts, and the averaging needs them whole; use "
                         "--ddp-backend c10d")
    if getattr(args, "use_bmuf", False):
        raise ValueError("EWA does not support --use-bmuf: BMUF keeps its own copies of the "
                         "weights (and hides the fp16 optimizer's fp32 masters), which the "
                         "averaging does not update; train without --use-bmuf")


def _ewa_modules(model):
    return [m for m in model.modules() if hasattr(m, "ewa_after_step")]


def after_step(model, optimizer, num_updates):
    """Call every EWA module of ``model`` after optimizer step number ``num_updates``."""
    modules = _ewa_modules(model)
    if modules:
        views = master_views(optimizer)
        for module in modules:
            module.ewa_after_step(num_updates, views)
