"""``fairseq-train`` (same arguments) with ``--amp`` as on a GPU, on the CPU: fairseq's CUDA
GradScaler is disabled without CUDA and its autocast is CUDA's, so this gives AMPOptimizer an
enabled CPU GradScaler (growth interval 2: the scale doubles every second clean update) and runs
the criterion under float16 CPU autocast."""
from fairseq_cli import train  # first: it sets up fairseq's log format

import torch
from fairseq.optim.amp_optimizer import AMPOptimizer
from fairseq.tasks.fairseq_task import FairseqTask


def with_cpu_scaler(init):
    def __init__(self, cfg, *args, **kwargs):
        init(self, cfg, *args, **kwargs)
        self._grad_scaler = torch.amp.GradScaler(
            "cpu", init_scale=cfg.common.amp_init_scale, growth_interval=2)
    return __init__


def under_fp16_autocast(train_step):
    def train_step_fp16(self, sample, model, criterion, *args, **kwargs):
        def criterion_fp16(*criterion_args, **criterion_kwargs):
            with torch.autocast("cpu", dtype=torch.float16):
                return criterion(*criterion_args, **criterion_kwargs)
        return train_step(self, sample, model, criterion_fp16, *args, **kwargs)
    return train_step_fp16


AMPOptimizer.__init__ = with_cpu_scaler(AMPOptimizer.__init__)
FairseqTask.train_step = under_fp16_autocast(FairseqTask.train_step)
train.cli_main()
