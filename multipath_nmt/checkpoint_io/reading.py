"""Reading fairseq checkpoints, and telling every way a read fails apart in one true line.

:func:`read_checkpoint` is the one reader behind every entry point (the patches of
:mod:`multipath_nmt.fairseq_patches.checkpoints` put it in place of fairseq's
``checkpoint_utils.load_checkpoint_to_cpu``, which ``fairseq-train`` (resume),
``fairseq-generate``/``-interactive`` and our tools call). It tells apart a missing file, an empty or
truncated one, a file that is not a PyTorch checkpoint, a PyTorch file that is not a fairseq
checkpoint, an architecture that is not registered (naming the ``--user-dir`` the checkpoint was
trained with) and a file that pickles a global outside the safe-loading allow-list (naming it; only
then is the ``MULTIPATH_NMT_TRUST_GLOBALS`` opt-in, or :func:`trust_globals`, mentioned).
:func:`peek_checkpoint` reads a checkpoint's structure without its tensor data and
:func:`proven_damage` tells whether a file is proven damaged (what a resume checks
``checkpoint_last.pt`` with).
"""
import argparse
import collections
import importlib
import os
import pickle
import re
import zipfile

import torch

from multipath_nmt.checkpoint_io import (CheckpointError, DamagedCheckpointError,
                                         MissingCheckpointError, NotAFairseqCheckpointError,
                                         NotAPytorchFileError, UNREADABLE,
                                         UnregisteredArchitectureError, UntrustedCheckpointError)


TRUST_ENV = "MULTIPATH_NMT_TRUST_GLOBALS"

# What torch.save's legacy (pre-1.6, non-zip) format starts with: the pickled magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
_INTERRUPTED = "its write was interrupted (killed, or the disk was full)"
_DAMAGED = "an interrupted write or copy, or a failing disk"


def check_file(path):
    """Raise the matching :class:`CheckpointError` if ``path`` cannot be a complete checkpoint,
    judged from its size and structure alone (nothing is unpickled)."""
    path = str(path)
    if not os.path.lexists(path):
        raise MissingCheckpointError(path, "no such checkpoint file" + _folder_hint(path))
    if os.path.isdir(path):
        raise MissingCheckpointError(path, "is a directory, not a checkpoint file")
    size = os.path.getsize(path)
    if size == 0:
        raise DamagedCheckpointError(path, f"empty file (0 bytes), not a checkpoint: {_INTERRUPTED}"
                                           "; use an earlier checkpoint")
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(_ZIP_LOCAL_HEADER) or zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            first = _first_record_name(head)
            if first is None or first.endswith("data.pkl"):  # torch.save writes data.pkl first
                raise DamagedCheckpointError(
                    path, f"truncated checkpoint ({size} bytes, the end of its zip archive is "
                          f"missing): {_INTERRUPTED}; use an earlier checkpoint") from None
            raise NotAPytorchFileError(path, f"a damaged zip archive ({size} bytes) whose first "
                                             f"record is {first}, not a PyTorch checkpoint") from None
        if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
            raise NotAPytorchFileError(path, "a zip archive without the data.pkl record that "
                                             "torch.save writes: not a PyTorch checkpoint, or a "
                                             "damaged one")
    elif head.startswith(_LEGACY_MAGIC):
        pass  # torch.save's legacy format: only loading it can tell more
    elif head[:1] == b"\x80":
        raise NotAPytorchFileError(path, "a plain Python pickle, not a PyTorch checkpoint "
                                         "(torch.save writes a zip archive)")
    else:
        raise NotAPytorchFileError(path, f"not a PyTorch checkpoint (it starts with bytes "
                                         f"{head[:8].hex(' ')}: neither a zip archive nor a pickle)")


def _folder_hint(path):
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f" (and no folder {folder})"
    found = sorted(n for n in os.listdir(folder) if n.endswith(".pt"))
    if not found:
        return f" (no .pt files in {folder})"
    return f" ({folder} has {', '.join(found[:6])}{', ...' if len(found) > 6 else ''})"


