"""The optimizer fairseq's Trainer builds for a precision's flags, outside a Trainer."""
import torch

from multipath_nmt.recipe import PRECISIONS

WRAPPERS = {
    "fp32": [],
    # fp32 master copies (per tensor: fairseq flattens them only on CUDA)
    "fp16": ["--fp16", "--fp16-no-flatten-grads"],
    # fp16 parameters handed to the optimizer as they are
    "memory-efficient-fp16": ["--memory-efficient-fp16"],
}
# What train.sh and the GPU check use besides: fp32 weights under autocast (AMPOptimizer, with
# a loss scaler for float16 and none for bfloat16), and fairseq's flat fp32 master copy.
MIXED_PRECISION_WRAPPERS = {
    "amp": PRECISIONS["fp16"],
    "amp-bf16": PRECISIONS["bf16"],
    "fp16-flat": ["--fp16"],
}


def build_wrapped(optimizer_name, wrapper, params=None, extra=()):
    """The optimizer fairseq's Trainer builds for these flags (FP16Optimizer,
    MemoryEfficientFP16Optimizer, AMPOptimizer or the optimizer itself). fairseq keys its flat
    master copy by ``torch.cuda.current_device()``: ``fp16-flat`` needs that patched on the
    CPU (the copy itself is made where the parameters are)."""
    from fairseq import optim, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "data", "--arch", "transformer", "--cpu", "--optimizer", optimizer_name, "--lr", "0.01",
        "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.01",
        "--fp16-init-scale", "128", *{**WRAPPERS, **MIXED_PRECISION_WRAPPERS}[wrapper], *extra])
    cfg = convert_namespace_to_omegaconf(args)
    params = params if params is not None else [torch.nn.Parameter(torch.zeros(2))]
    if wrapper in ("fp16", "fp16-flat"):
        return optim.FP16Optimizer.build_optimizer(cfg, params)
    if wrapper.startswith("amp"):
        return optim.AMPOptimizer.build_optimizer(cfg, params)
    if wrapper == "memory-efficient-fp16":
        return optim.MemoryEfficientFP16Optimizer.build_optimizer(cfg, params)
    return optim.build_optimizer(cfg.optimizer, params)
