"""The benchmark harness behind ``multipath-bench``.

Every system is a fairseq model built through fairseq's own registry and trained through fairseq's
own ``Trainer`` (forward + backward + optimizer step, exactly what ``fairseq-train`` runs) on the
same synthetic batches. Systems are measured round-robin, so drifts of a noisy machine hit all of
them alike; figures are medians over repeats with their min-max spread.
"""
import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from torch import nn

# Shared by every system of one size: the decoder is the same everywhere, so differences come
# from the encoders the papers compare. A training measurement runs at least ``steps`` steps and
# at least ``measure_seconds`` of the benchmark clock, so fast systems are not timed over shorter
# windows than slow ones (3 steps of the smallest model spread by 17-34% min to max here, those
# of the largest by 13-14%).
SIZES = {
    "tiny": dict(dim=64, ffn=256, heads=4, vocab=1000, batch=8, length=12, base_layers=2,
                 repeats=2, steps=1, measure_seconds=0.0, beam_sentences=4),
    "default": dict(dim=256, ffn=1024, heads=4, vocab=8000, batch=32, length=32, base_layers=6,
                    repeats=6, steps=3, measure_seconds=6.0, beam_sentences=16),
}


@dataclass
class System:
    name: str
    arch: str
    flags: list = field(default_factory=list)  # fairseq-train flags on top of the shared size
    criterion: str = "label_smoothed_cross_entropy"
    compare_to: str = ""  # the system whose throughput this one is judged against
    group: str = ""
    # the multi-path encoder layers swapped for the loop-over-modules reference (same weights):
    # an implementation to compare with, not an architecture
    loop_reference: bool = False


def systems_for(size):
    """The side-by-side line-up; layer counts are relative to the base depth L of the size."""
    L = size["base_layers"]
    ffn = size["ffn"]
    mp = "multipath_transformer"
    moe_criterion = "label_smoothed_cross_entropy_with_moe"
    return [
        System("stock prenorm L", "transformer_prenorm_wmt_en_de", [f"--encoder-layers={L}"],
               group="baselines"),
        System("stock deep 4L", "transformer_prenorm_wmt_en_de", [f"--encoder-layers={4 * L}"],
               group="baselines"),
        System("multi-path L x 4 (full)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4"], compare_to="stock deep 4L",
               group="multi-path"),
        System("multi-path L x 4 (+cheap features)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4", "--cheap-features"],
               compare_to="multi-path L x 4 (plain)", group="multi-path"),
        System("multi-path L x 4 (loop reference)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4"],
               compare_to="multi-path L x 4 (full)", group="multi-path", loop_reference=True),
        System("multi-path L x 4 (plain)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4", "--no-path-norm",
                "--path-weights=fixed"], compare_to="stock deep 4L", group="multi-path"),
        System("multi-path 2L x 2 (full)", mp,
               [f"--encoder-layers={2 * L}", "--encoder-paths=2"], compare_to="stock deep 4L",
               group="multi-path"),
        System("WideNet (shared attn + MoE E4 k2)", "widenet_transformer_wmt_en_de",
               [f"--encoder-layers={L}"], criterion=moe_criterion,
               compare_to="dense, FFN x2 (WideNet's active FLOPs)", group="MoE"),
        System("dense, FFN x2 (WideNet's active FLOPs)", "transformer_prenorm_wmt_en_de",
               [f"--encoder-layers={L}", f"--encoder-ffn-embed-dim={2 * ffn}"], group="MoE"),
        System("EWA (E4, every-2)", "ewa_transformer_wmt_en_de", [f"--encoder-layers={L}"],
               criterion=moe_criterion, compare_to="stock prenorm L", group="MoE"),
        System("ParameterNet (routed, both)", "parameternet_transformer_wmt_en_de",
               [f"--encoder-layers={L}", "--parameternet-proj=both",
                "--parameternet-mode=routed"], criterion=moe_criterion,
               compare_to="stock prenorm L", group="MoE"),
        System("ParameterNet (dynamic, both)", "parameternet_transformer_wmt_en_de",
               [f"--encoder-layers={L}", "--parameternet-proj=both",
                "--parameternet-mode=dynamic"], compare_to="stock prenorm L", group="MoE"),
    ]


