"""The floor of ParameterNet's routing in eager PyTorch (BENCHMARKS.md, "Why ParameterNet misses").

Times only the kernels that any eager implementation of a routed FFN with both projections
routed top-1 must run per training step, at multipath-bench's default size (1024 tokens, d 256,
FFN 1024, E 4, C 1.2): per projection, the router's product forward and its two gradient
products; the gather of the tokens into the capacity slots and of the slots' outputs back to the
tokens, forward and backward; the gate scaling and the gates' gradient (a dot product per token).
No routing decision, no autograd, no Python around them, and the same tensors every time, so
caches are warm: a lower bound on what routing adds to a dense FFN, on the benchmark's clock.

    .venv/bin/python studies/routing_floor.py
"""
import statistics

import torch

from multipath_nmt.benchmark.memory import keep_freed_memory
from multipath_nmt.benchmark.timing import clock

TOKENS, EXPERTS, SLOTS = 1024, 4, 1232  # 4 x ceil(1.2 * 1024 / 4)


def projection_kernels(in_features, out_features, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x, router_weight = randn(TOKENS, in_features), randn(EXPERTS, in_features)
    token_of_slot = torch.randint(0, TOKENS, (SLOTS,), generator=gen)
    slot_of_token = torch.randint(0, SLOTS, (TOKENS,), generator=gen)
    expert_output, gates = randn(SLOTS, out_features), torch.rand(TOKENS, 1, generator=gen)
    slot_gates, grad_y = torch.rand(SLOTS, 1, generator=gen), randn(TOKENS, out_features)
    grad_expert_input, grad_logits = randn(SLOTS, in_features), randn(TOKENS, EXPERTS)

    def forward():
        torch.mm(x, router_weight.t())
        x.index_select(0, token_of_slot)
        expert_output.index_select(0, slot_of_token).mul_(gates)

    def backward():
        grad_y.index_select(0, token_of_slot).mul_(slot_gates)
        (expert_output.index_select(0, slot_of_token) * grad_y).sum(1)
        grad_x = grad_expert_input.index_select(0, slot_of_token)
        grad_x.addmm_(grad_logits, router_weight)
        torch.mm(grad_logits.t(), x)

    return forward, backward


def main(repeats=30, calls=20):
    keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    kernels = {}
    for name, shape in {"fc1": (256, 1024), "fc2": (1024, 256)}.items():
        kernels[f"{name} forward"], kernels[f"{name} backward"] = projection_kernels(*shape, gen)
    times = {name: [] for name in kernels}
    with torch.no_grad():
        for _ in range(repeats):  # round-robin
            for name, fn in kernels.items():
                start = clock("cpu")
                for _ in range(calls):
                    fn()
                times[name].append((clock("cpu") - start) / calls)
    total = 0.0
    for name, values in times.items():
        median = statistics.median(values)
        total += median
        print(f"{name}: {1e3 * median:.2f} ms [{1e3 * min(values):.2f}-{1e3 * max(values):.2f}]")
    print(f"routing kernels of one routed FFN, fwd+bwd: {1e3 * total:.2f} ms of the benchmark clock")


if __name__ == "__main__":
    main()
