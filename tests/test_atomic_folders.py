"""multipath_nmt.atomic_files' folders: folder_written_atomically (what the export tools write
through) and unwritable_folder (what they and multipath-prepare check first). The tools' own
tests (tests/test_export_hf.py, tests/test_serving.py, tests/test_prepare.py) interrupt and kill
them; these cover the cases a tool cannot reach on purpose."""
import errno
import os

import pytest

from multipath_nmt import atomic_files
from multipath_nmt.atomic_files import FolderNotWritten, folder_written_atomically


def _old(folder):
    folder.mkdir()
    (folder / "old.txt").write_text("old")


def test_a_complete_folder_takes_the_place_of_the_old_one(tmp_path):
    _old(tmp_path / "out")
    with folder_written_atomically(tmp_path / "out", replace=True) as folder:
        (tmp_path / folder / "new.txt").write_text("new")
        assert (tmp_path / "out" / "old.txt").is_file()  # the old one until the block ends
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_existing_folder_is_refused_before_the_block_without_replace(tmp_path):
    _old(tmp_path / "out")
    with pytest.raises(FolderNotWritten, match=f"^{tmp_path / 'out'} exists$"):
        with folder_written_atomically(tmp_path / "out"):
            pytest.fail("the block ran")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]


def test_an_os_error_in_the_block_is_one_line_and_leaves_the_old_folder(tmp_path):
    _old(tmp_path / "out")
    with pytest.raises(FolderNotWritten) as raised:
        with folder_written_atomically(tmp_path / "out", replace=True) as folder:
            (tmp_path / folder / "part").write_text("half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(raised.value) == (f"cannot write {tmp_path / 'out'}: No space left on device "
                                 f"(errno 28); {tmp_path / 'out'} is as it was")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]


def test_a_failed_rename_into_place_puts_the_old_folder_back(tmp_path, monkeypatch):
    _old(tmp_path / "out")
    rename = os.rename

    def failing_rename(source, target):
        if str(source).endswith(".tmp") and str(target) == str(tmp_path / "out") and \
                os.path.isfile(os.path.join(source, "new.txt")):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return rename(source, target)

    monkeypatch.setattr(atomic_files.os, "rename", failing_rename)
    with pytest.raises(FolderNotWritten, match="Input/output error"):
        with folder_written_atomically(tmp_path / "out", replace=True) as folder:
            (tmp_path / folder / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]


def test_an_existing_read_only_folder_is_refused(tmp_path, monkeypatch):
    """os.access as for a user without write permission (the tests run as root, for whom a
    read-only folder is writable): what this covers is the check and its line."""
    _old(tmp_path / "out")
    access = os.access
    monkeypatch.setattr(atomic_files.os, "access", lambda path, mode: (
        False if str(path) == str(tmp_path / "out") and mode & os.W_OK else access(path, mode)))
    assert atomic_files.unwritable_folder(tmp_path / "out") == \
        f"cannot write {tmp_path / 'out'}: it is a read-only folder"
    with pytest.raises(FolderNotWritten, match="it is a read-only folder$"):
        with folder_written_atomically(tmp_path / "out", replace=True):
            pytest.fail("the block ran")
