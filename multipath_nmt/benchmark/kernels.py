"""Count the device kernels a piece of PyTorch code launches, on any device (the CPU included): a
proxy of a GPU's launch overhead, which sets the pace of small models once the host is slower
than the kernels.

    with KernelLaunchCounter() as kernels:
        trainer.train_step(micro_batches)
    kernels.total, kernels.by_op.most_common(5)

Every ATen op that reaches the dispatcher counts once, except those that launch no kernel on a
GPU either: views and aliases (``view``, ``t``, ``expand``, ``detach``, ...: metadata only),
allocations without a fill (``empty``, ``empty_strided``: the caching allocator, no kernel) and
scalar reads (``_local_scalar_dense``: a device-to-host copy, counted by
:class:`multipath_nmt.host_syncs.HostSyncCounter` as a sync). A fused kernel (``_fused_adamw_``,
``scaled_dot_product_*``) counts once, as it launches once or a few times on a GPU. What a GPU
runs below an op (cuBLAS picking several kernels, a reduction in two passes) is not seen, and a
CPU run takes the CPU's path where it differs (an SDPA backend, a fused optimizer's device
check): read the counts as ratios between systems measured the same way, not as a GPU's exact
launch count.
"""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Not views, yet no kernel: an allocation, a scalar read (a copy), metadata changes.
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
             aten._local_scalar_dense.default, aten.lift_fresh.default, aten.resize_.default,
             aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
             aten._unsafe_view.default}


class KernelLaunchCounter(TorchDispatchMode):
    """The kernel-launching ATen ops run inside the block: ``total`` and ``by_op`` (a Counter of
    op names)."""

    def __init__(self):
        super().__init__()
        self.by_op = collections.Counter()

    @property
    def total(self):
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in NO_KERNEL:
            self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))
