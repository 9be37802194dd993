"""Reading, writing and finding fairseq checkpoints: every failure is one true line.

* :func:`read_checkpoint` is the one reader behind every entry point (the patches of
  :mod:`multipath_nmt.fairseq_patches.checkpoints` put it in place of fairseq's
  ``checkpoint_utils.load_checkpoint_to_cpu``, which ``fairseq-train`` (resume),
  ``fairseq-generate``/``-interactive`` and our tools call). It tells apart a missing file, an
  empty or truncated one, a file that is not a PyTorch checkpoint, a PyTorch file that is not a
  fairseq checkpoint, an architecture that is not registered (naming the ``--user-dir`` the
  checkpoint was trained with) and a file that pickles a global outside the safe-loading
  allow-list (naming it; only then is the ``MULTIPATH_NMT_TRUST_GLOBALS`` opt-in, or
  :func:`trust_globals`, mentioned). Each is a :class:`CheckpointError` whose message starts with
  the path; uncaught, it is printed as one line without a traceback and the process exits with
  status 1.
* :func:`save_atomically` writes through :mod:`multipath_nmt.atomic_files` (a temporary file in
  the destination folder, fsynced and renamed into place). A failed write removes the partial file
  and raises :class:`CheckpointSaveError`; earlier checkpoints are untouched.
* :func:`peek_checkpoint` reads a checkpoint's structure without its tensor data,
  :func:`proven_damage` tells whether a file is proven damaged (what a resume checks
  ``checkpoint_last.pt`` with) and :func:`newest_readable` finds the checkpoint with the most
  updates that reads (what a resume falls back to when ``checkpoint_last.pt`` is damaged).
* :func:`check_dictionaries`: a data-bin whose dictionaries do not match the checkpoint's
  embeddings is reported with both sizes and both paths before fairseq fails on a tensor shape,
  and one of the same size but other symbols (recorded at each save, :func:`dictionary_symbols`)
  with the first token id that differs.
"""
import argparse
import collections
import concurrent.futures
import errno
import importlib
import itertools
import logging
import os
import pickle
import re
import threading
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
                      "(or multipath_nmt.checkpoints.trust_globals(...) in Python)")
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
        except Exception as err:
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


def write_atomically(path, write, ticket=None):
    """:func:`multipath_nmt.atomic_files.write_atomically` (``path`` is left as it was on any
    failure, no temporary file stays behind), its errors as one :class:`CheckpointSaveError`.
    A file written is recorded (:func:`written_since`) under ``ticket``, the number of the save
    it belongs to (a new one if None)."""
    if ticket is None:
        ticket = next(_tickets)
    try:
        atomic_files.write_atomically(path, write)
        _record_written(path, ticket)
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


# --- what this process wrote ----------------------------------------------------------------

# A ticket is taken when a write is asked for (an asynchronous one completes later, after writes
# asked for since). path -> (ticket, completion number) of the write that last completed it;
# written to by the asynchronous writer's thread too, hence the lock.
_written = {}
_written_lock = threading.Lock()
_tickets = itertools.count(1)
_completions = itertools.count(1)


def _record_written(path, ticket):
    with _written_lock:
        _written[os.path.abspath(str(path))] = (ticket, next(_completions))


def write_mark():
    """A mark to pass to :func:`written_since` later."""
    return next(_tickets)


def written_since(mark):
    """The files this process completed for writes asked for after ``mark`` (:func:`write_mark`),
    in the order they completed. A write asked for before the mark is not one of them, even if
    the asynchronous writer completed it after."""
    with _written_lock:
        return [path for path, (ticket, _) in sorted(_written.items(), key=lambda item: item[1][1])
                if ticket > mark]


# --- asynchronous saves ------------------------------------------------------------------------

class AsynchronousWriter:
    """Writes checkpoints on one background thread (``--write-checkpoints-asynchronously``).

    Each job writes the same bytes to one or more paths, each through :func:`write_atomically`
    (a temporary file, fsynced, renamed over the path): a kill at any moment leaves every path
    either as it was or complete. Jobs run one after the other, in the order submitted. A path
    that cannot be written is logged at once in one line and the job goes on with its other
    paths; the failed paths are written again from the same bytes, in the training process, at
    the next submit and when the writes are awaited (:meth:`write_failed_again`): an I/O error
    that passes (a network file system's blip) costs nothing, one that stays stops training with
    its :class:`CheckpointSaveError` line. "Saved checkpoint" is logged for a path once written.
    """

    def __init__(self):
        self._executor = None
        self._jobs = []  # futures not yet checked, oldest first
        self._lock = threading.Lock()

    def submit(self, paths, chunks, described=""):
        """Write the concatenated ``chunks`` (bytes-like, kept by reference until written) to each
        of ``paths`` in turn; returns at once (after writing again what failed before).
        ``described`` follows the path in the "Saved checkpoint" line, e.g. ``(epoch 1 @ 4
        updates)``."""
        self.write_failed_again()
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="multipath_nmt-checkpoint-writer")
            self._jobs.append(self._executor.submit(
                _FailedWrites(list(paths), list(chunks), next(_tickets), described).write))

    def wait(self, pending=0):
        """Block until at most ``pending`` jobs are still to finish (0: all of them)."""
        with self._lock:
            running = [job for job in self._jobs if not job.done()]
        if len(running) > pending:
            concurrent.futures.wait(running[:len(running) - pending])

    def write_failed_again(self):
        """Write again, here and now, the paths that finished jobs failed to write; raise the
        :class:`CheckpointSaveError` of the first that fails again."""
        with self._lock:
            done = [job for job in self._jobs if job.done()]
            self._jobs = [job for job in self._jobs if not job.done()]
        for job in done:
            failed = job.result()
            if failed.paths:
                failed.write(again=True)

    def join(self):
        """Wait for every job, then write again what failed; raise the first error."""
        self.wait()
        self.write_failed_again()


