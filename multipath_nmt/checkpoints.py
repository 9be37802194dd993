"""Reading, writing and resuming from fairseq checkpoints: every failure is one true line.

* :func:`read_checkpoint` is the one reader behind every entry point: :func:`install` puts it in
  place of fairseq's ``checkpoint_utils.load_checkpoint_to_cpu``, which ``fairseq-train`` (resume),
  ``fairseq-generate``/``-interactive`` and our tools call. It tells apart a missing file, an empty
  or truncated one, a file that is not a PyTorch checkpoint, a PyTorch file that is not a fairseq
  checkpoint, an architecture that is not registered (naming the ``--user-dir`` the checkpoint was
  trained with) and a file that pickles a global outside the safe-loading allow-list (naming it;
  only then is the ``MULTIPATH_NMT_TRUST_GLOBALS`` opt-in mentioned). Each is a
  :class:`CheckpointError` whose message starts with the path; uncaught, it is printed as one line
  without a traceback and the process exits with status 1.
* :func:`save_atomically` writes through a temporary file in the destination folder, fsyncs and
  renames it into place; it replaces fairseq's ``torch_persistent_save`` (whose ``.tmp`` file stays
  behind when the disk is full, after three attempts 2.5 s apart). A failed write removes the
  partial file and raises :class:`CheckpointSaveError`; earlier checkpoints are untouched.
* Resuming (fairseq's ``checkpoint_utils.load_checkpoint``): a ``checkpoint_last.pt`` that cannot
  be read is renamed to ``checkpoint_last.pt.damaged`` (never deleted) and training resumes from
  the newest readable checkpoint of the save dir, with a warning saying how many updates are
  trained again.
* Exact resume across epochs: fairseq 0.12 builds the training batches once, when the epoch
  iterator is created, breaking ties between equally long sentences with ``--seed`` + *that*
  epoch, and reuses them for every later epoch. An uninterrupted run therefore trains all epochs on
  the batches of epoch 1, but a run resumed in epoch e >= 2 rebuilt them with seed + e. The batches
  of a reusable iterator are now always built as in epoch 1, whatever the epoch it starts in.
* A data-bin whose dictionaries do not match the checkpoint's embeddings is reported with both
  sizes and both paths before fairseq fails on a tensor shape.
"""
import argparse
import collections
import errno
import functools
import inspect
import logging
import os
import pickle
import re
import sys
import zipfile

import torch

from multipath_nmt import atomic_files

logger = logging.getLogger(__name__)

TRUST_ENV = "MULTIPATH_NMT_TRUST_GLOBALS"

# What torch.save's legacy (pre-1.6, non-zip) format starts with: the pickled magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
_INTERRUPTED = "its write was interrupted (killed, or the disk was full)"
_DAMAGED = "an interrupted write or copy, or a failing disk"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line that starts with its path."""

    def __init__(self, path, message):
        super().__init__(f"{path}: {message}")
        self.path = str(path)


class MissingCheckpointError(CheckpointError):
    pass


class DamagedCheckpointError(CheckpointError):
    """Empty, truncated or otherwise unreadable (a write or copy that did not finish)."""


class NotAPytorchFileError(CheckpointError):
    pass


class NotAFairseqCheckpointError(CheckpointError):
    pass


class UnregisteredArchitectureError(CheckpointError):
    pass


class UntrustedCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A complete checkpoint that pickles a global outside the safe-loading allow-list."""


