"""Command-line tools: thin wrappers over importable functions."""
import argparse


def positive_int(value):
    """argparse type: an integer >= 1, with a message naming the bad value."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number
