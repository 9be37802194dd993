"""The command-line tools (setup.py's console scripts). Each module has ``build_parser()`` and
``main(argv=None)``: it parses arguments, calls the library and prints; the work itself is in the
library modules, and nothing outside this package imports it."""
import argparse


def positive_int(value):
    """argparse type: an integer >= 1, with a message naming the bad value."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number
