"""The benchmark harness behind ``multipath-bench``, and the GPU check beside it.

Every system is a fairseq model built through fairseq's own registry and trained through fairseq's
own ``Trainer`` (forward + backward + optimizer step, exactly what ``fairseq-train`` runs) on the
same batches. One module per job, so that each measurement can be read, and changed, alone:

- ``systems``: what is measured: the sizes, the line-up of systems, their fairseq-train flags,
  and the trainer each is built into (the loop reference swapped in where a system asks for it).
- ``batches``: what they train on: the dictionaries-only data dir, one full-length synthetic
  batch, or fairseq's padded, length-varied batches.
- ``timing``: the benchmark's clock (CPU time of the process, or wall time on CUDA) and what is
  timed on it: training steps split into forward + backward and update, beam search.
- ``flops``: the two sides of MFU: measured training FLOPs per token, and the peak rate (a
  1024^3 matmul, or the best of the models' own matrix products).
- ``micro_batch``: the host-sync and saved-for-backward columns of one micro-batch (through the
  probes ``multipath_nmt.host_syncs`` and ``multipath_nmt.saved_tensors``, which stay plain
  PyTorch at the bottom of the package because the model tests use them too).
- ``memory``: glibc's heap kept while timing, and the peak memory of a step in a fresh process
  (that process is ``python -m multipath_nmt.benchmark``, see ``__main__``).
- ``layers``: single layers timed where a whole model would hide the figure (targets 3-5).
- ``harness``: :func:`run`, which measures every system round-robin, so that drifts of a noisy
  machine hit all of them alike.
- ``bench_report``: the targets as measured ratios, and bench.json / bench.md / bench.png.
- ``compiled``: ``--compiled``: each system eager and with ``--compile-layers``, side by side.
- ``gpu_check``: the GPU check of ``scripts/gpu-check.sh``, a tool of its own on the same
  systems, batches, clock and FLOP counting; it lives here because it is built from them and,
  like the benchmark, only the CLI calls it. Its parts are ``gpu_check_setup``,
  ``gpu_check_training``, ``gpu_check_ddp`` and ``gpu_check_report``.

``multipath_nmt.cli.bench`` parses arguments and calls :func:`run`, :func:`write_reports` and
:func:`markdown_report`, re-exported here with the line-up they take.
"""
from multipath_nmt.benchmark.harness import run, run_compiled, run_proxies
from multipath_nmt.benchmark.bench_report import (
    markdown_report,
    write_compiled_report,
    write_proxies_report,
    write_reports,
)
from multipath_nmt.benchmark.systems import SIZES, systems_for

__all__ = ["SIZES", "markdown_report", "run", "run_compiled", "run_proxies", "systems_for",
           "write_compiled_report", "write_proxies_report", "write_reports"]