def fairseq_flags(size, system):
    return [
        "--arch", system.arch, "--share-all-embeddings",
        f"--encoder-embed-dim={size['dim']}", f"--decoder-embed-dim={size['dim']}",
        f"--encoder-ffn-embed-dim={size['ffn']}", f"--decoder-ffn-embed-dim={size['ffn']}",
        f"--encoder-attention-heads={size['heads']}", f"--decoder-attention-heads={size['heads']}",
        "--decoder-layers=1", "--dropout=0.1",
        "--optimizer=adam", "--adam-betas=(0.9, 0.997)", "--lr=0.001",
        "--lr-scheduler=inverse_sqrt", "--warmup-updates=100",
        f"--criterion={system.criterion}", "--label-smoothing=0.1",
        "--max-tokens=100000", "--max-update=100000", "--seed=1", "--no-progress-bar",
        *system.flags,
    ]


# mallopt parameters of glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory():
    """Serve large CPU tensors from the heap instead of a fresh mmap per allocation.

    glibc maps every allocation above its mmap threshold (at most 32 MiB by default) anew, so
    each training step page-faults its large activations and gradients in again: at the default
    size that was 13% of a stock fairseq step and 47% of a dynamic ParameterNet step (the harness
    times all systems this way, like a long-running trainer's warm allocator). Returns whether
    it applied (glibc only; CUDA memory is unaffected)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


@contextlib.contextmanager
def fake_data_dir(vocab):
    """fairseq's translation task reads its dictionaries from the data dir; nothing else."""
    with tempfile.TemporaryDirectory(prefix="multipath-bench-") as folder:
        for lang in ("src", "tgt"):
            with open(os.path.join(folder, f"dict.{lang}.txt"), "w") as f:
                for i in range(vocab - 4):  # + bos, pad, eos, unk
                    f.write(f"w{i} 1\n")
        yield folder


def use_loop_reference(model, args):
    """Swap the model's batched multi-path encoder layers for the loop-over-modules reference
    layers (``multipath_nmt.testing.multipath_reference``) holding the same weights."""
    from multipath_nmt.models.multipath_transformer import _path_options
    from multipath_nmt.testing.multipath_reference import ReferenceMultiPathEncoderLayer

    for index, layer in enumerate(model.encoder.layers):
        reference = ReferenceMultiPathEncoderLayer(
            args.encoder_embed_dim, args.encoder_ffn_embed_dim, args.encoder_attention_heads,
            args.encoder_paths, **_path_options(args))
        model.encoder.layers[index] = reference.load_batched_state_dict(layer.state_dict())


def build_trainer(data_dir, flags, device, fp16, loop_reference=False):
    """fairseq's own parser, task, model, criterion and Trainer, as fairseq-train builds them."""
    import multipath_nmt  # noqa: F401  (registers archs)
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    extra = ["--cpu"] if device == "cpu" else []
    if fp16:
        extra.append("--fp16")
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [data_dir, "-s", "src", "-t", "tgt", *flags, *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    if loop_reference:
        use_loop_reference(model, args)
    criterion = task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion), task


def synthetic_batch(size, vocab, seed=0):
    """Full-length sentences of random in-vocabulary tokens (no padding, so every system sees
    exactly the same number of real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = size["batch"], size["length"]
    low = 4  # after bos, pad, eos, unk
    src = torch.randint(low, vocab, (B, T), generator=gen)
    tgt = torch.randint(low, vocab, (B, T), generator=gen)
    src[:, -1] = 2
    tgt[:, -1] = 2
    prev = torch.cat([torch.full((B, 1), 2), tgt[:, :-1]], dim=1)
    return {
        "id": torch.arange(B),
        "nsentences": B,
        "ntokens": B * T,
        "net_input": {"src_tokens": src, "src_lengths": torch.full((B,), T),
                      "prev_output_tokens": prev},
        "target": tgt,
    }


def training_flops_per_token(trainer, sample):
    """Model FLOPs of one forward + backward, measured (not estimated) with torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from multipath_nmt.criterions.label_smoothed_cross_entropy_with_moe import (
        pop_all_routing_stats,
    )

    model, criterion = trainer.model, trainer.criterion
    sample = trainer._prepare_sample(sample)[0]
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _, _ = criterion(model, sample)
        loss.backward()
    model.zero_grad(set_to_none=True)
    pop_all_routing_stats(model)  # forget the routing statistics of this extra pass
    return counter.get_total_flops() / sample["ntokens"]


