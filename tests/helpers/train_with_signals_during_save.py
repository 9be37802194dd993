"""``fairseq-train`` (same arguments) that sends itself SIGTERM and then SIGINT in the middle of
the checkpoint save that a first signal started: after the bytes are written, before the file is
fsynced and renamed into place."""
import os
import signal
import time

from fairseq_cli import train  # first: it sets up fairseq's log format before fairseq logs

import multipath_nmt  # noqa: F401  (installs the patches, the stop on signals included)
from multipath_nmt import atomic_files
from multipath_nmt.fairseq_patches import preemption


def _signalled_while_writing(write_atomically):
    def write_atomically_and_signal(path, write):
        def write_then_signal(out):
            write(out)
            if preemption._state.signum is not None:  # the save of a stop, not a regular one
                for signum in (signal.SIGTERM, signal.SIGINT):
                    os.kill(os.getpid(), signum)
                    time.sleep(0.05)  # the handler runs here, inside the write

        return write_atomically(path, write_then_signal)

    return write_atomically_and_signal


if __name__ == "__main__":
    atomic_files.write_atomically = _signalled_while_writing(atomic_files.write_atomically)
    train.cli_main()
