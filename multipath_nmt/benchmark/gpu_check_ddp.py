"""The GPU check's fairseq-train run on 2 GPUs (see :mod:`multipath_nmt.benchmark.gpu_check`):
the recipe's real command as a subprocess (one process per GPU, DDP), on a data-bin or on
synthetic sentences written for it; its exit status and whether its loss fell.
"""
import contextlib
import math
import os
import shlex
import subprocess
import tempfile
import time
import types

from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_dataset
from multipath_nmt.benchmark.gpu_check_setup import UPDATE_FREQ, check_command
from multipath_nmt.training_log import PlotLogError, parse_log


def synthetic_pairs(data_dir, languages, sentences, mean_length, seed=3):
    """``sentences`` synthetic sentence pairs (``batches.synthetic_dataset``) in the
    dictionaries of a data dir (``batches.fake_data_dir``), as a ``LanguagePairDataset``."""
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(os.path.join(data_dir, f"dict.{languages[0]}.txt"))
    task = types.SimpleNamespace(
        source_dictionary=dictionary, target_dictionary=dictionary,
        cfg=types.SimpleNamespace(left_pad_source=True, left_pad_target=False))
    return synthetic_dataset(task, sentences, mean_length, seed)


def write_split(data_dir, languages, dataset, split="train"):
    """``dataset`` (a ``LanguagePairDataset``) binarized as ``split`` of the data dir."""
    from fairseq.data import indexed_dataset

    source, target = languages
    for lang, column in ((source, dataset.src), (target, dataset.tgt)):
        prefix = os.path.join(data_dir, f"{split}.{source}-{target}.{lang}")
        builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap",
                                               vocab_size=len(dataset.src_dict))
        for tokens in column:
            builder.add_item(tokens)
        builder.finalize(prefix + ".idx")


def write_synthetic_train_split(data_dir, languages, sentences, mean_length, seed=3,
                                split="train"):
    """A binarized ``split`` (default ``train``) of synthetic sentence pairs
    (``batches.synthetic_dataset``) in a data dir that has the dictionaries
    (``batches.fake_data_dir``), for fairseq-train."""
    write_split(data_dir, languages,
                synthetic_pairs(data_dir, languages, sentences, mean_length, seed), split)


def ddp_command(data_dir, save_dir, size, system, precision, gpus, languages=("src", "tgt"),
                bf16=None):
    """The recipe's fairseq-train command on ``gpus`` GPUs (fairseq starts one process per GPU,
    DDP): ``ddp_updates`` updates logged one by one as JSON, no validation, no checkpoint."""
    return check_command(
        data_dir, save_dir, size, system, precision, gpus, languages,
        ["--log-format", "json", "--log-interval", "1", "--disable-validation", "--no-save"],
        bf16=bf16, updates=size["ddp_updates"])


def train_losses(log_path):
    """The per-update losses of a fairseq-train log (``train_inner`` lines), in update order."""
    try:
        return [loss for _, loss in sorted(parse_log(log_path).train_inner)]
    except PlotLogError:
        return []


def ddp_leg(data_dir, size, system, precision, gpus, languages=("src", "tgt"), launch=None,
            timeout=600):
    """Run :func:`ddp_command` as a subprocess; returns its command, exit status, losses and
    whether they fell, and the seconds it took. ``launch``: the command line -> the one to run
    (the tests start two gloo processes on the CPU with ``torchrun`` this way)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-ddp-") as save_dir:
        command = ddp_command(data_dir, save_dir, size, system, precision, gpus, languages)
        argv = launch(command.argv) if launch else command.argv
        log_path = os.path.join(save_dir, "train.log")
        start = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                status = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                status = None
        seconds = time.perf_counter() - start
        losses = train_losses(log_path)
        with open(log_path, errors="replace") as log:
            tail = log.read()[-3000:]
    result = dict(command=shlex.join(argv), gpus=gpus, exit_status=status, seconds=seconds,
                  updates=len(losses), loss_first=losses[0] if losses else None,
                  loss_last=losses[-1] if losses else None,
                  loss_fell=len(losses) > 1 and losses[-1] < losses[0])
    if status != 0 or not result["loss_fell"]:
        result["output_tail"] = tail
    return result


@contextlib.contextmanager
def ddp_data_dir(data, size, languages, gpus):
    """A data-bin for the fairseq-train runs: ``data`` if given, else synthetic sentences
    enough for ``ddp_updates`` updates on ``gpus`` GPUs, written beside the dictionaries of
    ``batches.fake_data_dir``."""
    if data:
        yield data
        return
    with fake_data_dir(size["vocab"]) as folder:
        tokens = size["ddp_updates"] * max(gpus, 1) * UPDATE_FREQ * size["max_tokens"]
        write_synthetic_train_split(folder, languages, math.ceil(tokens / size["mean_length"]),
                                    size["mean_length"])
        yield folder