def _first_record_name(head):
    """The name in the first zip local header, or None if the header itself is cut."""
    name_len = int.from_bytes(head[26:28], "little")
    if len(head) < 30 + name_len:
        return None
    return head[30:30 + name_len].decode("utf-8", "replace")


def _fairseq_load():
    from fairseq import checkpoint_utils

    load = checkpoint_utils.load_checkpoint_to_cpu
    return getattr(load, "__wrapped__", load)


def read_checkpoint(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's ``load_checkpoint_to_cpu`` (safe ``weights_only`` loading, config upgrade) with
    every way it can fail as a one-line :class:`CheckpointError`; remote paths (``://``) go to
    fairseq unchecked."""
    path = str(path)
    local = "://" not in path
    if local:
        check_file(path)
    try:
        state = _fairseq_load()(path, arg_overrides, load_on_all_ranks)
    except CheckpointError:
        raise
    except Exception as err:
        if not local:
            raise
        raise _explain_failure(path, err) from err
    if local:
        _check_fairseq_state(path, state)
        _check_registered(path, state)
    return state


def _explain_failure(path, err):
    """The :class:`CheckpointError` behind a failed fairseq load of a structurally sound file."""
    if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err):
        names = _untrusted_globals(path, err)
        if names:
            return UntrustedCheckpointError(
                path, f"pickles {', '.join(names)}, which safe loading (torch.load "
                      "weights_only=True) does not allow and a fairseq checkpoint does not need. If "
                      f"you trust this file, allow it explicitly with {TRUST_ENV}={','.join(names)} "
                      "(or multipath_nmt.checkpoint_io.reading.trust_globals(...) in Python)")
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
        reason = detail.group(1).strip().rstrip(".") if detail else _torch_reason(err)
        return DamagedCheckpointError(path, f"damaged or truncated checkpoint (its pickled data "
                                            f"cannot be read: {reason}): {_DAMAGED}; use an "
                                            "earlier checkpoint")
    try:  # did fairseq fail on the file, or on what the file holds?
        raw = torch.load(path, map_location="cpu")
    except Exception as raw_err:  # noqa: BLE001 whatever torch raises, the file is damaged
        return DamagedCheckpointError(path, f"damaged or truncated checkpoint "
                                            f"({_torch_reason(raw_err)}): {_DAMAGED}; use an "
                                            "earlier checkpoint")
    problem = _not_fairseq(raw)
    if problem:
        return NotAFairseqCheckpointError(path, problem)
    return DamagedCheckpointError(path, f"fairseq cannot read this checkpoint "
                                        f"({type(err).__name__}: {_torch_reason(err)})")


def _torch_reason(err):
    """The first sentence of an error, on one line."""
    if isinstance(err, EOFError):
        return "the file ends too early"
    text = " ".join(str(err).split()) or type(err).__name__
    return re.split(r"(?<=[.!?]) ", text, maxsplit=1)[0].rstrip(".")


def _untrusted_globals(path, err):
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()
               if hasattr(g, "__qualname__")}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 the legacy format: torch names the first refused global in its message
        found = re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    return [g for g in found if g not in allowed]


def _not_fairseq(state):
    """Why a loaded object is not a fairseq checkpoint, or None."""
    if not isinstance(state, dict):
        return (f"a PyTorch file but not a fairseq checkpoint: it holds a "
                f"{type(state).__name__}, not a dict with 'model' and 'cfg'")
    if "model" in state and ("cfg" in state or "args" in state):  # fairseq writes both keys
        return None
    keys = list(state)
    if keys and all(isinstance(v, torch.Tensor) for v in state.values()):
        held = f"only tensors, a bare state dict: {len(keys)} of them, e.g. {keys[0]}"
    else:
        held = "keys " + ", ".join(map(repr, keys[:8])) + (", ..." if len(keys) > 8 else "")
    return f"a PyTorch file but not a fairseq checkpoint: no 'model' and 'cfg' entries (it holds {held})"


def _check_fairseq_state(path, state):
    problem = _not_fairseq(state)
    if problem:
        raise NotAFairseqCheckpointError(path, problem)


def model_config(state):
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        return cfg["model"]
    return state.get("args")


def architecture(state):
    model_cfg = model_config(state)
    for attr in ("_name", "arch"):
        name = model_cfg.get(attr) if isinstance(model_cfg, dict) else getattr(model_cfg, attr, None)
        if name:
            return name
    return None


def _check_registered(path, state):
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    arch = architecture(state)
    if arch is None or arch in ARCH_MODEL_REGISTRY or arch in MODEL_REGISTRY:
        return
    cfg = state.get("cfg")
    user_dir = None
    if cfg is not None and cfg.get("common") is not None:
        user_dir = cfg["common"].get("user_dir")
    hint = (f"pass --user-dir {user_dir} (the plug-in it was trained with)" if user_dir else
            "pass the --user-dir of the plug-in that defines it (this checkpoint does not record one)")
    raise UnregisteredArchitectureError(path, f"architecture '{arch}' is not registered: {hint}")


def _resolve(dotted):
    module_name, _, attr = dotted.strip().rpartition(".")
    if not module_name:
        raise ValueError(f"{TRUST_ENV}: '{dotted}' is not a dotted name like 'numpy.dtype'")
    return getattr(importlib.import_module(module_name), attr)


def trust_globals(*objects_or_names):
    """Explicitly allow more globals in checkpoints (objects or dotted names). Only for files you trust."""
    objects = [_resolve(o) if isinstance(o, str) else o for o in objects_or_names]
    torch.serialization.add_safe_globals(objects)
    return objects


# --- reading only the structure (no tensor data) ------------------------------------------

class _TensorShape:
    """Stands in for a tensor whose data was not read."""

    def __init__(self, size):
        self.shape = torch.Size(size)


class _Opaque:
    """Stands in for any other pickled object: nothing is imported, nothing runs."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _StructureOnly(pickle.Unpickler):
    _KNOWN = {("collections", "OrderedDict"): collections.OrderedDict,
              ("argparse", "Namespace"): argparse.Namespace,
              ("torch._utils", "_rebuild_tensor_v2"): lambda _storage, _offset, size, *_: _TensorShape(size),
              ("torch._utils", "_rebuild_parameter"): lambda data, *_: data}

    def find_class(self, module, name):
        return self._KNOWN.get((module, name), _Opaque)

    def persistent_load(self, pid):
        return None


def peek_checkpoint(path):
    """The checkpoint's pickled structure with each tensor replaced by its shape, read from the
    data.pkl record alone (which torch.save writes first, so it survives most truncations).
    Returns None for the legacy format; raises :class:`DamagedCheckpointError` if unreadable."""
    path = str(path)
    with open(path, "rb") as f:
        head = f.read(30)
        if not head.startswith(_ZIP_LOCAL_HEADER):
            return None
        name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
        name = f.read(name_len).decode("utf-8", "replace")
        if not name.endswith("data.pkl"):
            return None
        f.seek(30 + name_len + extra_len)
        try:
            return _StructureOnly(f).load()
        except Exception as err:  # noqa: BLE001 whatever the unpickler raises, the record is damaged
            raise DamagedCheckpointError(path, f"damaged checkpoint: its data.pkl record cannot be "
                                               f"read ({_torch_reason(err)})") from None


def proven_damage(path):
    """The error (one of :data:`UNREADABLE`) that proves the local checkpoint ``path`` damaged
    or not a fairseq checkpoint, judged from its structure alone (:func:`check_file`,
    :func:`peek_checkpoint`); None when it reads, when it is remote storage (``://``: fairseq's
    PathManager reads it) and when the check cannot judge it (missing, unreadable for other
    reasons, not a path at all): those are fairseq's to report, as they were without the
    plug-in."""
    try:
        if "://" in str(path):
            return None
        check_file(path)
        peek_checkpoint(path)
    except UNREADABLE as damage:
        return damage if damage.path == str(path) else None
    except Exception:  # noqa: BLE001 - nothing proven: fairseq's own load decides
        return None
    return None


def saved_at(state):
    """(epoch, number of updates) recorded in a (peeked or loaded) fairseq checkpoint."""
    history = state.get("optimizer_history") or [{}]
    updates = history[-1].get("num_updates")
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    return iterator.get("epoch"), updates
