"""fairseq checkpoints, one job a module, every failure one true line: each is a
:class:`CheckpointError` whose message starts with the path; uncaught in a command-line tool, it is
printed as one line without a traceback and the process exits with status 1.

* :mod:`.reading`: the one reader behind every entry point, and what a failed read means;
* :mod:`.writing`: atomic and asynchronous writes;
* :mod:`.resume_point`: the checkpoint a resume falls back to;
* :mod:`.dictionaries`: the checkpoint's dictionaries against the data-bin's.

The patches that put them into fairseq are :mod:`multipath_nmt.fairseq_patches.checkpoints`.
"""
import pickle


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
