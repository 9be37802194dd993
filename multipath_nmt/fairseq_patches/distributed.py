"""What fairseq 0.12's own distributed path needs to run on CPU with gloo (``torchrun``).

fairseq assumes one GPU per process when it is started by ``torchrun``/``torch.distributed.launch``:

* it sets ``device_id = RANK % torch.cuda.device_count()``, a ZeroDivisionError without CUDA;
* ``--ddp-backend pytorch_ddp`` (the default) passes ``device_ids=[device_id]`` to
  ``DistributedDataParallel``, which PyTorch rejects for a module on the CPU.

Both are fixed here without touching the GPU path: with CUDA nothing changes.

And on every device: fairseq never destroys its process group, so the interpreter's finalization
tears down gloo's threads mid-flight, which now and then aborts a finished run (exit 134,
"terminate called without an active exception"; PyTorch issue #190489, PR #65513's explanation;
with NCCL, torch >= 2.4 warns instead). :func:`_destroy_process_group_after_training` destroys it
once a rank's training returned, after fairseq's last barrier; not after an error, where a
destroy could wait for ranks that are still in a collective. fairseq's own
``torch.multiprocessing.spawn`` (without torchrun) starts its ranks before the plug-in is imported
there: those ranks keep fairseq's behaviour.

Reach beyond the plug-in's own models: any model trains on CPU ranks.
Does nothing when: a CUDA device is visible (the GPU path is fairseq's), except the destroy.
"""
import functools
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from multipath_nmt.fairseq_patches.wrapping import wrap


class CpuAwareDistributedDataParallel(DistributedDataParallel):
    """PyTorch DDP that drops ``device_ids``/``output_device`` for CPU modules (they mean GPUs)."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


def _infer_launch_init_without_cuda(infer):
    def _infer_torch_distributed_launch_init(cfg):
        if torch.cuda.device_count() > 0:
            return infer(cfg)
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
        cfg.distributed_rank = int(os.environ["RANK"])
        cfg.device_id = 0  # a GPU index; fairseq would call torch.cuda.set_device for > 0
        cfg.distributed_no_spawn = True  # torchrun has already started one process per rank

    return _infer_torch_distributed_launch_init


def _cpu_aware_ddp(torch_ddp):
    # A replacement rather than a wrapper: fairseq's pytorch_ddp path instantiates the class it
    # imported from torch, which CpuAwareDistributedDataParallel subclasses.
    return CpuAwareDistributedDataParallel


def _destroy_process_group_after_training(distributed_main):
    @functools.wraps(distributed_main)
    def distributed_main_then_destroy(*args, **kwargs):
        distributed_main(*args, **kwargs)  # returns after fairseq's barrier of all ranks
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    return distributed_main_then_destroy


def install():
    from fairseq.distributed import utils as distributed_utils
    from fairseq.models import distributed_fairseq_model

    wrap(distributed_utils, "_infer_torch_distributed_launch_init", _infer_launch_init_without_cuda)
    wrap(distributed_fairseq_model, "DistributedDataParallel", _cpu_aware_ddp)
    wrap(distributed_utils, "distributed_main", _destroy_process_group_after_training)
