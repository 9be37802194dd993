"""What the export tests (tests/test_export_hf.py, tests/test_serving.py) share: a data-bin whose
dictionaries have the checkpoint's size but other symbols, and output folders that cannot be
written."""
import shutil


def data_bin_with_other_symbols(data_bin, folder):
    """A copy of ``data_bin`` whose dictionaries have the same entries, the first two after the
    special symbols swapped (token ids 4 and 5): the size fits the checkpoint, the symbols do
    not. Returns the copy and the two symbols."""
    copy = shutil.copytree(data_bin, folder / "other-symbols")
    first = second = None
    for dictionary in copy.glob("dict.*.txt"):
        lines = dictionary.read_text(encoding="utf-8").splitlines(keepends=True)
        lines[0], lines[1] = lines[1], lines[0]
        dictionary.write_text("".join(lines), encoding="utf-8")
        first, second = lines[1].split()[0], lines[0].split()[0]
    return copy, first, second


def unwritable_targets(tmp_path):
    """Output folders that cannot be written, each with the line that says why: under a regular
    file, and a symbolic link to nothing (the tests run as root, for whom a read-only folder
    is writable: a read-only file system is simulated apart)."""
    (tmp_path / "file").write_text("not a folder")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    return {
        "under-a-file": (tmp_path / "file" / "out",
                         f"cannot create {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} is a "
                         "file, not a folder"),
        "dangling-symlink": (link, f"{link} is a symbolic link to {tmp_path / 'gone'}, which "
                                   "does not exist"),
    }
