"""What the systems train on: the dictionaries-only data dir fairseq's task needs, one full-length
synthetic batch (``multipath-bench``'s default), and padded, length-varied fairseq batches (its
``--padded``/CUDA mode and the GPU check)."""
import contextlib
import math
import os
import tempfile

import torch


@contextlib.contextmanager
def fake_data_dir(vocab):
    """fairseq's translation task reads its dictionaries from the data dir; nothing else."""
    with tempfile.TemporaryDirectory(prefix="multipath-bench-") as folder:
        for lang in ("src", "tgt"):
            with open(os.path.join(folder, f"dict.{lang}.txt"), "w") as f:
                for i in range(vocab - 4):  # + bos, pad, eos, unk
                    f.write(f"w{i} 1\n")
        yield folder


def synthetic_batch(size, vocab, seed=0):
    """Full-length sentences of random in-vocabulary tokens (no padding, so every system sees
    exactly the same number of real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = size["batch"], size["length"]
    low = 4  # after bos, pad, eos, unk
    src = torch.randint(low, vocab, (B, T), generator=gen)
    tgt = torch.randint(low, vocab, (B, T), generator=gen)
    src[:, -1] = 2
    tgt[:, -1] = 2
    prev = torch.cat([torch.full((B, 1), 2), tgt[:, :-1]], dim=1)
    return {
        "id": torch.arange(B),
        "nsentences": B,
        "ntokens": B * T,
        "net_input": {"src_tokens": src, "src_lengths": torch.full((B,), T),
                      "prev_output_tokens": prev},
        "target": tgt,
    }


def synthetic_dataset(task, count, mean_length, seed):
    """``count`` sentence pairs of random in-vocabulary tokens whose source lengths spread like a
    BPE'd corpus (log-normal around ``mean_length``, 1 to 4x the mean) and whose target lengths
    are 0.8-1.25x the source's, in fairseq's ``LanguagePairDataset``."""
    from fairseq.data import LanguagePairDataset

    gen = torch.Generator().manual_seed(seed)
    sigma = 0.5
    log_lengths = math.log(mean_length) - sigma ** 2 / 2 + sigma * torch.randn(count,
                                                                                generator=gen)
    src_lengths = log_lengths.exp().round().clamp(1, 4 * mean_length).long()
    ratios = 0.8 + 0.45 * torch.rand(count, generator=gen)
    tgt_lengths = (src_lengths * ratios).round().clamp(min=1).long()
    vocab, eos = task.source_dictionary, task.source_dictionary.eos()
    low = vocab.nspecial

    def sentence(length):
        tokens = torch.randint(low, len(vocab), (int(length) + 1,), generator=gen)
        tokens[-1] = eos
        return tokens

    src = [sentence(n) for n in src_lengths]
    tgt = [sentence(n) for n in tgt_lengths]
    return LanguagePairDataset(src, [len(s) for s in src], vocab, tgt, [len(t) for t in tgt],
                               task.target_dictionary,
                               left_pad_source=task.cfg.left_pad_source,
                               left_pad_target=task.cfg.left_pad_target)


def padded_batches(task, model, max_tokens, count, mean_length=28, split=None, seed=1):
    """``count`` padded, length-varied batches as ``fairseq-train`` makes them (its batching by
    ``max_tokens`` and its collater), shuffled: from ``split`` of the task's data-bin, or from
    synthetic sentences when ``split`` is None."""
    from fairseq import utils

    if split is None:
        sentences = math.ceil(1.5 * count * max_tokens / mean_length)
        dataset = synthetic_dataset(task, sentences, mean_length, seed)
    else:
        task.load_dataset(split)
        dataset = task.dataset(split)
    iterator = task.get_batch_iterator(
        dataset, max_tokens=max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, seed=seed, num_workers=0).next_epoch_itr(shuffle=True)
    batches = [batch for _, batch in zip(range(count), iterator)]
    if len(batches) < count and split is not None:
        raise ValueError(f"{split}: {len(batches)} batches of {max_tokens} tokens, "
                         f"the check needs {count}")
    return batches
