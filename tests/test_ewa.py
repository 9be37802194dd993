"""EWA: the update formula, schedule, random uniform partition, eval = mean-FFN dense layer, the
fp32-master-copy path of fairseq's FP16Optimizer, and training through fairseq-train."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.ewa import training as ewa_training
from multipath_nmt.modules.ewa import (EXPERT_TENSORS, EarlyEWAMoE, EWAFeedForward,
                                       EWASchedule, average_experts_, uniform_partition)
from conftest import TINY_MODEL, TRAIN_FLAGS, run_fairseq
from helpers.models import build_like_fairseq_train


def test_update_formula_on_hand_numbers():
    # E = 3, b = 0.3: W_i <- 0.7 W_i + 0.15 * (sum of the other two)
    stacked = torch.tensor([[1.0], [2.0], [6.0]])
    average_experts_(stacked, 0.3)
    assert torch.allclose(stacked, torch.tensor([[1.9], [2.45], [4.65]]))
    # the update keeps the experts' mean, i.e. the deployed FFN is unchanged by it
    assert stacked.sum().item() == pytest.approx(9.0)


def test_share_rate_that_collapses_all_experts():
    # b = (E-1)/E makes every expert the mean
    stacked = torch.randn(4, 3, 5)
    mean = stacked.mean(0)
    average_experts_(stacked, 0.75)
    assert torch.allclose(stacked, mean.expand_as(stacked), atol=1e-6)


def test_schedule_values():
    linear = EWASchedule(0.4, "linear", total_updates=100)
    assert [linear.share_rate_at(n) for n in (0, 25, 50, 100, 150)] == pytest.approx(
        [0.0, 0.1, 0.2, 0.4, 0.4])
    constant = EWASchedule(0.4, "constant")
    assert [constant.share_rate_at(n) for n in (1, 1000)] == [0.4, 0.4]
    early = EWASchedule(0.4, "linear", total_updates=100, stop_at=0.5)
    assert early.share_rate_at(50) == pytest.approx(0.2)
    assert early.share_rate_at(51) == 0.0
    with pytest.raises(ValueError, match="--max-update N, or --ewa-schedule constant"):
        EWASchedule(0.4, "linear").share_rate_at(1)
    with pytest.raises(ValueError, match="pass --max-update N [(]--max-epoch") as raised:
        EWASchedule(0.4, "constant", stop_at=0.5).share_rate_at(1)
    assert "ewa-schedule constant" not in str(raised.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(share_rate=1.5), "share rate must be in"),
    (dict(share_rate=-0.1), "share rate must be in"),
    (dict(share_rate=0.3, stop_at=1.2), "stop-at must be"),
    (dict(share_rate=0.3, schedule="cosine"), "unknown EWA schedule"),
])
def test_schedule_rejects_impossible_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EWASchedule(**kwargs)


def test_needs_two_experts():
    with pytest.raises(ValueError, match="at least 2 experts"):
        EWAFeedForward(4, 8, 1, EWASchedule(0.3, "constant"))


def test_partition_sizes_and_reproducibility():
    torch.manual_seed(3)
    order, expert, slot = uniform_partition(10, 4)
    assert sorted(order.tolist()) == list(range(10))
    assert torch.bincount(expert, minlength=4).tolist() == [3, 3, 2, 2]
    # slots within an expert are 0..size-1
    for e in range(4):
        assert sorted(slot[expert == e].tolist()) == list(range(int((expert == e).sum())))
    torch.manual_seed(3)
    assert torch.equal(uniform_partition(10, 4)[0], order)


def test_partition_is_uniform():
    torch.manual_seed(0)
    counts = torch.zeros(6, 3)
    draws = 3000
    for _ in range(draws):
        order, expert, _ = uniform_partition(6, 3)
        counts[order, expert] += 1
    # every token lands in every expert with probability 1/3
    assert (counts / draws - 1 / 3).abs().max() < 0.04


def _ffn(num_experts=4, embed=6, hidden=10):
    return EWAFeedForward(embed, hidden, num_experts, EWASchedule(0.3, "constant"))


def test_partition_deals_the_real_tokens_first_and_evenly():
    padding = torch.tensor([0, 1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    torch.manual_seed(5)
    order, expert, slot = uniform_partition(10, 4, padding)
    assert sorted(order.tolist()) == list(range(10))
    assert not padding[order[:7]].any() and padding[order[7:]].all()
    # the 7 real tokens: 2, 2, 2 and 1 per expert
    assert torch.bincount(expert[:7], minlength=4).tolist() == [2, 2, 2, 1]
    assert torch.equal(slot, torch.arange(10) // 4)


def test_partition_of_real_tokens_is_uniform():
    torch.manual_seed(0)
    padding = torch.tensor([1, 0, 0, 1, 0, 0, 0, 1], dtype=torch.bool)  # 5 real tokens
    counts = torch.zeros(8, 3)
    draws = 3000
    for _ in range(draws):
        order, expert, _ = uniform_partition(8, 3, padding)
        real = ~padding[order]
        counts[order[real], expert[real]] += 1
    assert (counts[padding] == 0).all()
    # each real token lands in each expert with probability 1/3 (experts 0, 1 hold 2, expert 2 1)
    assert (counts[~padding] / draws - torch.tensor([0.4, 0.4, 0.2])).abs().max() < 0.04


def test_training_forward_equals_per_group_reference():
    ffn = _ffn()
    x = torch.randn(5, 3, 6)  # [T, B, d]
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    padding[2, 1:] = True
    torch.manual_seed(7)
    out = ffn(x, padding)

    tokens = x.reshape(-1, 6)
    flat_padding = padding.t().reshape(-1)
    torch.manual_seed(7)
    order, expert, _ = uniform_partition(15, 4, flat_padding)
    expected = torch.zeros_like(tokens)
    for position, token in enumerate(order.tolist()):
        if flat_padding[token]:
            continue
        e = int(expert[position])
        hidden = F.relu(F.linear(tokens[token], ffn.fc1_weight[e], ffn.fc1_bias[e]))
        expected[token] = F.linear(hidden, ffn.fc2_weight[e], ffn.fc2_bias[e])
    assert torch.allclose(out.reshape(-1, 6), expected, atol=1e-6)
    assert (out.reshape(-1, 6)[flat_padding] == 0).all()


def test_padding_gets_no_gradient_and_changes_no_weight_gradient():
    ffn = _ffn()
    x = torch.randn(4, 2, 6, requires_grad=True)
    padding = torch.zeros(2, 4, dtype=torch.bool)
    padding[1, 2:] = True
    garbage = x.detach().clone()
    garbage[2:, 1] = 1e3
    garbage.requires_grad_()
    grads = []
    for inputs in (x, garbage):
        torch.manual_seed(3)
        ffn(inputs, padding).pow(2).sum().backward()
        grads.append([inputs.grad.clone(), *(p.grad.clone() for p in ffn.expert_parameters())])
        ffn.zero_grad()
    assert (grads[0][0][2:, 1] == 0).all()
    for clean, dirty in zip(*grads):
        assert torch.equal(clean, dirty)


def test_eval_is_the_dense_mean_ffn():
    ffn = _ffn().eval()
    fc1, fc2 = nn.Linear(6, 10), nn.Linear(10, 6)
    with torch.no_grad():
        fc1.weight.copy_(ffn.fc1_weight.mean(0))
        fc1.bias.copy_(ffn.fc1_bias.mean(0))
        fc2.weight.copy_(ffn.fc2_weight.mean(0))
        fc2.bias.copy_(ffn.fc2_bias.mean(0))
    x = torch.randn(5, 3, 6)
    dense = fc2(F.relu(fc1(x)))
    assert torch.equal(ffn(x, torch.zeros(3, 5, dtype=torch.bool)), dense)
    # the FFN is nonlinear: the folded FFN is not the mean of the experts' outputs
    outputs = torch.stack([F.linear(F.relu(F.linear(x, ffn.fc1_weight[e], ffn.fc1_bias[e])),
                                    ffn.fc2_weight[e], ffn.fc2_bias[e]) for e in range(4)])
    assert not torch.allclose(outputs.mean(0), dense, atol=1e-4)


def test_after_step_averages_module_weights_without_master_copies():
    ffn = _ffn()
    before = [p.detach().clone() for p in ffn.expert_parameters()]
    ffn.ewa_after_step(5, {})
    for old, new in zip(before, ffn.expert_parameters()):
        expected = old.clone()
        average_experts_(expected, 0.3)
        assert torch.equal(new, expected)


def test_early_ewa_moe_is_top1_and_averaged_only_until_the_stop_point():
    moe = EarlyEWAMoE(6, 10, 4, EWASchedule(0.3, "constant", total_updates=10, stop_at=0.5))
    assert moe.k == 1
    before = moe.fc2_weight.detach().clone()
    moe.ewa_after_step(6, {})  # after 0.5 * 10 updates: plain MoE
    assert torch.equal(moe.fc2_weight, before)
    moe.ewa_after_step(5, {})
    average_experts_(before, 0.3)
    assert torch.equal(moe.fc2_weight, before)


def _half_ffn_near_one():
    """Half-precision experts in [1.2, 2.0), 0.1 apart; one fp16 step there is 2^-10 or 2^-9."""
    torch.manual_seed(0)
    ffn = EWAFeedForward(4, 6, 4, EWASchedule(1e-3, "constant"))
    with torch.no_grad():
        for param in ffn.expert_parameters():
            offsets = 0.1 * torch.arange(4.0).view(-1, *[1] * (param.dim() - 1))
            param.copy_(torch.rand(param.shape[1:]) * 0.4 + 1.2 + offsets)
    return ffn.half()


def test_half_precision_averaging_follows_the_fp32_trajectory():
    """Share rate 1e-3 moves an expert by at most 2e-4 per update, under half an fp16 step: 50
    updates in place on the fp16 weights change nothing, while the module's fp32 copies make
    the weights follow the fp32 computation exactly, optimizer updates in between included."""
    ffn = _half_ffn_near_one()
    start = [p.detach().clone() for p in ffn.expert_parameters()]
    in_place = [t.clone() for t in start]
    reference = [t.float() for t in start]
    for update in range(1, 51):
        step = 2.0 ** -8 if update % 2 else -(2.0 ** -8)  # an update fp16 holds exactly here
        for param, ref in zip(ffn.expert_parameters(), reference):
            param.data.add_(step)
            ref.add_(step)
            average_experts_(ref, 1e-3)
        for stale in in_place:
            average_experts_(stale, 1e-3)
        ffn.ewa_after_step(update, {})
    assert all(torch.equal(stale, first) for stale, first in zip(in_place, start))
    for name, param, ref in zip(EXPERT_TENSORS, ffn.expert_parameters(), reference):
        assert torch.equal(ffn.fp32_experts[name], ref)
        assert torch.equal(param.data, ref.half())
        assert not torch.equal(param.data, start[EXPERT_TENSORS.index(name)])


def test_fp32_copies_travel_in_the_state_dict():
    ffn = _half_ffn_near_one()
    ffn.ewa_after_step(1, {})
    state = ffn.state_dict()
    assert {k for k in state if k.startswith("fp32_experts.")} == {
        f"fp32_experts.{name}" for name in EXPERT_TENSORS}
    assert all(state[f"fp32_experts.{name}"].dtype == torch.float32 for name in EXPERT_TENSORS)
    resumed = EWAFeedForward(4, 6, 4, EWASchedule(1e-3, "constant")).half()
    resumed.load_state_dict(state)  # strict: the copies are taken, not unexpected keys
    for name in EXPERT_TENSORS:
        assert torch.equal(resumed.fp32_experts[name], ffn.fp32_experts[name])
    # fp32 models never keep copies, so their state dicts are what they always were
    assert all("fp32_experts" not in k for k in _ffn().state_dict())
    # with the optimizer's fp32 masters (FP16Optimizer) the module's copies are dropped
    views = {p: p.detach().float() for p in ffn.expert_parameters()}
    ffn.ewa_after_step(2, views)
    assert ffn.fp32_experts == {}


def _training_args(*flags):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, ["data", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--ddp-backend", "fully_sharded"], "EWA does not support --ddp-backend fully_sharded"),
    (["--use-bmuf"], "EWA does not support --use-bmuf"),
])
@pytest.mark.parametrize("arch", ["ewa_transformer_wmt_en_de",
                                  "ewa_early_transformer_wmt_en_de"])
def test_refuses_fully_sharded_and_bmuf(arch, flags, message):
    from multipath_nmt.models.moe_transformer import check_args

    args = _training_args("--arch", arch, "--max-update", "10", *flags)
    with pytest.raises(ValueError, match=message):
        check_args(args)
    check_args(_training_args("--arch", arch, "--max-update", "10"))  # c10d: fine


def test_early_ewa_defaults_are_the_papers():
    args = _training_args("--arch", "ewa_early_transformer_wmt_en_de", "--max-update", "10")
    assert (args.encoder_ffn, args.ewa_stop_at, args.ewa_schedule, args.moe_capacity_factor,
            args.ewa_layers, args.ewa_experts) == ("ewa", 0.5, "constant", 1.05, "every-2", 4)
    assert args.ewa_share_rate == 0.3  # our choice within the paper's 0.1-0.5
    # the same from --ewa-stop-at on the EWA arch; plain EWA keeps the linear schedule
    args = _training_args("--arch", "ewa_transformer_wmt_en_de", "--ewa-stop-at", "0.5")
    assert (args.ewa_schedule, args.moe_capacity_factor) == ("constant", 1.05)
    args = _training_args("--arch", "ewa_transformer_wmt_en_de")
    assert (args.ewa_schedule, args.ewa_stop_at) == ("linear", None)
    # explicit flags win
    args = _training_args("--arch", "ewa_early_transformer_wmt_en_de", "--ewa-schedule",
                          "linear", "--moe-capacity-factor", "1.2", "--ewa-stop-at", "0.3")
    assert (args.ewa_schedule, args.moe_capacity_factor, args.ewa_stop_at) == ("linear", 1.2, 0.3)
    # the moe criterion's balance weight is early EWA's 0.01
    from multipath_nmt.criterions.label_smoothed_cross_entropy_with_moe import (
        LabelSmoothedCrossEntropyWithMoeCriterionConfig as Config)
    assert Config().moe_balance_weight == 0.01
    # ... which train.sh's recipe picks for the arch
    from multipath_nmt.recipe import criterion_for_arch

    assert criterion_for_arch("ewa_early_transformer_wmt_en_de") == (
        "label_smoothed_cross_entropy_with_moe")


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.ffn = _ffn()


def _fp16_optimizer(monkeypatch, flatten):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    parser = options.get_training_parser()
    flags = ["data", "--arch", "transformer", "--optimizer", "adam", "--lr", "0.01", "--fp16",
             "--fp16-init-scale", "1"]
    if not flatten:
        flags.append("--fp16-no-flatten-grads")
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, flags))
    # the flat master buffer is placed on torch.cuda.current_device(); on a CPU-only machine
    # key it by the CPU tensors' device index (None), which is what fairseq's syncs look up
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    model = _Model().half()
    params = list(model.parameters())
    return model, FP16Optimizer.build_optimizer(cfg, params)


@pytest.mark.parametrize("flatten", [True, False], ids=["flat-master", "per-param-master"])
def test_averaging_acts_on_fp16_optimizer_master_copies(monkeypatch, flatten):
    model, optimizer = _fp16_optimizer(monkeypatch, flatten)
    x = torch.randn(7, 2, 6).half()
    optimizer.backward(model.ffn(model.proj(x), None).float().pow(2).sum())
    optimizer.step()
    views = ewa_training.master_views(optimizer)
    assert set(views) == set(model.parameters())
    masters = [views[p].clone() for p in model.ffn.expert_parameters()]
    assert all(m.dtype == torch.float32 for m in masters)

    from multipath_nmt.host_syncs import HostSyncCounter

    with HostSyncCounter() as syncs:
        ewa_training.after_step(model, optimizer, num_updates=3)
    assert syncs.total == 0, syncs.by_op
    for param, old_master in zip(model.ffn.expert_parameters(), masters):
        expected = old_master.clone()
        average_experts_(expected, 0.3)
        assert torch.equal(views[param], expected)  # the optimizer's fp32 copy is averaged
        assert torch.equal(param.data, expected.half())
    # fairseq copies the masters into the fp16 model after every step: nothing is undone
    optimizer._sync_fp32_params_to_fp16()
    for param, old_master in zip(model.ffn.expert_parameters(), masters):
        expected = old_master.clone()
        average_experts_(expected, 0.3)
        assert torch.equal(param.data, expected.half())


def test_averaging_only_the_fp16_copy_would_be_undone(monkeypatch):
    """Why master copies matter: averaging the model's own fp16 weights is overwritten."""
    model, optimizer = _fp16_optimizer(monkeypatch, True)
    master = ewa_training.master_views(optimizer)[model.ffn.fc1_weight].clone()
    model.ffn.ewa_after_step(3, {})
    optimizer._sync_fp32_params_to_fp16()
    assert torch.equal(model.ffn.fc1_weight.data, master.half())


