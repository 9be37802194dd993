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
selection).

No host sync, neither per micro-batch nor per update: the logging outputs stay tensors, and
``reduce_metrics`` keeps them tensors too, the way fairseq keeps its loss. It adds each update's
sums to fairseq's meters as hidden sums (``metrics.log_scalar_sum`` of keys starting with ``_``,
which fairseq does not print) and logs the shown values as derived meters (``log_derived``, as
fairseq derives ``ppl``) computed from those sums with tensor ops only. The device is read when
fairseq formats its log line, every --log-interval updates (the trainer also evaluates the
derived meters every update, for its legacy logging output, but gets tensors there, no read).
Before, ``reduce_metrics`` read all the statistics in one copy per update: one sync per update
more than stock fairseq. The shown values, over the log interval (or the epoch):
``moe_balance_loss`` = sum(balance * sample_size) / sum(sample_size); ``moe_dropped_frac`` =
sum(dropped) / sum(assignments); ``moe_load_{e}`` = sum(load_e) / sum(kept), the share of the kept
assignments that expert e got; ``moe_load_entropy`` = the entropy (in nats; ln E means balanced)
of each update's shares, averaged over the updates weighted by their kept assignments. As tensors
they are printed as floats (``0.0`` where a number would print ``0``).
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



def _detached(value):
    """A tensor statistic as a detached float64 tensor (exact for the int64 counts); a Python
    number as it is."""
    return value.detach().double() if torch.is_tensor(value) else value


def _expert_loads(loads):
    """The per-expert loads of one update as one float64 vector when any is a tensor (one
    stack, no host read), else as Python floats."""
    reference = next((load for load in loads if torch.is_tensor(load)), None)
    if reference is None:
        return [float(load) for load in loads]
    return torch.stack([load.detach() if torch.is_tensor(load) else reference.new_full((), load)
                        for load in loads]).double()


def _rounded_ratio(numerator, denominator, digits):
    """numerator / denominator (a count: 0 is read as 1), rounded to ``digits``. Tensors stay
    tensors (tensor ops only, no host read): fairseq evaluates derived meters every update."""
    if torch.is_tensor(numerator) or torch.is_tensor(denominator):
        if torch.is_tensor(denominator):
            denominator = denominator.clamp(min=1)
        else:
            denominator = max(denominator, 1)
        return torch.round(numerator / denominator, decimals=digits)
    return round(numerator / max(denominator, 1), digits)


def _derived_ratio(numerator_key, denominator_key, digits):
    return lambda meters: _rounded_ratio(meters[numerator_key].sum, meters[denominator_key].sum,
                                         digits)


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

        def summed(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        num_experts = 0
        while any(f"moe_load_{num_experts}" in log for log in logging_outputs):
            num_experts += 1
        loads = _expert_loads([summed(f"moe_load_{expert}") for expert in range(num_experts)])
        if torch.is_tensor(loads):
            kept = loads.sum()
            shares = loads / kept.clamp(min=1)
            entropy = -torch.xlogy(shares, shares).sum()  # 0 * log 0 = 0
            loads = loads.unbind()
        else:
            kept = sum(loads)
            shares = [load / max(kept, 1) for load in loads]
            entropy = -sum(p * math.log(p) for p in shares if p > 0)

        # Hidden sums (not printed), added up by fairseq's meters over the log interval.
        metrics.log_scalar_sum("_moe_sample_size", _detached(summed("sample_size")))
        metrics.log_scalar_sum("_moe_balance_loss", _detached(summed("moe_balance_loss")))
        metrics.log_scalar_sum("_moe_dropped", _detached(summed("moe_dropped")))
        metrics.log_scalar_sum("_moe_assignments", _detached(summed("moe_assignments")))
        metrics.log_scalar_sum("_moe_kept", kept)
        for expert, load in enumerate(loads):
            metrics.log_scalar_sum(f"_moe_load_{expert}", load)
        metrics.log_scalar_sum("_moe_load_entropy", entropy * kept)  # weighted by kept

        # The shown values (priority 10, where log_scalar put them), derived when fairseq logs.
        metrics.log_derived("moe_balance_loss",
                            _derived_ratio("_moe_balance_loss", "_moe_sample_size", 4),
                            priority=10)
        metrics.log_derived("moe_dropped_frac",
                            _derived_ratio("_moe_dropped", "_moe_assignments", 4), priority=10)
        for expert in range(num_experts):
            metrics.log_derived(f"moe_load_{expert}",
                                _derived_ratio(f"_moe_load_{expert}", "_moe_kept", 3),
                                priority=10)
        metrics.log_derived("moe_load_entropy",
                            _derived_ratio("_moe_load_entropy", "_moe_kept", 4), priority=10)