class _FailedWrites:
    """One job's bytes and the paths still to write them to (all, before it runs)."""

    def __init__(self, paths, chunks, ticket, described):
        self.paths, self.chunks, self.ticket, self.described = paths, chunks, ticket, described

    def _write(self, out):
        for chunk in self.chunks:
            out.write(chunk)

    def write(self, again=False):
        """Write every path; on the background thread a failed path is logged and kept for
        later (returns ``self``), written again its error is raised."""
        failed = []
        for path in self.paths:
            try:
                write_atomically(path, self._write, self.ticket)
            except CheckpointSaveError as err:
                if again:
                    raise
                failed.append(path)
                logger.error(f"{path}: the background write failed ({_reason(err.__cause__ or err)}); "
                             "training goes on, and the next save or the end of the run writes "
                             "it again (the error stops training if it stays)")
                continue
            logger.info(f"Saved checkpoint {path} {self.described}".rstrip()
                        + (" (written again after the failed write)" if again else ""))
        self.paths = failed
        if not failed:
            self.chunks = None  # the bytes are no longer needed
        return self


asynchronous_writer = AsynchronousWriter()


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


# --- data and model --------------------------------------------------------------------------

_EMBEDDINGS = (("source", "encoder.embed_tokens.weight", "source_dictionary", "source_lang"),
               ("target", "decoder.embed_tokens.weight", "target_dictionary", "target_lang"))


# The checkpoint's top-level entry {"source": symbols, "target": symbols} (fairseq keeps unknown
# top-level entries when it loads, and the trainer writes a new one at every save).
DICTIONARIES = "dictionaries"
_USE_THE_TRAINING_DATA = "use the data-bin (and dictionaries) the model was trained on"
_warned_size_only = set()


def _task_dictionary(task, attr):
    try:
        return getattr(task, attr)
    except (AttributeError, NotImplementedError):
        return None


def dictionary_symbols(task):
    """What a checkpoint records of ``task``'s dictionaries (:data:`DICTIONARIES`): each side's
    symbols in token-id order (one list for both sides of a joined dictionary)."""
    recorded = {}
    for side, _, attr, _ in _EMBEDDINGS:
        dictionary = _task_dictionary(task, attr)
        if dictionary is not None:
            symbols = list(dictionary.symbols)
            recorded[side] = next((seen for seen in recorded.values() if seen == symbols), symbols)
    return recorded


def check_dictionaries(path, task):
    """Raise :class:`DictionaryMismatchError` if the task's dictionaries are not those the
    checkpoint was trained with: another size than its embeddings' rows (fairseq fails later on
    a tensor shape), or other symbols than it recorded. A checkpoint that recorded none (stock
    fairseq's, older ones) is checked by size, with a warning."""
    path = str(path)
    if "://" in path or not os.path.isfile(path):
        return
    try:
        state = peek_checkpoint(path)
    except CheckpointError:
        return  # the reader says what is wrong with the file itself
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return
    recorded = state.get(DICTIONARIES)
    size_only = False
    for side, key, attr, lang_attr in _EMBEDDINGS:
        tensor = state["model"].get(key)
        dictionary = _task_dictionary(task, attr)
        if not isinstance(tensor, _TensorShape) or dictionary is None:
            continue
        rows = tensor.shape[0]
        if rows != len(dictionary):
            raise DictionaryMismatchError(
                path, f"its {side} embedding has {rows} rows but the {side} dictionary "
                      f"{_dictionary_path(task, lang_attr)} has {len(dictionary)} entries: "
                      f"{_USE_THE_TRAINING_DATA}")
        if not isinstance(recorded, dict) or side not in recorded:
            size_only = True
            continue
        differs = next((i for i, (saved, given) in enumerate(zip(recorded[side], dictionary.symbols))
                        if saved != given), None)
        if differs is not None:
            raise DictionaryMismatchError(
                path, f"its {side} dictionary is not {_dictionary_path(task, lang_attr)}, although "
                      f"both have {rows} entries: token id {differs} is {recorded[side][differs]!r} "
                      f"in the checkpoint but {dictionary.symbols[differs]!r} in the data-bin's; "
                      f"{_USE_THE_TRAINING_DATA}")
    if size_only and path not in _warned_size_only:
        _warned_size_only.add(path)
        logger.warning(f"{path} does not record its dictionaries' symbols (saved by stock fairseq or "
                       "an older multipath_nmt): the data-bin's dictionaries are checked by their size only")


def _dictionary_path(task, lang_attr):
    data = getattr(task.cfg, "data", None) if getattr(task, "cfg", None) is not None else None
    lang = getattr(task.cfg, lang_attr, None) if data else None
    if not data:
        return "of the task"
    folder = data.split(os.pathsep)[0]
    return os.path.join(folder, f"dict.{lang}.txt") if lang else f"in {folder}"