def micro_batch_profile(trainer, sample):
    """What one micro-batch (``task.train_step``: the criterion's forward, its logging outputs
    and the backward) costs beyond FLOPs: its host syncs (``HostSyncCounter``: the ops that make
    the host wait for a GPU, counted on any device) and the bytes autograd saves for the backward
    (the distinct storages packed by ``saved_tensors_hooks``, parameters excluded)."""
    from multipath_nmt.criterions.label_smoothed_cross_entropy_with_moe import (
        pop_all_routing_stats,
    )
    from multipath_nmt.host_syncs import HostSyncCounter
    from multipath_nmt.saved_tensors import SavedForBackward

    model, criterion = trainer.model, trainer.criterion
    sample = trainer._prepare_sample(sample)[0]
    with HostSyncCounter() as syncs, SavedForBackward(exclude=model.parameters()) as saved:
        trainer.task.train_step(sample, model, criterion, trainer.optimizer,
                                trainer.get_num_updates())
    model.zero_grad(set_to_none=True)
    pop_all_routing_stats(model)  # forget the routing statistics of this extra pass
    return {"host_syncs": syncs.total, "host_syncs_by_op": dict(syncs.by_op),
            "host_syncs_by_site": dict(syncs.by_site),
            "saved_for_backward_mib": saved.nbytes / 2 ** 20}


def matmul_peak_flops(device, dtype, n=1024, repeats=10):
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = clock(device)
        torch.mm(a, b)
        _sync(device)
        best = min(best, clock(device) - start)
    return 2 * n ** 3 / best


def clock(device):
    """The benchmark's clock. On the CPU, the CPU time of this process (all its threads): other
    jobs on a shared machine then slow the figures far less than they slow the wall clock, and
    the matmul peak is measured the same way, so MFU stays consistent. On CUDA, wall time."""
    return time.process_time() if device == "cpu" else time.perf_counter()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def steps_per_measurement(size, step_seconds):
    """Training steps timed together: at least ``size["steps"]`` and ``measure_seconds``."""
    return max(size["steps"], math.ceil(size["measure_seconds"] / step_seconds))


class ForwardBackwardClock:
    """Counts the clock a trainer spends in its task's forward + backward (``task.train_step``,
    which fairseq's ``Trainer.train_step`` calls once per batch). The rest of a training step is
    the update: gradient norm, optimizer step and the plug-in's after-step hooks (EWA's
    averaging), whose cost grows with the parameters, not with the FLOPs per token."""

    def __init__(self, trainer, device):
        self.seconds = 0.0
        task_step = trainer.task.train_step

        def timed_task_step(*args, **kwargs):
            _sync(device)
            start = clock(device)
            try:
                return task_step(*args, **kwargs)
            finally:
                _sync(device)
                self.seconds += clock(device) - start

        trainer.task.train_step = timed_task_step


def tokens_of_steps(samples, steps):
    """The tokens ``steps`` training steps see, cycling over ``samples`` from the first."""
    return sum(samples[index % len(samples)]["ntokens"] for index in range(steps))


def time_train_steps(trainer, samples, steps, device):
    """Tokens/s of ``steps`` training steps, cycling over ``samples`` from the first."""
    _sync(device)
    start = clock(device)
    for index in range(steps):
        trainer.train_step([samples[index % len(samples)]])
    _sync(device)
    return tokens_of_steps(samples, steps) / (clock(device) - start)


def beam_search_timer(trainer, task, size, device):
    """A function that times one translation of a fixed batch by fairseq's SequenceGenerator
    (beam 4, every hypothesis forced to the same length) and returns its sentences/s."""
    from fairseq.sequence_generator import SequenceGenerator

    model = trainer.model
    n = size["beam_sentences"]
    sample = synthetic_batch(dict(size, batch=n), len(task.source_dictionary), seed=1)
    sample = trainer._prepare_sample(sample)[0]
    length = size["length"]
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4,
                                  max_len_a=0, max_len_b=length, min_len=length)

    def sentences_per_s():
        model.eval()
        with torch.no_grad():
            _sync(device)
            start = clock(device)
            generator.generate([model], sample)
            _sync(device)
            rate = n / (clock(device) - start)
        model.train()
        return rate

    for _ in range(2):  # warm-up (fairseq's TorchScript helpers specialise on first calls)
        sentences_per_s()
    return sentences_per_s


