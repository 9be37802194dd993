"""The device side of train.sh and translate.sh: how many GPUs, whether they have bfloat16, and
the precision every arch trains in. torch is imported only to ask about CUDA, and only when the
environment does not say (``MULTIPATH_NMT_NUM_GPUS``, ``MULTIPATH_NMT_BF16``)."""
import os
from typing import Optional

from multipath_nmt.recipe.archs import RecipeError

# train.sh's --precision: fairseq's flags for each. bf16 and fp16 are both autocast over fp32
# weights (--amp): every arch trains the same way, and multi-path's path and residual weights
# keep fp32 gradients, which overflow in fp16 at loss scales the stock model takes
# (docs/fidelity.md, 'Architecture and GPU-scale numerics'). bf16 needs no loss scaling;
# docs/gpu.md says why autocast rather than fairseq's all-bf16 --bf16.
PRECISIONS = {
    "bf16": ["--amp", "--bf16"],
    "fp16": ["--amp"],
    "fp32": [],
}
PRECISION_NOTES = {
    "bf16": "bfloat16 autocast, fp32 weights, no loss scaling",
    "fp16": "float16 autocast, fp32 weights, dynamic loss scaling",
    "fp32": "float32",
}


def gpu_supports_bf16() -> bool:
    """``MULTIPATH_NMT_BF16`` (1 or 0) if set, else whether the first CUDA GPU computes in
    bfloat16 natively (Ampere and later)."""
    value = os.environ.get("MULTIPATH_NMT_BF16")
    if value is not None:
        if value not in ("0", "1"):
            raise RecipeError(f"MULTIPATH_NMT_BF16 must be 0 or 1, got '{value}'")
        return value == "1"
    if unseen_gpus() is not None:  # planning on a machine without the GPUs: bf16_assumption
        return False
    import torch
    return torch.cuda.is_bf16_supported(including_emulation=False)


def unseen_gpus() -> Optional[str]:
    """None when PyTorch sees a CUDA device here; else the words for why it sees none: a plan
    for the GPUs that ``MULTIPATH_NMT_NUM_GPUS`` counts, made on a machine without them (a login
    node), cannot ask them about their memory or bfloat16."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} does not see here (a CPU-only build)"
    return (f"PyTorch {torch.__version__} does not see here (built for CUDA {torch.version.cuda}, "
            f"which finds no GPU on this machine)")


def bf16_assumption(choice: str, gpus: int) -> Optional[str]:
    """The line train.sh prints when ``--precision`` ``choice`` for ``gpus`` GPUs was planned
    without asking a GPU whether it has bfloat16 (none is visible, ``MULTIPATH_NMT_BF16`` unset),
    else None."""
    if not gpus or choice != "auto" or "MULTIPATH_NMT_BF16" in os.environ or \
            unseen_gpus() is None:
        return None
    return ("precision fp16 is assumed: no GPU is visible here to ask whether it has bfloat16; "
            "MULTIPATH_NMT_BF16=1 plans bf16 (GPUs of compute capability 8.0 or later), =0 fp16")


def no_cuda_device() -> str:
    """Why ``torch.cuda.is_available()`` is false, in words for a one-line refusal: a CPU-only
    build of PyTorch, or a CUDA build (what pip installs on most Linux machines) that sees no GPU."""
    import torch
    if torch.version.cuda is None:
        return (f"no CUDA device is visible to PyTorch {torch.__version__}, a CPU-only build; run it "
                "on a GPU machine with a CUDA build of PyTorch")
    return (f"no CUDA device is visible to PyTorch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}); run it on a GPU machine")


def choose_precision(choice: str, gpus: int, bf16: Optional[bool] = None) -> str:
    """train.sh's ``--precision`` (auto, bf16, fp16, fp32) -> the precision trained in, the same
    for every arch: ``auto`` is bf16 on GPUs that have it, fp16 on older GPUs, fp32 on the CPU.
    ``bf16``: whether the GPUs have bfloat16 (default: :func:`gpu_supports_bf16`)."""
    if choice not in ("auto", *PRECISIONS):
        raise RecipeError(f"--precision must be auto, bf16, fp16 or fp32, got {choice!r}")
    if gpus and choice in ("auto", "bf16"):
        if bf16 is None and choice == "bf16" and "MULTIPATH_NMT_BF16" not in os.environ and \
                unseen_gpus() is not None:
            return "bf16"  # the user's choice: no GPU here to check it against
        bf16 = gpu_supports_bf16() if bf16 is None else bf16
        if choice == "bf16" and not bf16:
            raise RecipeError("--precision bf16: this GPU has no native bfloat16 (it needs "
                              "compute capability 8.0 or later); use --precision fp16")
        return "bf16" if bf16 else "fp16"
    if not gpus and choice == "fp16":
        raise RecipeError("--precision fp16 needs a CUDA GPU (its loss scaler and float16 "
                          "autocast are CUDA's); on the CPU use --precision bf16 or fp32")
    return "fp32" if choice == "auto" else choice


def ddp_on_cpu() -> bool:
    """``MULTIPATH_NMT_DDP_ON_CPU=1``: the GPUs counted by :func:`gpu_count` are CPU processes
    that talk over gloo. The tests run the multi-GPU command this way on a machine without GPUs:
    the same launcher, batch arithmetic and flags, with ``--cpu --distributed-backend gloo`` for
    the device and the CPU's precision."""
    value = os.environ.get("MULTIPATH_NMT_DDP_ON_CPU", "0")
    if value not in ("0", "1"):
        raise RecipeError(f"MULTIPATH_NMT_DDP_ON_CPU must be 0 or 1, got '{value}'")
    return value == "1"


def gpu_count() -> int:
    """``MULTIPATH_NMT_NUM_GPUS`` if set, else the CUDA devices torch sees."""
    value = os.environ.get("MULTIPATH_NMT_NUM_GPUS")
    if value is not None:
        if not value.isdigit():
            raise RecipeError(f"MULTIPATH_NMT_NUM_GPUS must be a number, got '{value}'")
        return int(value)
    import torch
    return torch.cuda.device_count()
