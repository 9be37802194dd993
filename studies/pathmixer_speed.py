"""PathMixer before and after b5088b9 (one LayerNorm over all features, cheap features as one
matmul), side by side on the CPU: forward + backward of one multi-path encoder layer, the
module of ``b5088b9~1`` and today's, built with the same seed, timed alternately in one process.

    python studies/pathmixer_speed.py [OUT.json]   # in a git checkout (reads b5088b9~1)

Writes the medians [min-max] of each round's milliseconds per step and their ratio, with the
machine, torch and commit (docs/bench/pathmixer-speed-cpu.json). A study script, not a test.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types

import torch

BEFORE = "b5088b9~1"
SHAPE = dict(dim=256, ffn=1024, heads=4, paths=4, length=32, batch=32)  # multipath-bench's default
ROUNDS, STEPS = 7, 10


def module_at(revision):
    source = subprocess.run(["git", "show", f"{revision}:multipath_nmt/modules/multipath.py"],
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"multipath_at_{revision.replace('~', '_')}")
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module


def step_ms(layer, x):
    start = time.perf_counter()
    for _ in range(STEPS):
        layer(x).float().pow(2).mean().backward()
    return 1e3 * (time.perf_counter() - start) / STEPS


def main(out):
    from multipath_nmt.modules import multipath as today

    before = module_at(BEFORE)
    result = {"before": BEFORE, "shape": SHAPE, "rounds": ROUNDS, "steps_per_round": STEPS,
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "command": " ".join(["python", *sys.argv]), "cases": {}}
    for cheap in (False, True):
        layers = {}
        for name, module in (("before", before), ("today", today)):
            torch.manual_seed(1)
            layers[name] = module.MultiPathEncoderLayer(
                SHAPE["dim"], SHAPE["ffn"], SHAPE["heads"], SHAPE["paths"], cheap_features=cheap)
        x = torch.randn(SHAPE["length"], SHAPE["batch"], SHAPE["dim"], requires_grad=True)
        times = {"before": [], "today": []}
        for name in times:  # warm-up
            step_ms(layers[name], x)
        for _ in range(ROUNDS):
            for name in times:
                times[name].append(step_ms(layers[name], x))
        summary = {name: {"median": statistics.median(v), "min": min(v), "max": max(v),
                          "values": v} for name, v in times.items()}
        summary["today_vs_before"] = summary["today"]["median"] / summary["before"]["median"]
        result["cases"]["cheap features" if cheap else "plain"] = summary
        print(("cheap features" if cheap else "plain"), json.dumps(
            {k: (round(v["median"], 2) if isinstance(v, dict) else round(v, 3))
             for k, v in summary.items()}), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "pathmixer-speed-cpu.json")