def test_hook_runs_only_on_real_steps():
    from fairseq.trainer import Trainer

    from multipath_nmt.fairseq_patches import ewa_trainer

    ewa_trainer.install()
    ewa_trainer.install()  # idempotent
    calls = []
    module = SimpleNamespace(ewa_after_step=lambda n, views: calls.append(n))
    fake = SimpleNamespace(_num_updates=0, quantizer=None, lr_step_update=lambda: None,
                           optimizer=object(),
                           model=SimpleNamespace(modules=lambda: [module]))
    fake.get_num_updates = lambda: fake._num_updates
    Trainer.set_num_updates(fake, 1)  # checkpoint load (outside train_step): no averaging
    fake._ewa_in_train_step = True
    Trainer.set_num_updates(fake, 2)  # an optimizer step
    Trainer.set_num_updates(fake, 7)  # not a single step
    assert calls == [2]


def _collapsed(stacked):
    return torch.equal(stacked, stacked[:1].expand_as(stacked))


@pytest.mark.slow
def test_fairseq_train_averages_after_every_update_in_half_precision(toy_data_bin, tmp_path):
    from fairseq import checkpoint_utils

    # b = (E-1)/E: after every real update all experts equal their mean
    run_fairseq("train", toy_data_bin, "--arch", "ewa_transformer_wmt_en_de", *TINY_MODEL,
                *TRAIN_FLAGS, "--ewa-experts", "4", "--ewa-share-rate", "0.75",
                "--ewa-schedule", "constant", "--memory-efficient-fp16", "--max-update", "3",
                "--save-dir", tmp_path / "ck", "--no-epoch-checkpoints")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "ck" / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 3
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        stacked = state["model"][f"encoder.layers.1.ffn.{name}"]
        assert stacked.shape[0] == 4
        assert _collapsed(stacked), name
    assert "encoder.layers.0.fc1.weight" in state["model"]  # every-2: layer 0 stays dense


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--arch", "ewa_transformer_wmt_en_de", "--ewa-schedule", "constant", "--ewa-stop-at", "0.5"],
    # the paper's early-EWA defaults, with its balance loss
    ["--arch", "ewa_early_transformer_wmt_en_de", "--criterion",
     "label_smoothed_cross_entropy_with_moe"],
], ids=["flags", "arch"])
def test_early_ewa_averages_a_routed_moe_until_the_stop_point(toy_data_bin, tmp_path, flags):
    from fairseq import checkpoint_utils

    run_fairseq("train", toy_data_bin, *TINY_MODEL, *TRAIN_FLAGS, *flags,
                "--ewa-share-rate", "0.75", "--max-update", "4", "--save-interval-updates", "2",
                "--save-dir", tmp_path / "ck", "--no-epoch-checkpoints")
    at_2 = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "ck" / "checkpoint_1_2.pt"))
    last = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "ck" / "checkpoint_last.pt"))
    assert "encoder.layers.1.ffn.router.weight" in last["model"]  # a learned top-1 router
    assert _collapsed(at_2["model"]["encoder.layers.1.ffn.fc1_weight"])  # averaged until 2 = 0.5*4
    assert not _collapsed(last["model"]["encoder.layers.1.ffn.fc1_weight"])  # then a plain MoE


