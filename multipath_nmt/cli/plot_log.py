"""multipath-plot-log: training and validation loss vs update from fairseq-train logs (the paper's Fig. 6).

    multipath-plot-log base.log multipath.log --labels Base Multi-Path --out curves.png

Reads the ``train_inner``, ``train`` and ``valid`` lines of ``--log-format simple`` or ``json``
logs (:mod:`multipath_nmt.training_log`). Losses are fairseq's, in base 2.
"""
import sys
from typing import List, Tuple

from multipath_nmt.cli import ToolParser
from multipath_nmt.training_log import LossCurves, PlotLogError, plot_curves, read_logs


def build_parser():
    parser = ToolParser(prog="multipath-plot-log", description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", metavar="LOG", help="fairseq-train logs, one per system")
    parser.add_argument("--labels", nargs="+", help="one legend label per log (default: file names)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--title", help="figure title")
    return parser


def plot(args) -> List[Tuple[str, LossCurves]]:
    """Draw the logs of parsed ``args`` and say what was drawn; raises :class:`PlotLogError`."""
    logs = read_logs(args.logs, args.labels)
    plot_curves(logs, args.out, title=args.title)
    print(f"wrote {args.out}: " + ", ".join(
        f"{label} ({len(c.train_inner) or len(c.train)} train, {sum(map(len, c.valid.values()))} valid points)"
        for label, c in logs))
    return logs


def main(argv=None):
    try:
        plot(build_parser().parse_args(argv))
    except PlotLogError as err:
        sys.exit(f"multipath-plot-log: error: {err}")


if __name__ == "__main__":
    main()
