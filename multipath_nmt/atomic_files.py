"""Write a file, or a whole folder, so that readers see either the old content or the complete new
one, never a part.

A file's content goes to a temporary file next to the destination (same folder, so the same file
system), is flushed and fsynced, and is renamed over the destination with ``os.replace``; the
folder is fsynced so the rename itself survives a power loss. A kill, a full disk or an error
in ``write`` leaves the destination as it was and no temporary file behind.

A folder (:func:`folder_written_atomically`) is filled under a temporary name beside the
destination and renamed into place once complete; :func:`unwritable_folder` says, before any work,
why a folder could not be written at a path.
"""
import contextlib
import errno
import os
import shutil
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


class FolderNotWritten(ValueError):
    """A folder that could not be written; the message is one line that names it and the reason
    (the ``OSError`` is its ``__cause__``)."""


def os_error_reason(error):
    """``error``'s reason in a few words: "No space left on device (errno 28)"."""
    if error.errno is None:
        return str(error)
    return f"{error.strerror or os.strerror(error.errno)} (errno {error.errno})"


def _missing_target(path):
    return os.path.islink(path) and not os.path.exists(path)


def unwritable_folder(path):
    """Why a folder cannot be written at ``path``, in one line, or None. Refused: a symbolic link
    to nothing, a file, a path under a file, an existing folder without write permission; then a
    temporary folder is made and removed in the
    nearest folder that exists (``path``'s parent, or the folder its missing parents would be
    created in), which fails as the real write would (a read-only file system, no permission, a
    full disk). Nothing else is created."""
    path = os.fspath(path)
    if _missing_target(path):
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file, not a folder"
    if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
        # its files are replaced or removed (root may write anywhere but on a read-only mount)
        return f"cannot write {path}: it is a read-only folder"
    target = os.path.realpath(path)
    ancestor = os.path.dirname(target)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"cannot create {path}: {ancestor} is a file, not a folder"
    try:
        probe = _temporary_path(os.path.join(ancestor, os.path.basename(target)))
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as error:
        return f"cannot write {path}: {os_error_reason(error)}"
    return None


@contextlib.contextmanager
def folder_written_atomically(path, replace=False):
    """Yield an empty temporary folder beside ``path`` (same parent, so the same file system) to
    fill; when the block ends without an exception, its files are fsynced and it is renamed to
    ``path``. An existing ``path`` (``replace=True``, else refused; a symbolic link: the folder
    it points to) is renamed aside just before and removed after, so that ``path`` holds the old
    folder or the new one, each whole (between the two renames, an instant, neither: a kill
    there leaves the old one under the aside name). Any exception (KeyboardInterrupt and
    SystemExit too) removes the temporary folder and leaves ``path`` as it was; an ``OSError``
    (a full disk, no permission) is raised as :class:`FolderNotWritten`. A ``kill -9`` leaves at
    most a ``<path>.<hex>.tmp`` folder beside ``path``, which can be deleted."""
    shown = os.fspath(path)
    path = os.path.realpath(shown) if replace else os.path.abspath(shown)
    problem = unwritable_folder(shown)
    if not problem and os.path.lexists(path) and not replace:
        problem = f"{shown} exists"
    if problem:
        raise FolderNotWritten(problem)
    tmp = _temporary_path(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(tmp)
        yield tmp
        _fsync_tree(tmp)
        if os.path.lexists(path):
            if not replace:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), shown)
            aside = _temporary_path(path)
            os.rename(path, aside)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(aside, path)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync_folder(os.path.dirname(path))
    except OSError as error:
        raise FolderNotWritten(f"cannot write {shown}: {os_error_reason(error)}; "
                               f"{shown} is as it was") from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(folder):
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_folder(root)