class DictionaryMismatchError(CheckpointError):
    pass


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written; the partial file was removed."""


# Files that are not usable checkpoints at all: resume falls back to an earlier one.
UNREADABLE = (DamagedCheckpointError, NotAPytorchFileError, NotAFairseqCheckpointError)


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


# --- reading ------------------------------------------------------------------------------

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
                      "(or multipath_nmt.compat.trust_globals(...) in Python)")
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
        reason = detail.group(1).strip().rstrip(".") if detail else _torch_reason(err)
        return DamagedCheckpointError(path, f"damaged or truncated checkpoint (its pickled data "
                                            f"cannot be read: {reason}): {_DAMAGED}; use an "
                                            "earlier checkpoint")
    try:  # did fairseq fail on the file, or on what the file holds?
        raw = torch.load(path, map_location="cpu")
    except Exception as raw_err:
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
    except Exception:  # the legacy format: torch names the first refused global in its message
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
        except Exception as err:
            raise DamagedCheckpointError(path, f"damaged checkpoint: its data.pkl record cannot be "
                                               f"read ({_torch_reason(err)})") from None


def saved_at(state):
    """(epoch, number of updates) recorded in a (peeked or loaded) fairseq checkpoint."""
    history = state.get("optimizer_history") or [{}]
    updates = history[-1].get("num_updates")
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    return iterator.get("epoch"), updates


# --- writing -------------------------------------------------------------------------------

def _os_error(err):
    for candidate in (err, err.__cause__, err.__context__):
        if isinstance(candidate, OSError) and candidate.strerror:
            return candidate
    return None


def _errno(err):
    return getattr(_os_error(err), "errno", None)


def _reason(err):
    os_error = _os_error(err)
    if os_error is not None:
        return f"{os_error.strerror}, errno {os_error.errno}"
    return _torch_reason(err)


def write_atomically(path, write):
    """:func:`multipath_nmt.atomic_files.write_atomically` (``path`` is left as it was on any
    failure, no temporary file stays behind), its errors as one :class:`CheckpointSaveError`."""
    try:
        atomic_files.write_atomically(path, write)
    except CheckpointSaveError:
        raise
    except Exception as err:
        limit = " or raise the file-size limit (ulimit -f)" if _errno(err) == errno.EFBIG else ""
        raise CheckpointSaveError(
            str(path), f"could not be written ({_reason(err)}); the partial file was removed and "
                       "the checkpoints saved before are unchanged. Free disk space (or keep fewer "
                       f"checkpoints: --keep-last-epochs, --keep-interval-updates){limit} and run the "
                       "same command again") from err


def save_atomically(obj, path):
    """``torch.save(obj)`` to ``path`` through :func:`write_atomically`."""
    write_atomically(path, lambda out: torch.save(obj, out))


def _persistent_save(original):
    @functools.wraps(original)
    def torch_persistent_save(obj, filename, async_write=False):
        if async_write or "://" in str(filename):
            return original(obj, filename, async_write)
        save_atomically(obj, filename)

    torch_persistent_save.__multipath_nmt_patched__ = True
    return torch_persistent_save


# --- resuming ------------------------------------------------------------------------------

_CHECKPOINT_NAMES = (r"checkpoint_\d+_\d+{}\.pt", r"checkpoint\d+{}\.pt", r"checkpoint_best{}\.pt",
                     r"checkpoint\.best_.+{}\.pt")


def newest_readable(folder, suffix="", exclude=()):
    """(path, epoch, updates) of the checkpoint of ``folder`` with the most updates whose
    structure reads, or None; unreadable ones are logged and skipped."""
    patterns = [re.compile(p.format(re.escape(suffix))) for p in _CHECKPOINT_NAMES]
    best = None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if path in exclude or not any(p.fullmatch(name) for p in patterns):
            continue
        try:
            check_file(path)
            state = peek_checkpoint(path) or read_checkpoint(path)
            epoch, updates = saved_at(state)
        except CheckpointError as err:
            logger.warning(f"skipping {err}")
            continue
        if updates is None:
            continue
        key = (updates, os.path.getmtime(path))
        if best is None or key > best[0]:
            best = (key, path, epoch, updates)
    return best and best[1:]


def _set_aside(path):
    aside, n = f"{path}.damaged", 1
    while os.path.lexists(aside):
        aside, n = f"{path}.damaged.{n}", n + 1
    os.replace(path, aside)
    return aside


def _resume_from_readable(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def load_checkpoint_or_the_newest_readable(cfg, trainer, **passthrough_args):
        suffix = trainer.checkpoint_suffix or ""
        last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix}.pt")
        if cfg.restore_file != "checkpoint_last.pt" or "://" in last or not os.path.isfile(last):
            return load_checkpoint(cfg, trainer, **passthrough_args)
        try:
            check_file(last)
            peek_checkpoint(last)
            return load_checkpoint(cfg, trainer, **passthrough_args)
        except UNREADABLE as damage:
            if damage.path != last:
                raise
            return _resume_from_earlier(cfg, trainer, last, damage, load_checkpoint, passthrough_args)

    load_checkpoint_or_the_newest_readable.__multipath_nmt_patched__ = True
    return load_checkpoint_or_the_newest_readable


def _all_ranks_wait(trainer):
    if trainer.data_parallel_world_size > 1:
        torch.distributed.barrier()


def _resume_from_earlier(cfg, trainer, last, damage, load_checkpoint, passthrough_args):
    try:
        _, damaged_updates = saved_at(peek_checkpoint(last) or {})
    except CheckpointError:
        damaged_updates = None
    suffix = trainer.checkpoint_suffix or ""
    found = newest_readable(cfg.save_dir, suffix, exclude={last})
    first_rank = trainer.data_parallel_rank == 0
    if found is None:
        # Every rank has seen the damaged file (and so takes this branch) before rank 0 renames
        # it, and none loads before it is gone: all start from scratch.
        _all_ranks_wait(trainer)
        aside = _set_aside(last) if first_rank else last + ".damaged"
        _all_ranks_wait(trainer)
        logger.warning(f"{damage}. Set aside as {aside}; no other checkpoint in {cfg.save_dir} "
                       f"can be read, so training starts again from update 0"
                       + (f" ({damaged_updates} updates are trained again)" if damaged_updates else ""))
        return load_checkpoint(cfg, trainer, **passthrough_args)
    path, epoch, updates = found
    if damaged_updates is not None:
        replayed = f"{max(damaged_updates - updates, 0)} updates ({updates + 1} to {damaged_updates}) are trained again"
    else:
        replayed = (f"the updates after {updates} are trained again (how many is unknown: the "
                    "damaged file does not say at which update it was saved)")
    restore_file, finetune = cfg.restore_file, cfg.finetune_from_model
    # fairseq appends the suffix to a --restore-file itself
    cfg.restore_file = path[:-len(suffix + ".pt")] + ".pt" if suffix else path
    cfg.finetune_from_model = None
    try:
        result = load_checkpoint(cfg, trainer, **passthrough_args)
    finally:
        cfg.restore_file, cfg.finetune_from_model = restore_file, finetune
    # Renamed only once every rank has read its state (the load broadcasts from rank 0).
    aside = _set_aside(last) if first_rank else last + ".damaged"
    logger.warning(f"{damage}. Set aside as {aside}; resumed from {path} (epoch {epoch} @ "
                   f"{updates} updates): {replayed}")
    return result


def _batches_as_in_epoch_1(get_batch_iterator):
    signature = inspect.signature(get_batch_iterator)

    @functools.wraps(get_batch_iterator)
    def get_batch_iterator_with_epoch_1_batches(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        task, dataset, epoch = bound.arguments["self"], bound.arguments["dataset"], bound.arguments["epoch"]
        reusable = (not bound.arguments["disable_iterator_cache"]
                    and not bound.arguments["update_epoch_batch_itr"]
                    and task.can_reuse_epoch_itr(dataset)
                    and dataset not in task.dataset_to_epoch_iter)
        if not reusable or epoch <= 1:
            return get_batch_iterator(*bound.args, **bound.kwargs)
        # A run that never stopped created this iterator in epoch 1 and kept its batches.
        bound.arguments["epoch"] = 1
        iterator = get_batch_iterator(*bound.args, **bound.kwargs)
        iterator.epoch = epoch
        dataset.set_epoch(epoch)
        return iterator

    get_batch_iterator_with_epoch_1_batches.__multipath_nmt_patched__ = True
    return get_batch_iterator_with_epoch_1_batches


# --- data and model --------------------------------------------------------------------------

_EMBEDDINGS = (("source", "encoder.embed_tokens.weight", "source_dictionary", "source_lang"),
               ("target", "decoder.embed_tokens.weight", "target_dictionary", "target_lang"))


def check_dictionaries(path, task):
    """Raise :class:`DictionaryMismatchError` if the task's dictionaries do not have as many
    entries as the checkpoint's embeddings have rows (fairseq fails later on a tensor shape)."""
    path = str(path)
    if "://" in path or not os.path.isfile(path):
        return
    try:
        state = peek_checkpoint(path)
    except CheckpointError:
        return  # the reader says what is wrong with the file itself
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return
    for side, key, attr, lang_attr in _EMBEDDINGS:
        tensor = state["model"].get(key)
        try:
            dictionary = getattr(task, attr)
        except (AttributeError, NotImplementedError):
            continue
        if not isinstance(tensor, _TensorShape) or dictionary is None:
            continue
        rows = tensor.shape[0]
        if rows != len(dictionary):
            raise DictionaryMismatchError(
                path, f"its {side} embedding has {rows} rows but the {side} dictionary "
                      f"{_dictionary_path(task, lang_attr)} has {len(dictionary)} entries: "
                      "use the data-bin (and dictionaries) the model was trained on")


