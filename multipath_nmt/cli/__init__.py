"""The command-line tools (pyproject.toml's console scripts). Each module has ``build_parser()``
and ``main(argv=None)``: it parses arguments, calls the library and prints; the work itself is in
the library modules, and nothing outside this package imports it."""
import argparse
import sys
from importlib import metadata


def package_version():
    """The installed multipath_nmt's version ("unknown" in a copy that was never installed)."""
    try:
        return metadata.version("multipath_nmt")
    except metadata.PackageNotFoundError:
        return "unknown"


def version_line(prog):
    """What ``PROG --version`` prints."""
    return f"{prog} (multipath_nmt {package_version()})"


class ToolParser(argparse.ArgumentParser):
    """argparse for our tools: ``--version``, and a bad command line refused in one line
    (argparse prints its whole usage first; ``--help`` still does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=version_line(self.prog))

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (--help lists the options)\n")
        sys.exit(2)


def positive_int(value):
    """argparse type: an integer >= 1, with a message naming the bad value."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number
