"""Write a file so that readers see either the old content or the complete new one, never a part.

The content goes to a temporary file next to the destination (same folder, so the same file
system), is flushed and fsynced, and is renamed over the destination with ``os.replace``; the
folder is fsynced so the rename itself survives a power loss. A kill, a full disk or an error
in ``write`` leaves the destination as it was and no temporary file behind.
"""
import os
import uuid


def _temporary_path(path):
    """A fresh name next to ``path``, matching ``<name>.*.tmp``."""
    return f"{path}.{uuid.uuid4().hex[:8]}.tmp"


def write_atomically(path, write):
    """Call ``write(binary_file)`` on a temporary file next to ``path``, then put it in place of
    ``path``. On any failure the temporary file is removed and the original exception re-raised."""
    path = str(path)
    tmp = _temporary_path(path)
    try:
        with open(tmp, "xb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        _fsync_folder(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text_atomically(path, text):
    """:func:`write_atomically` of ``text`` encoded as UTF-8."""
    write_atomically(path, lambda out: out.write(text.encode("utf-8")))


def _fsync_folder(folder):
    # Best effort: some file systems (and Windows) cannot open or fsync a folder.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
