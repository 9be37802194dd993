"""Single layers timed forward + backward, where whole models would hide the figure: batched
multi-path layers against the loop reference (target 3), WideNet's MoE routing against its
experts' compute (target 5), and what routing adds to ParameterNet's routed FFN (target 4)."""
import torch
from torch import nn

from multipath_nmt.benchmark.timing import clock, summary, synchronize
from multipath_nmt.modules.moe import MoEFeedForward, expert_capacity, pop_all_routing_stats
from multipath_nmt.modules.multipath import MultiPathEncoderLayer
from multipath_nmt.modules.parameternet import ParameterNetFeedForward
from multipath_nmt.testing.multipath_reference import ReferenceMultiPathEncoderLayer


def time_forward_backward(fn, x, device):
    """Seconds for one forward + backward of ``fn(x).sum()``."""
    synchronize(device)
    start = clock(device)
    fn(x).float().sum().backward()
    synchronize(device)
    return clock(device) - start


def round_robin(fns, x, device, repeats, steps):
    """Median seconds per fwd+bwd of every function, measured round-robin. ``fns`` maps a name to
    a function of ``x``, or to a (function, its own input) pair."""
    calls = {name: fn if isinstance(fn, tuple) else (fn, x) for name, fn in fns.items()}
    times = {name: [] for name in calls}
    for fn, inp in calls.values():  # warm-up
        time_forward_backward(fn, inp, device)
    for _ in range(repeats):
        for name, (fn, inp) in calls.items():
            times[name].append(sum(time_forward_backward(fn, inp, device)
                                   for _ in range(steps)) / steps)
    return {name: summary(values) for name, values in times.items()}


def layer_benchmarks(size, device, dtype, repeats, log=print):
    """Target 3 (batched paths vs the loop-over-modules reference, one encoder layer) and target 5
    (WideNet's MoE: router + dispatch + combine vs the experts' own compute)."""
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
        timed = round_robin({"batched": batched, "reference": reference}, x, device,
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
        return torch.baddbmm(moe.fc2_bias.unsqueeze(1), moe.activation_fn(hidden), moe.fc2_weight)

    def whole_layer(inp):
        result = moe(inp)
        moe.pop_routing_stats()
        return result

    timed = round_robin({"moe": whole_layer, "experts": (experts_only, expert_input)}, x,
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

    timed = round_robin({"routed": routed_ffn, "dense": dense,
                         "dense_on_slots": (dense, slot_rows.requires_grad_())},
                        x, device, repeats, steps)
    return {"slots": slots, "tokens": tokens, "routed_s": timed["routed"],
            "dense_s": timed["dense"], "dense_on_slots_s": timed["dense_on_slots"]}
