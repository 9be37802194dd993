"""multipath-user-dir: print the folder to give fairseq's ``--user-dir``, for any install and
from any folder: ``fairseq-train ... --user-dir "$(multipath-user-dir)"``.

``--user-dir multipath_nmt`` names a folder relative to the working directory: it works in a
checkout's root, and elsewhere only through fairseq's fallback to site-packages, which an editable
install does not use."""
import importlib.util
import sys

from multipath_nmt.cli import package_version

USAGE = ("usage: multipath-user-dir\n"
         "Prints the folder to give fairseq's --user-dir: --user-dir \"$(multipath-user-dir)\"")


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    if args and args[0] == "--version":
        print(f"multipath-user-dir (multipath_nmt {package_version()})")
        sys.exit(0)
    if args:
        print(f"multipath-user-dir: error: it takes no arguments, got {args[0]} "
              "(--help lists the options)", file=sys.stderr)
        sys.exit(2)
    spec = importlib.util.find_spec("multipath_nmt")
    print(list(spec.submodule_search_locations)[0])


if __name__ == "__main__":
    main()