def test_ewa_inactive_parameters_are_all_but_one_expert():
    ffn = _ffn(num_experts=4, embed=6, hidden=10)
    assert ffn.inactive_parameter_count() == 3 * (10 * 6 + 10 + 6 * 10 + 6)


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--memory-efficient-fp16"]], ids=["fp32", "fp16"])
def test_resume_is_bit_exact(toy_data_bin, tmp_path, precision):
    """The partition reseeds with fairseq's per-update seed and the schedule depends only on the
    restored update count; loading a checkpoint must not run an extra averaging. In fp16 without
    optimizer masters, the experts' fp32 copies come back from the checkpoint."""
    import shutil

    from fairseq import checkpoint_utils

    def train(save_dir):
        return run_fairseq("train", toy_data_bin, "--arch", "ewa_transformer_wmt_en_de", *TINY_MODEL,
                    *TRAIN_FLAGS, "--ewa-share-rate", "0.5", "--max-update", "4",
                    "--save-interval-updates", "2", "--save-dir", save_dir,
                    "--no-epoch-checkpoints", *precision)

    train(tmp_path / "straight")
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "straight" / "checkpoint_1_2.pt",
                tmp_path / "resumed" / "checkpoint_last.pt")
    log = train(tmp_path / "resumed")
    assert "(epoch 1 @ 2 updates)" in log.stdout + log.stderr  # really resumed mid-epoch
    straight, resumed = (checkpoint_utils.load_checkpoint_to_cpu(
        str(tmp_path / run / "checkpoint_last.pt"))["model"] for run in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    copies = {k for k in straight if ".ffn.fp32_experts." in k}
    assert len(copies) == (4 if precision else 0)


def test_training_step_and_averaging_make_no_host_sync():
    from multipath_nmt.host_syncs import HostSyncCounter

    ffn = _ffn()
    x = torch.randn(7, 3, 6, requires_grad=True)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 4:] = True
    with HostSyncCounter() as syncs:
        ffn(x, padding).sum().backward()
        ffn.ewa_after_step(3, {})
        half = _half_ffn_near_one()
        half.ewa_after_step(1, {})
        half.ewa_after_step(2, {})  # the fp32 copies taking the parameters' changes
    assert syncs.total == 0, syncs.by_op


