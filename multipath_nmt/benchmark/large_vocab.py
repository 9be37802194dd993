"""Does fairseq's loss hold past 2^31 elements? At 34,880 types, the fp32 log-probabilities of a
65,536-token micro-batch (train.sh's one-card batch for Deep24 and multi-path) have 2.29e9
elements, more than a 32-bit index reaches. The dense archs train with fairseq's
``label_smoothed_cross_entropy``: ``utils.log_softmax(logits.float())`` over the vocabulary,
then ``gather`` of the targets' entries, a ``sum`` over the vocabulary and the pad mask
(``label_smoothed_nll_loss``), one tensor of tokens x types throughout, and its backward.
:func:`check` runs that path on one such tensor and on row chunks that each stay below 2^31
elements, and compares the losses, and the last rows' own losses and gradients (where an index that
wrapped at 2^31 would read or write the wrong entries). It needs the memory of the real batch's
loss (about 4.6 GB of bf16 logits, 9.1 GB of fp32 log-probabilities, their gradients): a GPU's,
once per ``scripts/gpu-bench.sh`` run; on the CPU it runs small, to test the path.
"""
import torch

INT32_ELEMENTS = 2 ** 31


def _loss(logits, target, pad):
    from fairseq import utils
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    lprobs = utils.log_softmax(logits, dim=-1)  # fairseq's: in fp32 whatever the logits' dtype
    rows, _ = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=pad, reduce=False)
    return rows  # each token's loss; fairseq's reduce=True is their sum


def check(tokens, types, device, dtype=torch.bfloat16, chunk_elements=2 ** 30, seed=0):
    """fairseq's label-smoothed loss over ``tokens`` x ``types`` logits in ``dtype`` at once and
    in row chunks of at most ``chunk_elements`` elements: a dict of the element count, both
    losses, their relative difference, and the largest differences of the last 1,024 rows' own
    losses and gradients."""
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, types, device=device, dtype=dtype, generator=generator)
    target = torch.randint(4, types, (tokens, 1), device=device, generator=generator)
    pad = 1
    target[::17] = pad  # some padding, as in a batch
    last = slice(max(0, tokens - 1024), tokens)
    whole = logits.clone().requires_grad_()
    row_losses = _loss(whole, target, pad)
    loss = row_losses.sum()
    loss.backward()
    grad_last, rows_last = whole.grad[last].float(), row_losses[last].detach().float()
    loss_value = loss.item()
    del whole, row_losses, loss
    rows = max(1, chunk_elements // types)
    reference, reference_grad, reference_rows = 0.0, [], []
    for start in range(0, tokens, rows):
        part = logits[start:start + rows].clone().requires_grad_()
        part_rows = _loss(part, target[start:start + rows], pad)
        part_loss = part_rows.sum()
        part_loss.backward()
        reference += part_loss.item()
        keep = slice(max(last.start - start, 0), None)
        if start + rows > last.start:
            reference_grad.append(part.grad[keep].float())
            reference_rows.append(part_rows[keep].detach().float())
        del part, part_rows, part_loss
    reference_grad, reference_rows = torch.cat(reference_grad), torch.cat(reference_rows)
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": tokens, "types": types, "elements": tokens * types,
            "past_int32": tokens * types > INT32_ELEMENTS, "loss": loss_value,
            "chunked_loss": reference,
            "relative_difference": abs(loss_value - reference) / abs(reference),
            "last_rows_loss_max_difference": (rows_last - reference_rows).abs().max().item(),
            "last_rows_grad_max_difference": (grad_last - reference_grad).abs().max().item()}
