"""The two sides of MFU: the FLOPs a model's training step does per token (measured by torch's
counter) and the peak rate it is judged against (a 1024^3 matmul, or the best of the model's own
matrix products, which matters on a GPU whose rate depends on the shapes)."""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from multipath_nmt.benchmark.timing import elapsed_seconds, time_update_windows
from multipath_nmt.modules.moe import pop_all_routing_stats


def training_flops_per_token(trainer, sample):
    """Model FLOPs of one forward + backward, measured (not estimated) with torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    model, criterion = trainer.model, trainer.criterion
    sample = trainer._prepare_sample(sample)[0]
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _, _ = criterion(model, sample)
        loss.backward()
    model.zero_grad(set_to_none=True)
    pop_all_routing_stats(model)  # forget the routing statistics of this extra pass
    return counter.get_total_flops() / sample["ntokens"]


def matmul_peak_flops(device, dtype, n=1024, repeats=10):
    """The FLOP rate of an n x n x n matrix product in ``dtype``, best of ``repeats`` after
    three warm-up products, each timed alone by :func:`time_update_windows`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    return 2 * n ** 3 / min(time_update_windows(lambda: torch.mm(a, b), repeats, 1, device))


class GemmShapes(TorchDispatchMode):
    """Records the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``) run inside the block
    as (batch, m, k, n) with how often each ran."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            batch = a.shape[0] if name in ("bmm", "baddbmm") else 1
            self.counts[(batch, a.shape[-2], a.shape[-1], b.shape[-1])] += 1
        return func(*args, **(kwargs or {}))


def gemm_peak_flops(shapes, device, dtype, repeats):
    """The highest FLOP rate this device reaches on any of ``shapes`` ((batch, m, k, n), e.g.
    ``GemmShapes().counts``), each product timed alone after one warm-up call; the peak that
    MFU is judged against instead of a spec-sheet number. Returns (peak, the best shape)."""
    best = (0.0, None)
    for batch, m, k, n in shapes:
        a = torch.randn(batch, m, k, device=device).to(dtype)
        b = torch.randn(batch, k, n, device=device).to(dtype)
        product = (lambda: torch.mm(a[0], b[0])) if batch == 1 else (lambda: torch.bmm(a, b))
        product()
        rate = 2 * batch * m * k * n * repeats / elapsed_seconds(product, repeats, device)
        best = max(best, (rate, (batch, m, k, n)), key=lambda pair: pair[0])
    return best


def training_autocast(trainer):
    """The autocast that the trainer's ``train_step`` runs the forward under: ``--amp``'s
    (float16, or bfloat16 with ``--bf16``: the optimizer's ``autocast_dtype``), else none."""
    dtype = getattr(trainer.optimizer, "autocast_dtype", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(trainer.model.parameters()).device.type, dtype=dtype)


def model_gemm_shapes(trainer, sample, attention_calls=None):
    """The matrix products of one forward + backward of the trainer's model and criterion, in
    the trainer's autocast. ``attention_calls``: a dict that receives what each attention call
    site passes to SDPA in that pass (``multipath_nmt.benchmark.attention_calls``): under autocast, as in
    training (the first GPU run recorded them in fp32, where flash attention cannot run)."""
    from multipath_nmt.benchmark.attention_calls import attention_calls as record_attention_calls

    sample = trainer._prepare_sample(sample)[0]

    def forward_backward():
        with training_autocast(trainer):
            loss, _, _ = trainer.criterion(trainer.model, sample)
        loss.backward()

    with GemmShapes() as shapes:
        if attention_calls is None:
            forward_backward()
        else:
            attention_calls.update(record_attention_calls(trainer.model, forward_backward))
    trainer.model.zero_grad(set_to_none=True)
    pop_all_routing_stats(trainer.model)
    return shapes.counts
