"""The routed MoE FFN of modules/moe.py on hand-computed examples and against a naive reference."""
import math

import pytest
import torch
import torch.nn.functional as F

from multipath_nmt.modules.moe import (
    FlatTokens,
    MoEFeedForward,
    TopKRouter,
    expert_capacity,
    expert_capacity_on_device,
)


def identity_router(num_experts, k, capacity_factor, noise=False):
    """A router whose logits are its input (embed_dim = E, f = identity)."""
    router = TopKRouter(num_experts, num_experts, k, capacity_factor, noise=noise)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
    return router.eval()


def test_flat_tokens_are_time_major_rows_with_their_padding_and_go_back():
    x = torch.arange(2 * 3 * 4.0).view(2, 3, 4)  # [T, B, d]
    padding_mask = torch.tensor([[False, False], [False, True], [True, True]])  # [B, T]
    tokens = FlatTokens.of(x, padding_mask)
    assert torch.equal(tokens.rows[4], x[1, 1])  # row t * B + b
    assert tokens.padding.tolist() == [False, False, True, False, True, True]
    assert tokens.valid.tolist() == [True, True, False, True, False, False]
    assert torch.equal(tokens.unflatten(tokens.rows), x)
    assert tokens.unflatten(tokens.padding).shape == (2, 3)  # per-token values, no feature dim
    assert tokens.unflatten(torch.zeros(6, 7)).shape == (2, 3, 7)  # another width
    flat = FlatTokens.of(x.view(6, 4), tokens.padding)  # [S, d] with [S]: as they are
    assert torch.equal(flat.rows, tokens.rows) and torch.equal(flat.padding, tokens.padding)
    assert FlatTokens.of(x).padding is None and FlatTokens.of(x).valid is None


@pytest.mark.parametrize("factor,k,tokens,experts,expected", [
    (1.2, 2, 10, 4, 6),  # 1.2 * 2 * 10 / 4 = 6 exactly: no float round-up to 7
    (1.2, 2, 7, 4, 5),  # ceil(4.2)
    (1.0, 1, 8, 4, 2),
    (1.25, 1, 3, 2, 2),  # ceil(1.875)
    (1.2, 2, 3, 2, 3),  # ceil(3.6) = 4, but an expert sees at most one assignment per token
    (1.2, 2, 0, 4, 0),
])
def test_capacity_arithmetic(factor, k, tokens, experts, expected):
    assert expert_capacity(factor, k, tokens, experts) == expected
    # the same integer arithmetic on a device tensor (the per-call limit: no host sync)
    assert expert_capacity_on_device(factor, k, torch.tensor(tokens), experts).item() == expected


