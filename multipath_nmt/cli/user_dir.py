"""multipath-user-dir: print the folder to give fairseq's ``--user-dir``, for any install and
from any folder: ``fairseq-train ... --user-dir "$(multipath-user-dir)"``.

``--user-dir multipath_nmt`` names a folder relative to the working directory: it works in a
checkout's root, and elsewhere only through fairseq's fallback to site-packages, which an editable
install does not use."""
import importlib.util
import sys


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args:
        print(__doc__.split("\n\n")[0].replace("multipath-user-dir: p", "P"))
        sys.exit(0 if args[0] in ("-h", "--help") else 1)
    spec = importlib.util.find_spec("multipath_nmt")
    print(list(spec.submodule_search_locations)[0])


if __name__ == "__main__":
    main()