def peak_memory_of_step(flags, size, device, fp16, loop_reference=False):
    """Peak memory of one training step, measured in a fresh process (CPU: peak RSS, reset via
    /proc/self/clear_refs right before the step; CUDA: max_memory_allocated)."""
    cmd = [sys.executable, "-m", "multipath_nmt.benchmark", "--memory-probe",
           json.dumps({"flags": flags, "size": size, "device": device, "fp16": fp16,
                       "loop_reference": loop_reference})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


def _memory_probe(spec):
    size, device = spec["size"], spec["device"]
    if device == "cpu":
        keep_freed_memory()
    with fake_data_dir(size["vocab"]) as data:
        trainer, task = build_trainer(data, spec["flags"], device, spec["fp16"],
                                      spec["loop_reference"])
        sample = synthetic_batch(size, len(task.source_dictionary))
        trainer.train_step([sample])  # allocate optimizer state and caches
        if device == "cuda":
            trainer.cuda_env = None  # else fairseq resets the peak counter inside train_step
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        trainer.train_step([sample])
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2 ** 20
        else:
            with open("/proc/self/status") as f:
                hwm = next(line for line in f if line.startswith("VmHWM:"))
            peak = int(hwm.split()[1]) / 1024
    print(json.dumps({"peak_mib": peak}))


def _time_fwd_bwd(fn, x, device):
    """Seconds for one forward + backward of ``fn(x).sum()``."""
    _sync(device)
    start = clock(device)
    fn(x).float().sum().backward()
    _sync(device)
    return clock(device) - start


def _round_robin(fns, x, device, repeats, steps):
    """Median seconds per fwd+bwd of every function, measured round-robin. ``fns`` maps a name to
    a function of ``x``, or to a (function, its own input) pair."""
    calls = {name: fn if isinstance(fn, tuple) else (fn, x) for name, fn in fns.items()}
    times = {name: [] for name in calls}
    for fn, inp in calls.values():  # warm-up
        _time_fwd_bwd(fn, inp, device)
    for _ in range(repeats):
        for name, (fn, inp) in calls.items():
            times[name].append(sum(_time_fwd_bwd(fn, inp, device) for _ in range(steps)) / steps)
    return {name: _summary(values) for name, values in times.items()}


def layer_benchmarks(size, device, dtype, repeats, log=print):
    """Target 3 (batched paths vs the loop-over-modules reference, one encoder layer) and target 5
    (WideNet's MoE: router + dispatch + combine vs the experts' own compute)."""
    from multipath_nmt.modules.moe import MoEFeedForward
    from multipath_nmt.modules.multipath import MultiPathEncoderLayer
    from multipath_nmt.testing.multipath_reference import ReferenceMultiPathEncoderLayer

    d, ffn, heads = size["dim"], size["ffn"], size["heads"]
    T, B = size["length"], size["batch"]
    steps = size["steps"] + 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, B, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    out = {"paths": {}}
    for n in (2, 4, 8):
        batched = MultiPathEncoderLayer(d, ffn, heads, n).to(device=device, dtype=dtype)
        reference = ReferenceMultiPathEncoderLayer(d, ffn, heads, n).to(device=device,
                                                                        dtype=dtype)
        reference.load_batched_state_dict(batched.state_dict())
        timed = _round_robin({"batched": batched, "reference": reference}, x, device,
                             repeats, steps)
        tokens = T * B
        out["paths"][n] = {
            "batched_tokens_per_s": tokens / timed["batched"]["median"],
            "reference_tokens_per_s": tokens / timed["reference"]["median"],
            "speedup": timed["reference"]["median"] / timed["batched"]["median"],
            "batched_s": timed["batched"], "reference_s": timed["reference"],
        }
        log(f"layer with {n} paths: batched {out['paths'][n]['speedup']:.2f}x the reference")

    moe = MoEFeedForward(d, ffn, num_experts=4, k=2).to(device=device, dtype=dtype)
    routing = moe.route(x.detach())
    moe.pop_routing_stats()
    expert_input = routing.dispatch(x.detach().reshape(-1, d)).requires_grad_()

    def experts_only(expert_in):
        hidden = torch.baddbmm(moe.fc1_bias.unsqueeze(1), expert_in, moe.fc1_weight)
        return torch.baddbmm(moe.fc2_bias.unsqueeze(1), moe.activation(hidden), moe.fc2_weight)

    def whole_layer(inp):
        result = moe(inp)
        moe.pop_routing_stats()
        return result

    timed = _round_robin({"moe": whole_layer, "experts": (experts_only, expert_input)}, x,
                         device, repeats, steps)
    moe_total, experts = timed["moe"], timed["experts"]
    overhead = (moe_total["median"] - experts["median"]) / experts["median"]
    out["moe"] = {"layer_s": moe_total, "experts_s": experts, "capacity": routing.capacity,
                  "routing_overhead_fraction": overhead}
    log(f"MoE layer: router + dispatch + combine = {100 * overhead:.1f}% of the experts' time")
    out["parameternet_routed_ffn"] = routed_ffn_benchmark(size, device, dtype, x, repeats, steps)
    return out


def routed_ffn_benchmark(size, device, dtype, x, repeats, steps):
    """What routing adds to ParameterNet's routed FFN (target 4): the routed FFN (both
    projections, E 4, C 1.2) against a dense FFN of the same shape on the tokens and on as many
    rows as the experts' capacity slots (fc1's; tokens fc1 drops leave fc2 fewer), fwd+bwd."""
    from multipath_nmt.criterions.label_smoothed_cross_entropy_with_moe import (
        pop_all_routing_stats,
    )
    from multipath_nmt.modules.moe import expert_capacity
    from multipath_nmt.modules.parameternet import ParameterNetFeedForward

    d, ffn, num_experts, capacity_factor = size["dim"], size["ffn"], 4, 1.2
    tokens = x.shape[0] * x.shape[1]
    slots = num_experts * expert_capacity(capacity_factor, 1, tokens, num_experts)
    routed = ParameterNetFeedForward(d, ffn, num_experts, proj="both", mode="routed",
                                     capacity_factor=capacity_factor).to(device=device, dtype=dtype)
    dense = nn.Sequential(nn.Linear(d, ffn), nn.ReLU(), nn.Linear(ffn, d)).to(device=device,
                                                                             dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    slot_rows = torch.randn(slots, d, generator=gen).to(device=device, dtype=dtype)

    def routed_ffn(inp):
        result = routed(inp)
        pop_all_routing_stats(routed)
        return result

    timed = _round_robin({"routed": routed_ffn, "dense": dense,
                          "dense_on_slots": (dense, slot_rows.requires_grad_())},
                         x, device, repeats, steps)
    return {"slots": slots, "tokens": tokens, "routed_s": timed["routed"],
            "dense_s": timed["dense"], "dense_on_slots_s": timed["dense_on_slots"]}


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


PADDED_BATCHES = 8  # the padded mode's batches per system, cycled through by every measurement


def run(size_name="default", device="cpu", fp16=False, only=None, memory=True, padded=None,
        log=print):
    """Measure every system; returns the result dict that ``write_reports`` renders.

    ``padded`` (the default on CUDA): train on padded, length-varied fairseq batches of about
    batch x length tokens instead of one full-length batch, and judge MFU against the best rate
    the device reaches on the measured models' own matrix products instead of a 1024^3 matmul
    (a GPU's rate depends on the shapes far more than a CPU's)."""
    from multipath_nmt import gpu_check

    size = SIZES[size_name]
    padded = device == "cuda" if padded is None else padded
    systems = [s for s in systems_for(size) if not only or s.name in only]
    dtype = torch.float16 if fp16 else torch.float32
    heap_allocator = device == "cpu" and keep_freed_memory()
    if not padded:
        peak = matmul_peak_flops(device, dtype)
        log(f"matmul peak ({dtype}): {peak / 1e9:.1f} GFLOP/s")
    gemm_shapes = set()
    results = {}
    with fake_data_dir(size["vocab"]) as data:
        built = {}
        for system in systems:
            flags = fairseq_flags(size, system)
            trainer, task = build_trainer(data, flags, device, fp16, system.loop_reference)
            if padded:
                samples = gpu_check.padded_batches(task, trainer.model,
                                                   size["batch"] * size["length"],
                                                   PADDED_BATCHES, mean_length=size["length"])
                gemm_shapes.update(gpu_check.model_gemm_shapes(trainer, samples[0]))
            else:
                samples = [synthetic_batch(size, len(task.source_dictionary))]
            sample = samples[0]
            flops = sum(training_flops_per_token(trainer, s) * s["ntokens"]
                        for s in samples) / tokens_of_steps(samples, len(samples))
            profile = micro_batch_profile(trainer, sample)
            for s in samples:  # warm-up: optimizer state, allocator, caches
                trainer.train_step([s])
            steps = steps_per_measurement(
                size, sample["ntokens"] / time_train_steps(trainer, samples, 1, device))
            params = sum(p.numel() for p in trainer.model.parameters())
            inactive = sum(m.inactive_parameter_count() for m in trainer.model.modules()
                           if hasattr(m, "inactive_parameter_count"))
            built[system.name] = (trainer, task, samples, ForwardBackwardClock(trainer, device))
            results[system.name] = dict(arch=system.arch, flags=system.flags, group=system.group,
                                        compare_to=system.compare_to,
                                        loop_reference=system.loop_reference, params=params,
                                        active_params=params - inactive,
                                        train_flops_per_token=flops, **profile,
                                        steps_per_measurement=steps,
                                        tokens_per_step=tokens_of_steps(samples, steps) / steps,
                                        tokens_per_s=[],
                                        forward_backward_s=[])
            log(f"built {system.name}: {params / 1e6:.2f}M params, "
                f"{flops / 1e6:.1f} MFLOP/token (fwd+bwd), {steps} steps per measurement, "
                f"{profile['host_syncs']} host syncs per micro-batch")
        if padded:
            peak, best_shape = gpu_check.gemm_peak_flops(gemm_shapes, device, dtype, repeats=20)
            log(f"peak over the models' {len(gemm_shapes)} matrix product shapes ({dtype}): "
                f"{peak / 1e9:.1f} GFLOP/s at (batch, m, k, n) = {best_shape}")
        for repeat in range(size["repeats"]):  # round-robin against drift
            for system in systems:
                trainer, _, samples, forward_backward = built[system.name]
                steps = results[system.name]["steps_per_measurement"]
                forward_backward.seconds = 0.0
                rate = time_train_steps(trainer, samples, steps, device)
                results[system.name]["tokens_per_s"].append(rate)
                results[system.name]["forward_backward_s"].append(
                    forward_backward.seconds / steps)
            log(f"repeat {repeat + 1}/{size['repeats']} done")
        for system in systems:
            r = results[system.name]
            # per repeat, so the update's share is not the difference of two unrelated medians
            tokens = r["tokens_per_step"]
            r["update_s"] = _summary([tokens / rate - forward_backward for rate, forward_backward
                                      in zip(r["tokens_per_s"], r["forward_backward_s"])])
            for key in ("tokens_per_s", "forward_backward_s"):
                r[key] = _summary(r[key])
            r["mfu"] = r["train_flops_per_token"] * r["tokens_per_s"]["median"] / peak
        timers = {system.name: beam_search_timer(*built[system.name][:2], size, device)
                  for system in systems if system.group in ("baselines", "multi-path")}
        beam_rates = {name: [] for name in timers}
        for _ in range(size["repeats"]):  # round-robin, like the training steps
            for name, timer in timers.items():
                beam_rates[name].append(timer())
        for name, rates in beam_rates.items():
            results[name]["beam_sentences_per_s"] = _summary(rates)
        del built
    # one layer is cheap to time, and its targets (3 and 5) compare close figures: more repeats
    layers = layer_benchmarks(size, device, dtype, 3 * size["repeats"], log=log)
    if memory:
        for system in systems:
            results[system.name]["peak_memory_mib"] = peak_memory_of_step(
                fairseq_flags(size, system), size, device, fp16, system.loop_reference)
    return {
        "size": size_name, "shape": size, "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "machine": machine_description(device), "matmul_peak_flops": peak,
        "batches": (f"{PADDED_BATCHES} padded, length-varied batches of up to "
                    f"{size['batch'] * size['length']} tokens" if padded
                    else "one full-length batch"),
        "peak": ("the best of the models' own matrix products" if padded
                 else "a 1024 x 1024 x 1024 matmul"),
        "heap_allocator": heap_allocator,
        "command": shlex.join(["multipath-bench", *sys.argv[1:]]), "systems": results,
        "layers": layers,
    }


def machine_description(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def _ratio(result, name, other, key="tokens_per_s"):
    systems = result["systems"]
    if name not in systems or other not in systems or key not in systems[name]:
        return None
    return systems[name][key]["median"] / systems[other][key]["median"]


def evaluate_targets(result):
    """The targets of the benchmark issue, as measured ratios from this one run."""
    rows = []

    def target(number, text, value, threshold, higher_is_better=True):
        if value is None:
            return
        met = value >= threshold if higher_is_better else value <= threshold
        rows.append(dict(target=number, text=text, value=value, threshold=threshold, met=met))

    target(1, "multi-path L x 4 tokens/s vs deep 4L (same parameters)",
           _ratio(result, "multi-path L x 4 (full)", "stock deep 4L"), 1.0)
    target(2, "PathNorm + learnable weights + cheap features tokens/s vs plain multi-path",
           _ratio(result, "multi-path L x 4 (+cheap features)", "multi-path L x 4 (plain)"), 0.95)
    paths = result["layers"]["paths"]
    for n, row in sorted(paths.items(), key=lambda kv: int(kv[0])):
        target(3, f"batched vs loop reference, {n} paths (one encoder layer, fwd+bwd)",
               row["speedup"], 1.0 if int(n) <= 2 else 1.05)
    target(3, "batched vs loop reference, 4 paths (whole model, training step)",
           _ratio(result, "multi-path L x 4 (full)", "multi-path L x 4 (loop reference)"), 1.05)
    systems = result["systems"]
    stock = systems.get("stock prenorm L")
    if stock:
        # the toolkit's architectures; the other fairseq transformers (deep, wider FFN) and the
        # loop reference are yardsticks, their MFU is shown in the table
        for name, row in systems.items():
            if row["arch"] != stock["arch"] and not row.get("loop_reference"):
                target(4, f"MFU of {name} vs stock fairseq", row["mfu"] / stock["mfu"], 0.95)
    target(5, "MoE router + dispatch + combine, fraction of the experts' time",
           result["layers"]["moe"]["routing_overhead_fraction"], 0.15, higher_is_better=False)
    target(6, "beam search sentences/s, multi-path L x 4 vs deep 4L (same decoder and parameters)",
           _ratio(result, "multi-path L x 4 (full)", "stock deep 4L", "beam_sentences_per_s"),
           0.95)
    return rows


def _spread(summary, scale=1.0, fmt="{:.0f}"):
    return (f"{fmt.format(summary['median'] * scale)} "
            f"[{fmt.format(summary['min'] * scale)}-{fmt.format(summary['max'] * scale)}]")


def markdown_report(result):
    lines = [
        f"Machine: {result['machine']}; device {result['device']}, {result['dtype']}; "
        f"size `{result['size']}` {json.dumps(result['shape'])}; "
        f"matmul peak {result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s"
        f" on {result['peak']}; training on {result['batches']}.",
        "",
        ("Rates are per second of this process's CPU time (all threads; see `clock()`), so other "
         "load on the machine changes them far less than wall time." if result["device"] == "cpu"
         else "Rates are per second of wall time."),
        *([] if not result.get("heap_allocator") else [
            "", "Large CPU tensors come from glibc's heap, not a fresh mmap per allocation "
            "(`keep_freed_memory()`), for every system alike."]),
        "",
        f"Command: `{result['command']}`",
        "",
        f"Training rates: median [min-max] over {result['shape']['repeats']} round-robin repeats, "
        f"each measurement at least {result['shape']['steps']} step(s) and "
        f"{result['shape']['measure_seconds']:g} s of the clock (`steps_per_measurement` in "
        "bench.json).",
        "",
        "| group | system | params | active | train MFLOP/token | tokens/s median [min-max] "
        "| vs | MFU | step ms: fwd+bwd + update | host syncs per micro-batch "
        "| saved for backward MiB | beam sent/s | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["systems"].items():
        ratio = _ratio(result, name, r["compare_to"]) if r["compare_to"] else None
        versus = "" if ratio is None else f"{ratio:.2f}x {r['compare_to']}"  # None: not measured
        beam = _spread(r["beam_sentences_per_s"], fmt="{:.1f}") if "beam_sentences_per_s" in r \
            else ""
        memory = f"{r['peak_memory_mib']:.0f}" if "peak_memory_mib" in r else ""
        lines.append(
            f"| {r['group']} | {name} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M "
            f"| {r['train_flops_per_token'] / 1e6:.1f} | {_spread(r['tokens_per_s'])} | {versus} "
            f"| {100 * r['mfu']:.1f}% | {1e3 * r['forward_backward_s']['median']:.0f} + "
            f"{1e3 * r['update_s']['median']:.0f} | {r['host_syncs']} | "
            f"{r['saved_for_backward_mib']:.1f} | {beam} | {memory} |")
    lines += ["", "| paths | batched tokens/s | reference tokens/s | speed-up |", "|---|---|---|---|"]
    for n, row in result["layers"]["paths"].items():
        lines.append(f"| {n} | {row['batched_tokens_per_s']:.0f} | "
                     f"{row['reference_tokens_per_s']:.0f} | {row['speedup']:.2f}x |")
    moe = result["layers"]["moe"]
    lines += ["", f"MoE layer (E 4, k 2, C 1.2, capacity {moe['capacity']}): whole layer "
              f"{1e3 * moe['layer_s']['median']:.2f} ms, experts alone "
              f"{1e3 * moe['experts_s']['median']:.2f} ms per fwd+bwd."]
    routed = result["layers"]["parameternet_routed_ffn"]
    ms = {key: 1e3 * routed[f"{key}_s"]["median"] for key in ("routed", "dense", "dense_on_slots")}
    lines += ["", f"ParameterNet routed FFN (both projections, E 4, C 1.2): {ms['routed']:.1f} "
              f"ms per fwd+bwd; a dense FFN {ms['dense']:.1f} ms on the {routed['tokens']} tokens, "
              f"{ms['dense_on_slots']:.1f} ms on {routed['slots']} rows (the capacity slots): "
              f"routing, dispatch and combine take {ms['routed'] - ms['dense_on_slots']:.1f} ms.",
              "", "| target | measured | needed | met |", "|---|---|---|---|"]
    for row in evaluate_targets(result):
        sign = "<=" if row["target"] == 5 else ">="
        lines.append(f"| {row['target']}. {row['text']} | {row['value']:.3f} | "
                     f"{sign} {row['threshold']} | {'yes' if row['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def plot_report(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["systems"])
    rates = [result["systems"][n]["tokens_per_s"] for n in names]
    medians = [r["median"] for r in rates]
    errors = [[m - r["min"] for m, r in zip(medians, rates)],
              [r["max"] - m for m, r in zip(medians, rates)]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.5), sharey=True)
    left.barh(names, medians, xerr=errors, color="tab:blue")
    left.set_xlabel("training tokens/s (median, min-max)")
    right.barh(names, [100 * result["systems"][n]["mfu"] for n in names], color="tab:orange")
    right.set_xlabel("MFU (%)")
    left.invert_yaxis()
    fig.suptitle(f"multipath-bench, {result['device']} {result['dtype']}, size {result['size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(result, out_dir):
    """bench.json, bench.md and bench.png in ``out_dir`` (each written atomically)."""
    os.makedirs(out_dir, exist_ok=True)
    result = dict(result, targets=evaluate_targets(result))
    outputs = {"bench.json": json.dumps(result, indent=1), "bench.md": markdown_report(result)}
    for name, text in outputs.items():
        tmp = os.path.join(out_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))
    tmp = os.path.join(out_dir, ".bench.png.tmp.png")
    plot_report(result, tmp)
    os.replace(tmp, os.path.join(out_dir, "bench.png"))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-probe")
    args, _ = parser.parse_known_args(argv)
    if args.memory_probe:
        _memory_probe(json.loads(args.memory_probe))


if __name__ == "__main__":
    main()
