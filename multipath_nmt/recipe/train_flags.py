"""Reading the fairseq-train arguments that train.sh passes on: one scan, for every module of
the recipe that needs a flag's value (the length, early EWA's stop, the periodic save, the
model's shape for the memory model)."""
from typing import Dict, Iterable, Sequence


def given_flags(passed_on: Sequence[str], names: Iterable[str]) -> Dict[str, str]:
    """The flags ``names`` among fairseq-train's arguments ``passed_on``, with their values as
    given (``--flag VALUE`` or ``--flag=VALUE``; the last one given wins, as with argparse; "" for
    a flag given last without a value)."""
    names, given = set(names), {}
    for index, word in enumerate(passed_on):
        name, equals, value = word.partition("=")
        if name in names:
            given[name] = value if equals or index + 1 == len(passed_on) else passed_on[index + 1]
    return given
