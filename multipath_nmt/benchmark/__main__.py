"""``python -m multipath_nmt.benchmark --memory-probe SPEC``: the fresh process in which
:func:`multipath_nmt.benchmark.memory.peak_memory_of_step` measures one training step. It prints
``{"peak_mib": ...}`` as its last line. Not a user command: that is ``multipath-bench``."""
import argparse
import json

from multipath_nmt.benchmark.memory import measure_peak_memory

parser = argparse.ArgumentParser(prog="python -m multipath_nmt.benchmark", description=__doc__)
parser.add_argument("--memory-probe", required=True, metavar="SPEC",
                    help="JSON: flags, size, device, fp16, loop_reference")
spec = json.loads(parser.parse_args().memory_probe)
print(json.dumps({"peak_mib": measure_peak_memory(spec)}))
