"""Label-smoothed cross-entropy plus lambda * the load-balance losses of every routing call.

Total objective (WideNet Eq. 8, Switch form of the balance loss): CE + lambda * sum_calls l_c.
fairseq's loss is a SUM over the target tokens (or sentences with --sentence-avg), and the
trainer divides the gradient by the summed ``sample_size`` of all micro-batches and workers. So
the balance term is added as lambda * sample_size * sum_calls l_c: after that division the
gradient is that of mean-CE + lambda * sum_calls l_c (averaged over micro-batches, weighted by
their size), independent of batch size, --update-freq and the number of GPUs. fp16 loss scaling
multiplies the returned loss as a whole (outside the criterion), so both terms are scaled alike.

The logged ``loss`` stays the translation loss, comparable with dense models and with validation
(routers record statistics in training only); ``moe_balance_loss`` is logged separately. Its
minimum is k per routing call (a uniform router with top-k: WideNet Eq. 4 counts every top-k
selection). The logging outputs stay tensors until ``reduce_metrics``, so a micro-batch makes no
host sync here, and ``reduce_metrics`` reads them all in one copy per update (on an H200, the
per-key reads made 7 syncs per update).
"""
import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from multipath_nmt.modules.moe import pop_all_routing_stats


@dataclass
class LabelSmoothedCrossEntropyWithMoeCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    moe_balance_weight: float = field(
        default=0.01,
        metadata={"help": "lambda: weight of the load-balance loss, summed over every routing "
                          "call of the forward pass (WideNet: 0.01)"},
    )



def host_totals(values):
    """``values`` (device tensors or Python numbers) as Python floats, with one device-to-host
    read for all the tensors among them: on a GPU, each read is a sync that waits for the
    device's queue, and fairseq reduces the metrics once per update."""
    tensors = [v for v in values if torch.is_tensor(v)]
    read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()
                if tensors else [])
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]

@register_criterion("label_smoothed_cross_entropy_with_moe",
                    dataclass=LabelSmoothedCrossEntropyWithMoeCriterionConfig)
class LabelSmoothedCrossEntropyWithMoeCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0,
                 report_accuracy=False, moe_balance_weight=0.01):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size,
                         report_accuracy)
        self.moe_balance_weight = moe_balance_weight

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        routing_stats = pop_all_routing_stats(model)
        if not routing_stats or not reduce:
            return loss, sample_size, logging_output
        balance = torch.stack([s.balance_loss for s in routing_stats]).sum()
        loss = loss + self.moe_balance_weight * sample_size * balance.to(loss.dtype)

        num_experts = max(s.expert_load.numel() for s in routing_stats)
        load = torch.zeros(num_experts, device=balance.device)
        for s in routing_stats:
            load[: s.expert_load.numel()] += s.expert_load.detach().float()
        logging_output["moe_balance_loss"] = balance.detach() * sample_size
        logging_output["moe_dropped"] = torch.stack([s.dropped_tokens
                                                     for s in routing_stats]).sum()
        logging_output["moe_assignments"] = torch.stack([s.top_k * s.routed_tokens
                                                         for s in routing_stats]).sum()
        for expert, kept in enumerate(load.unbind()):
            logging_output[f"moe_load_{expert}"] = kept
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        if not any("moe_assignments" in log for log in logging_outputs):
            return

        num_experts = 0
        while any(f"moe_load_{num_experts}" in log for log in logging_outputs):
            num_experts += 1
        keys = ["sample_size", "moe_balance_loss", "moe_assignments", "moe_dropped",
                *(f"moe_load_{expert}" for expert in range(num_experts))]
        totals = dict(zip(keys, host_totals(
            [sum(log.get(key, 0) for log in logging_outputs) for key in keys])))
        sample_size = totals["sample_size"]
        metrics.log_scalar("moe_balance_loss", totals["moe_balance_loss"] / max(sample_size, 1),
                           sample_size, round=4)
        assignments = totals["moe_assignments"]
        metrics.log_scalar("moe_dropped_frac", totals["moe_dropped"] / max(assignments, 1),
                           assignments, round=4)
        load = [totals[f"moe_load_{expert}"] for expert in range(num_experts)]
        kept = sum(load)
        if kept > 0:
            shares = [expert_load / kept for expert_load in load]
            for expert, share in enumerate(shares):
                metrics.log_scalar(f"moe_load_{expert}", share, kept, round=3)
            # in nats; log(E) means perfectly balanced
            entropy = -sum(p * math.log(p) for p in shares if p > 0)
            metrics.log_scalar("moe_load_entropy", entropy, kept, round=4)
