"""Checkpoint averaging with the semantics of fairseq's ``scripts/average_checkpoints.py``.

Differences, all deliberate: checkpoints load through the plug-in's reader
(:func:`multipath_nmt.checkpoint_io.reading.read_checkpoint`: safe ``weights_only`` loading on PyTorch >= 2.6
with the plug-in's allow-list, one line on a missing, damaged or foreign file), the mean of each
floating-point tensor is accumulated in float64 and cast back to the tensor's own dtype (so it is
the float64 mean rounded once), non-float tensors must be identical in every input, inputs of a
different architecture, key set, shape or recorded dictionaries are refused, and the output is written atomically
(a failed write leaves no file behind).
Everything besides ``model`` (config, task state, ...) comes from the first input, which with
``--num-*-checkpoints`` is the newest one, as in fairseq.
"""
import collections
import os
import re
from typing import List, Optional

import torch
from omegaconf import OmegaConf

from multipath_nmt.checkpoint_io.dictionaries import DICTIONARIES
from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.checkpoint_io.reading import read_checkpoint
from multipath_nmt.checkpoint_io.writing import write_atomically


class AveragingError(ValueError):
    """Checkpoints that cannot be averaged, with the reason and the files involved."""


def last_n_checkpoints(folder, n: int, update_based: bool, upper_bound: Optional[int] = None) -> List[str]:
    """The last ``n`` epoch (checkpointN.pt) or update (checkpoint_E_U.pt) checkpoints, newest first."""
    if not os.path.isdir(folder):
        raise AveragingError(f"{folder}: not a directory; --num-*-checkpoints needs the --save-dir "
                             "of a training run as --inputs")
    if n < 1:
        raise AveragingError(f"the number of checkpoints to average must be >= 1, got {n}")
    pattern = re.compile(r"checkpoint_\d+_(\d+)\.pt" if update_based else r"checkpoint(\d+)\.pt")
    entries = []
    for name in os.listdir(folder):
        match = pattern.fullmatch(name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            entries.append((int(match.group(1)), name))
    if len(entries) < n:
        kind = "update (checkpoint_E_U.pt)" if update_based else "epoch (checkpointN.pt)"
        bound = f" at or below {upper_bound}" if upper_bound is not None else ""
        raise AveragingError(f"{folder}: found {len(entries)} {kind} checkpoints{bound} but need {n}; "
                             "average fewer or train longer")
    return [os.path.join(folder, name) for _, name in sorted(entries, reverse=True)[:n]]



def select_checkpoints(inputs: List[str], num_epoch_checkpoints: Optional[int] = None,
                       num_update_checkpoints: Optional[int] = None,
                       upper_bound: Optional[int] = None) -> List[str]:
    """The files to average, chosen as fairseq's script chooses them: ``inputs`` themselves, or
    with a ``num_*_checkpoints`` count the newest checkpoints of the one directory ``inputs``
    names (at or below ``upper_bound``), newest first."""
    update_based = num_update_checkpoints is not None
    num = num_update_checkpoints if update_based else num_epoch_checkpoints
    if num is not None:
        if len(inputs) != 1:
            raise AveragingError("--num-epoch-checkpoints/--num-update-checkpoints take one "
                                 f"directory as --inputs, got {len(inputs)} paths")
        return last_n_checkpoints(inputs[0], num, update_based=update_based, upper_bound=upper_bound)
    if upper_bound is not None:
        raise AveragingError("--checkpoint-upper-bound needs --num-epoch-checkpoints or "
                             "--num-update-checkpoints")
    return list(inputs)

def _arch(state) -> Optional[str]:
    model_cfg = state["cfg"]["model"] if state.get("cfg") is not None else state.get("args")
    for attr in ("arch", "_name"):
        name = getattr(model_cfg, attr, None) if model_cfg is not None else None
        if name:
            return name
    return None


def _load(path):
    if os.path.isdir(path):
        raise AveragingError(f"{path} is a directory; pass checkpoint files, or add "
                             "--num-epoch-checkpoints N / --num-update-checkpoints N")
    try:
        return read_checkpoint(path)
    except CheckpointError as err:  # missing, truncated, not a checkpoint, untrusted globals
        raise AveragingError(str(err)) from err


def average_checkpoints(inputs: List[str]) -> dict:
    """The first input's state with ``model`` replaced by the element-wise mean over all inputs."""
    if not inputs:
        raise AveragingError("no checkpoints to average; give --inputs FILE... or a directory "
                             "with --num-epoch-checkpoints/--num-update-checkpoints")
    first_path, first = inputs[0], _load(inputs[0])
    reference = first["model"]
    sums = collections.OrderedDict(
        (k, v.double().clone() if v.is_floating_point() else v) for k, v in reference.items())
    for path in inputs[1:]:
        state = _load(path)
        if _arch(state) != _arch(first):
            raise AveragingError(f"{path} is a '{_arch(state)}' model but {first_path} is a "
                                 f"'{_arch(first)}' model; average checkpoints of one run only")
        if None not in (state.get(DICTIONARIES), first.get(DICTIONARIES)) and \
                state[DICTIONARIES] != first[DICTIONARIES]:
            raise AveragingError(f"{path} was trained with other dictionaries than {first_path}; "
                                 "average checkpoints of one run only")
        params = state["model"]
        if list(params) != list(reference):
            only_here = sorted(set(params) - set(reference))[:5]
            only_first = sorted(set(reference) - set(params))[:5]
            raise AveragingError(f"{path} and {first_path} have different parameters "
                                 f"(only in the former: {only_here}, only in the latter: {only_first})")
        for key, value in params.items():
            if value.shape != reference[key].shape or value.dtype != reference[key].dtype:
                raise AveragingError(f"{key} is {value.dtype} {tuple(value.shape)} in {path} but "
                                     f"{reference[key].dtype} {tuple(reference[key].shape)} in {first_path}")
            if value.is_floating_point():
                sums[key] += value.double()
            elif not torch.equal(value, reference[key]):
                raise AveragingError(f"{key} is a non-float tensor that differs between {path} and "
                                     f"{first_path}; it cannot be averaged")
    first["model"] = collections.OrderedDict(
        (k, (v / len(inputs)).to(reference[k].dtype) if reference[k].is_floating_point() else v)
        for k, v in sums.items())
    return first


def save_atomically(state: dict, output) -> None:
    """Write a temporary file next to ``output``, fsync it and rename it into place; a failed
    write (full disk) removes the temporary file and raises :class:`AveragingError`."""
    output = str(output)
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise AveragingError(f"{folder}: output folder does not exist; create it first")
    if OmegaConf.is_config(state.get("cfg")):
        # Saved as fairseq's trainer saves it: a plain container (load_checkpoint_to_cpu turns
        # it back into a DictConfig), so the file loads under the weights_only allow-list.
        state = dict(state, cfg=OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True))
    try:
        write_atomically(output, lambda out: torch.save(state, out))
    except CheckpointError as err:
        raise AveragingError(str(err)) from err
