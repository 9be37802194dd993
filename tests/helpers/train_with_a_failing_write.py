"""``fairseq-train`` (same arguments) whose first background write of ``checkpoint_last.pt``
(``--write-checkpoints-asynchronously``) fails once with an I/O error, as on a network file
system's blip, after which the process sends itself SIGTERM: the stop comes between the failed
write and the next save."""
import errno
import os
import signal
import threading

from fairseq_cli import train  # first: it sets up fairseq's log format before fairseq logs

import multipath_nmt  # noqa: F401  (installs the patches)
from multipath_nmt import atomic_files


def _failing_once(write_atomically):
    failed = []

    def write_atomically_or_fail(path, write):
        in_background = threading.current_thread() is not threading.main_thread()
        if in_background and not failed and os.path.basename(path) == "checkpoint_last.pt":
            failed.append(path)
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the training thread
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return write_atomically(path, write)

    return write_atomically_or_fail


if __name__ == "__main__":
    atomic_files.write_atomically = _failing_once(atomic_files.write_atomically)
    train.cli_main()