@pytest.mark.parametrize("flags, message", [
    (["--ewa-share-rate", "1.5"], "share rate must be in"),
    (["--ewa-experts", "1"], "--ewa-experts must be at least 2"),
    (["--ewa-stop-at", "-0.5"], "stop-at must be"),
])
def test_impossible_ewa_settings_fail_at_build_time(toy_data_bin, flags, message):
    with pytest.raises(ValueError, match=message):
        build_like_fairseq_train(toy_data_bin, "ewa_transformer_wmt_en_de", *TINY_MODEL, *flags)


@pytest.mark.parametrize("flags, message", [
    # early EWA's stop point is a fraction of --max-update, whatever the schedule: constant does
    # not help, and the message must not suggest it
    (["--arch", "ewa_early_transformer_wmt_en_de", "--ewa-schedule", "constant"],
     "--ewa-stop-at 0.5 stops averaging at a fraction of --max-update: pass --max-update N"),
    (["--arch", "ewa_early_transformer_wmt_en_de"], "pass --max-update N"),
    (["--arch", "ewa_transformer_wmt_en_de"],
     "rises over --max-update: pass --max-update N, or --ewa-schedule constant"),
], ids=["early-constant", "early", "linear"])
def test_fairseq_train_refuses_ewa_without_max_update_before_the_first_update(
        toy_data_bin, tmp_path, flags, message):
    # train.sh gives --max-epoch 20 when no length is given: a stop point, but no --max-update
    proc = run_fairseq("train", toy_data_bin, *TINY_MODEL, *TRAIN_FLAGS, *flags,
                       "--criterion", "label_smoothed_cross_entropy_with_moe", "--max-epoch", "2",
                       "--save-dir", tmp_path / "ck", check=False)
    assert proc.returncode != 0
    assert message in proc.stderr.strip().splitlines()[-1]
    assert "num_updates" not in proc.stdout + proc.stderr  # refused before any update
    assert not (tmp_path / "ck" / "checkpoint_last.pt").exists()


def test_ewa_without_a_stop_point_still_builds_for_tools_that_do_not_train():
    # multipath-params (and configs read back) set neither --max-epoch nor --max-update
    from multipath_nmt import params

    for arch in ("ewa_early_transformer_wmt_en_de", "ewa_transformer_wmt_en_de"):
        params.build_model(arch, 100)


def test_unknown_layer_pattern_fails_at_build_time():
    from argparse import Namespace

    from multipath_nmt.models.moe_transformer import check_args

    args = Namespace(encoder_ffn="ewa", ewa_experts=4, ewa_layers="odd", encoder_layers=6,
                     ewa_share_rate=0.3, ewa_schedule="linear", max_update=10, ewa_stop_at=None,
                     ewa_init_from=None)
    with pytest.raises(ValueError, match="unknown --ewa-layers pattern 'odd'"):
        check_args(args)
