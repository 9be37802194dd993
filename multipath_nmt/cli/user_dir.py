"""multipath-user-dir: print the folder to give fairseq's ``--user-dir``, for any install and
from any folder: ``fairseq-train ... --user-dir "$(multipath-user-dir)"``.

``--user-dir multipath_nmt`` names a folder relative to the working directory: it works in a
checkout's root, and elsewhere only through fairseq's fallback to site-packages, which an editable
install does not use."""
import importlib.util

from multipath_nmt.cli import ToolParser


def build_parser():
    return ToolParser(prog="multipath-user-dir",
                      description="Print the folder to give fairseq's --user-dir: "
                                  "--user-dir \"$(multipath-user-dir)\".")


def main(argv=None):
    build_parser().parse_args(argv)
    spec = importlib.util.find_spec("multipath_nmt")
    print(list(spec.submodule_search_locations)[0])


if __name__ == "__main__":
    main()