def _dictionary_path(task, lang_attr):
    data = getattr(task.cfg, "data", None) if getattr(task, "cfg", None) is not None else None
    lang = getattr(task.cfg, lang_attr, None) if data else None
    if not data:
        return "of the task"
    folder = data.split(os.pathsep)[0]
    return os.path.join(folder, f"dict.{lang}.txt") if lang else f"in {folder}"


def _checking_trainer_dictionaries(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def trainer_load_checkpoint(self, filename, *args, **kwargs):
        check_dictionaries(filename, self.task)
        return load_checkpoint(self, filename, *args, **kwargs)

    trainer_load_checkpoint.__multipath_nmt_patched__ = True
    return trainer_load_checkpoint


def _checking_ensemble_dictionaries(load_ensemble):
    signature = inspect.signature(load_ensemble)

    @functools.wraps(load_ensemble)
    def load_model_ensemble_and_task(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        task = bound.arguments.get("task")
        if task is not None:
            for filename in bound.arguments["filenames"]:
                check_dictionaries(filename, task)
        return load_ensemble(*args, **kwargs)

    load_model_ensemble_and_task.__multipath_nmt_patched__ = True
    return load_model_ensemble_and_task


# --- installation --------------------------------------------------------------------------

def _one_line_errors(previous_hook):
    def excepthook(kind, value, traceback):
        if isinstance(value, CheckpointError):
            program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            sys.stderr.write(f"{program}: error: {value}\n")
        else:
            previous_hook(kind, value, traceback)

    excepthook.__multipath_nmt_patched__ = True
    return excepthook


def _patch(owner, name, wrapper):
    current = getattr(owner, name)
    if not getattr(current, "__multipath_nmt_patched__", False):
        setattr(owner, name, wrapper(current))


def install():
    """Idempotent: the reader, atomic saves, resume from the newest readable checkpoint, epoch-1
    batches, dictionary checks, and one-line reports of uncaught checkpoint errors."""
    from fairseq import checkpoint_utils
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.trainer import Trainer

    def reader(load):
        @functools.wraps(load)
        def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
            return read_checkpoint(path, arg_overrides, load_on_all_ranks)

        load_checkpoint_to_cpu.__multipath_nmt_patched__ = True
        return load_checkpoint_to_cpu

    _patch(checkpoint_utils, "load_checkpoint_to_cpu", reader)
    _patch(checkpoint_utils, "torch_persistent_save", _persistent_save)
    _patch(checkpoint_utils, "load_checkpoint", _resume_from_readable)
    _patch(checkpoint_utils, "load_model_ensemble_and_task", _checking_ensemble_dictionaries)
    _patch(Trainer, "load_checkpoint", _checking_trainer_dictionaries)
    _patch(FairseqTask, "get_batch_iterator", _batches_as_in_epoch_1)
    _patch(sys, "excepthook", _one_line_errors)