def test_first_choices_beat_second_choices_then_token_order():
    # E=3, k=2, C=0.75, S=4: capacity ceil(0.75 * 2 * 4 / 3) = 2.
    logits = torch.tensor([[2.0, 3.0, 0.0],   # t0: 1 then 0
                           [2.0, 3.0, 0.0],   # t1: 1 then 0
                           [3.0, 2.0, 0.0],   # t2: 0 then 1
                           [3.0, 0.0, 2.0]])  # t3: 0 then 2
    routing = identity_router(3, 2, 0.75)(logits)
    assert routing.capacity == 2
    assert routing.expert_index.tolist() == [[1, 0], [1, 0], [0, 1], [0, 2]]
    # Expert 0 keeps the first choices of t2, t3 although t0, t1 come earlier as second choices;
    # expert 1 keeps t0, t1 (first choices) and drops t2's second choice; expert 2 keeps t3.
    kept = sorted((int(a) // 4, int(a) % 4, int(s)) for a, s in
                  zip(routing.assignment_index, routing.slot_index))
    # (rank, token, slot = expert * capacity + position)
    assert kept == [(0, 0, 2), (0, 1, 3), (0, 2, 0), (0, 3, 1), (1, 3, 4)]
    assert routing.stats.dropped_tokens.item() == 3
    assert routing.stats.routed_tokens.item() == 4
    assert routing.stats.expert_load.tolist() == [2.0, 2.0, 1.0]


def test_overflow_keeps_earliest_tokens():
    # E=2, k=1, C=1, S=4: capacity 2; every token prefers expert 0.
    logits = torch.tensor([[1.0, 0.0]] * 4)
    routing = identity_router(2, 1, 1.0)(logits)
    assert routing.capacity == 2
    assert sorted(routing.assignment_index.tolist()) == [0, 1]
    assert routing.stats.dropped_tokens.item() == 2
    assert routing.stats.expert_load.tolist() == [2.0, 0.0]


def test_balance_loss_hand_example_ignores_padding():
    ln3 = math.log(3.0)
    logits = torch.tensor([[ln3, 0.0], [0.0, ln3], [ln3, 0.0], [0.0, 50.0]], requires_grad=True)
    valid = torch.tensor([True, True, True, False])
    routing = identity_router(2, 1, 1.0)(logits, valid)
    # m = [2/3, 1/3]; P = [(0.75 + 0.25 + 0.75) / 3, (0.25 + 0.75 + 0.25) / 3]
    expected = 2 * (2 / 3 * 1.75 / 3 + 1 / 3 * 1.25 / 3)
    stats = routing.stats
    assert stats.balance_loss.dtype == torch.float32
    assert stats.balance_loss.item() == pytest.approx(expected, rel=1e-6)
    stats.balance_loss.backward()
    assert logits.grad[3].abs().sum().item() == 0.0  # padding takes no part
    assert stats.routed_tokens.item() == 3
    assert routing.capacity == 2  # ceil(1 * 1 * 3 / 2), from the 3 real tokens
    assert 3 not in routing.assignment_index.tolist()
    # a perfectly uniform router gives the minimum, 1
    uniform = identity_router(2, 1, 1.0)(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert uniform.stats.balance_loss.item() == pytest.approx(1.0)


@pytest.mark.parametrize("capacity_factor", [2.0, 0.5])  # m_i is counted before capacity
def test_balance_loss_counts_every_top_k_selection(capacity_factor):
    """WideNet Eq. 4 at K = 2: m_i is the fraction of tokens with expert i among their top 2."""
    probs = torch.tensor([[0.5, 0.3, 0.2],   # t0: experts 0, 1
                          [0.2, 0.5, 0.3],   # t1: experts 1, 2
                          [0.6, 0.3, 0.1],   # t2: experts 0, 1
                          [0.1, 0.1, 0.8]])  # padding
    valid = torch.tensor([True, True, True, False])
    routing = identity_router(3, 2, capacity_factor)(probs.log(), valid)
    # m = [2/3, 3/3, 1/3] (sums to K = 2); P = [1.3, 1.1, 0.6] / 3 over the 3 real tokens
    expected = 3 * (2 / 3 * 1.3 / 3 + 1 * 1.1 / 3 + 1 / 3 * 0.6 / 3)  # 6.5 / 3
    assert routing.stats.balance_loss.item() == pytest.approx(expected, rel=1e-6)
    assert expected != pytest.approx(3 * (2 / 3 * 1.3 / 3 + 1 / 3 * 1.1 / 3))  # first choices
    # a uniform router reaches the minimum, K
    uniform = identity_router(2, 2, 1.0)(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert uniform.stats.balance_loss.item() == pytest.approx(2.0)


def test_no_capacity_at_inference_unless_asked():
    """capacity_at_inference=False: in eval mode no assignment is dropped, so every token's
    output is its output alone; training and capacity_at_inference=True still drop."""
    torch.manual_seed(6)
    moe = MoEFeedForward(8, 16, num_experts=4, k=2, capacity_factor=0.3).eval()
    x = torch.randn(12, 8)
    assert moe.route(x).stats.dropped_tokens.item() > 0  # module default: as in training
    moe.router.capacity_at_inference = False
    routing = moe.route(x)
    assert routing.stats.dropped_tokens.item() == 0 and routing.capacity == 12
    together = moe(x)
    alone = torch.cat([moe(x[i:i + 1]) for i in range(12)])
    torch.testing.assert_close(together, alone)
    assert moe.train().route(x).stats.dropped_tokens.item() > 0


def test_capacity_buffer_comes_from_shapes_and_the_limit_from_real_tokens():
    """10 positions, 4 real tokens, E = 2, k = 1, C = 1: the buffer has ceil(10 / 2) = 5 slots
    per expert (no host read), each expert keeps at most ceil(4 / 2) = 2 tokens."""
    logits = torch.tensor([[1.0, 0.0]] * 10)  # everyone prefers expert 0
    valid = torch.tensor([True] * 4 + [False] * 6)
    routing = identity_router(2, 1, 1.0)(logits, valid)
    assert routing.capacity == 5
    assert routing.assignment_index.tolist() == [0, 1]
    assert routing.stats.dropped_tokens.item() == 2
    assert routing.stats.expert_load.tolist() == [2.0, 0.0]


def test_padding_is_never_routed_and_does_not_change_real_tokens():
    torch.manual_seed(1)
    moe = MoEFeedForward(8, 16, num_experts=4, k=2, capacity_factor=1.0).eval()
    x = torch.randn(5, 2, 8)
    padding_mask = torch.tensor([[False] * 5, [False, False, False, True, True]])  # [B, T]
    out = moe(x, padding_mask)
    assert out[3:, 1].abs().sum().item() == 0.0
    valid = ~padding_mask.t().reshape(-1)
    alone = moe(x.reshape(-1, 8)[valid])  # the same 8 real tokens, no padding at all
    torch.testing.assert_close(out.reshape(-1, 8)[valid], alone, rtol=0, atol=0)


def test_noise_off_in_eval_and_reproducible_in_train():
    torch.manual_seed(2)
    moe = MoEFeedForward(8, 16, num_experts=4, k=2)
    x = torch.randn(30, 8)
    moe.eval()
    first, second = moe.route(x), moe.route(x)
    assert torch.equal(first.gates, second.gates)
    clean = F.linear(x, moe.router.weight).softmax(-1).topk(2).values
    torch.testing.assert_close(first.gates, clean)
    moe.train()
    torch.manual_seed(7)
    noisy_a = moe.route(x).gates
    torch.manual_seed(7)
    noisy_b = moe.route(x).gates
    assert torch.equal(noisy_a, noisy_b)
    assert not torch.allclose(noisy_a, clean)


def test_noise_std_is_one_over_num_experts():
    # Zero router weights and k = E: log g = eps - logsumexp(eps), so centred log gates are
    # eps_i - mean(eps), whose variance is sigma^2 (1 - 1/E) with sigma = 1/E.
    experts, tokens = 4, 20000
    router = TopKRouter(3, experts, k=experts, capacity_factor=1.0).train()
    with torch.no_grad():
        router.weight.zero_()
    torch.manual_seed(123)
    log_gates = router(torch.randn(tokens, 3)).gates.log()
    centred = log_gates - log_gates.mean(dim=1, keepdim=True)
    variance = centred.pow(2).sum(1).mean() / experts
    expected = (1 / experts) ** 2 * (1 - 1 / experts)
    assert variance.item() == pytest.approx(expected, rel=0.03)


def naive_moe(moe, x, valid):
    """Per-token loop: priority rank then token, per-expert counters, per-expert nn.Linear math."""
    probs = F.linear(x.float(), moe.router.weight.float()).softmax(-1)
    gates, experts = probs.topk(moe.k, dim=-1)
    routed = int(valid.sum())
    capacity = expert_capacity(moe.router.capacity_factor, moe.k, routed, moe.num_experts)
    used = [0] * moe.num_experts
    rows = [torch.zeros(x.size(1)) for _ in range(x.size(0))]
    for rank in range(moe.k):
        for token in range(x.size(0)):
            expert = int(experts[token, rank])
            if not valid[token] or used[expert] >= capacity:
                continue
            used[expert] += 1
            hidden = F.relu(x[token] @ moe.fc1_weight[expert] + moe.fc1_bias[expert])
            rows[token] = rows[token] + gates[token, rank] * (
                hidden @ moe.fc2_weight[expert] + moe.fc2_bias[expert])
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 2])  # top-1 combines by scaling, top-2 by a weighted sum
def test_sort_dispatch_equals_naive_reference_outputs_and_gradients(k):
    torch.manual_seed(3)
    moe = MoEFeedForward(6, 10, num_experts=4, k=k, capacity_factor=0.8).eval()
    x = torch.randn(23, 6)
    valid = torch.rand(23) > 0.2
    routing = moe.route(x, ~valid)
    assert routing.stats.dropped_tokens.item() > 0  # the example exercises overflow
    # ... and empty slots, which hold copies of a token: they must reach no output or gradient
    assert (routing.stats.expert_load < routing.capacity).any()

    params = [x] + list(moe.parameters())
    x.requires_grad_(True)
    fast = moe(x, ~valid)
    grads_fast = torch.autograd.grad((fast * torch.arange(6.0)).sum(), params)
    slow = naive_moe(moe, x, valid)
    grads_slow = torch.autograd.grad((slow * torch.arange(6.0)).sum(), params)
    torch.testing.assert_close(fast, slow)
    for fast_grad, slow_grad in zip(grads_fast, grads_slow):
        torch.testing.assert_close(fast_grad, slow_grad)
    assert grads_fast[1].abs().sum() > 0  # the router weight learns through the gates


def test_router_is_fp32_under_bf16_autocast_and_fp16_weights():
    torch.manual_seed(4)
    moe = MoEFeedForward(8, 16, num_experts=4, k=2).eval()
    x = torch.randn(12, 8)
    reference = F.linear(x, moe.router.weight).softmax(-1).topk(2).values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = moe.route(x)
        out = moe(x, routing=routing)
    assert routing.gates.dtype == torch.float32
    torch.testing.assert_close(routing.gates, reference, rtol=0, atol=0)
    assert out.dtype == torch.bfloat16  # the experts do run in half precision

    half = moe.half()
    routing = half.route(x.half())
    expected = F.linear(x.half().float(), half.router.weight.float()).softmax(-1).topk(2).values
    assert routing.gates.dtype == torch.float32
    assert routing.stats.balance_loss.dtype == torch.float32
    torch.testing.assert_close(routing.gates, expected, rtol=0, atol=0)
    assert half(x.half()).dtype == torch.float16


def test_routing_reuse_and_statistics_protocol():
    torch.manual_seed(5)
    moe = MoEFeedForward(8, 16, num_experts=4, k=2).train()
    x = torch.randn(4, 3, 8)
    routing = moe.route(x)
    moe(x, routing=routing)
    moe(torch.randn(4, 3, 8), routing=routing)  # a later layer of the same WideNet group
    stats = moe.pop_routing_stats()
    assert len(stats) == 1 and stats[0].routed_tokens.item() == 12 and stats[0].top_k == 2
    assert stats[0].balance_loss.requires_grad
    assert moe.pop_routing_stats() == []
    with pytest.raises(ValueError, match="routing was computed for 12 tokens, got 10"):
        moe(torch.randn(5, 2, 8), routing=routing)
    moe.eval()
    moe(x)
    assert moe.pop_routing_stats() == []  # evaluation and generation never record


def test_inactive_parameters_and_config_errors():
    moe = MoEFeedForward(8, 16, num_experts=4, k=2)
    one_expert = 8 * 16 + 16 + 16 * 8 + 8
    assert moe.inactive_parameter_count() == 2 * one_expert
    assert sum(p.numel() for p in moe.parameters()) == 4 * one_expert + 4 * 8
    with pytest.raises(ValueError, match="top-k must be between 1 and the number of experts"):
        MoEFeedForward(8, 16, num_experts=2, k=3)
    with pytest.raises(ValueError, match="capacity factor must be positive"):
        MoEFeedForward(8, 16, capacity_factor=0)
    with pytest.raises(ValueError, match="number of experts must be at least 1"):
        MoEFeedForward(8, 16, num_experts=0, k=1)
