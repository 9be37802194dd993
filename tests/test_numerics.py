"""Numerical safety: half-precision forward passes with large activations stay finite and close
to fp32 (PathNorm and router statistics run in fp32), and a NaN/Inf during training stops the
run with the update number (multipath_nmt.fairseq_patches.numerics), also in CPU fp16 runs."""
import copy

import pytest
import torch

from conftest import TINY_MODEL, TRAIN_FLAGS, run_fairseq
from helpers.training import SMALL_BATCHES, train_command, train_to_its_end

from multipath_nmt.modules.moe import MoEFeedForward
from multipath_nmt.modules.multipath import MultiPathEncoderLayer


def relative_error(actual, expected):
    return ((actual.float() - expected).norm() / expected.norm()).item()


def multipath_layer_with_large_paths():
    """3 paths with cheap features; FFN paths scaled so their outputs reach ~1e3: the squares
    PathNorm's variance sums (~1e6) are far beyond fp16's 65504."""
    layer = MultiPathEncoderLayer(embed_dim=32, ffn_dim=64, num_heads=4, num_paths=3,
                                  cheap_features=True).eval()
    with torch.no_grad():
        layer.ffn.fc2_weight.mul_(3e3)
    return layer


def large_input(scale):
    return torch.randn(7, 3, 32) * scale  # [T, B, d], activations of size ~scale


@pytest.mark.parametrize("scale", [1e3, 1e4])
def test_multipath_layer_bf16_autocast_large_activations(scale):
    layer, x = multipath_layer_with_large_paths(), large_input(scale)
    with torch.no_grad():
        expected = layer(x)
        ffn_paths = layer.ffn(layer.final_layer_norm(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            actual = layer(x)
    assert ffn_paths.pow(2).mean(-1).max() > 65504  # the variance would overflow in fp16
    assert torch.isfinite(actual).all()
    assert relative_error(actual, expected) < 2e-2  # bf16 keeps 8 bits of mantissa


def test_multipath_layer_half_large_activations():
    layer = multipath_layer_with_large_paths()
    with torch.no_grad():
        half, x = layer.half(), large_input(1e3).half()
        reference = copy.deepcopy(half).float()  # the same (fp16-rounded) weights in fp32
        actual = half(x)
        expected = reference(x.float())
        paths = reference.ffn(reference.final_layer_norm(x.float()))
    assert paths.pow(2).mean(-1).max() > 65504
    assert actual.dtype == torch.float16 and torch.isfinite(actual).all()
    assert relative_error(actual, expected) < 5e-3


def moe_with_stats():
    """Training mode, where routing statistics are recorded (router noise reseeded per call)."""
    return MoEFeedForward(embed_dim=32, ffn_dim=64, num_experts=4, k=2).train()


def seeded(module, x):
    torch.manual_seed(1)
    return module(x)


def test_moe_router_bf16_autocast_large_activations():
    """Router logits of ~1e4: a half-precision softmax would overflow; routing is computed in
    fp32 from the same input, so the decisions are those of the fp32 model."""
    moe, x = moe_with_stats(), large_input(1e4)
    with torch.no_grad():
        expected = seeded(moe, x)
        expected_stats = moe.pop_routing_stats()[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            actual = seeded(moe, x)
        stats = moe.pop_routing_stats()[0]
    assert torch.isfinite(actual).all()
    assert relative_error(actual, expected) < 2e-2
    assert torch.equal(stats.expert_load, expected_stats.expert_load)
    assert stats.balance_loss.dtype == torch.float32
    assert torch.equal(stats.balance_loss, expected_stats.balance_loss)


def test_moe_router_half_large_activations():
    moe = moe_with_stats().half()
    reference = copy.deepcopy(moe).float()
    x = large_input(1e4).half()
    with torch.no_grad():
        actual = seeded(moe, x)
        stats = moe.pop_routing_stats()[0]
        expected = seeded(reference, x.float())
        expected_stats = reference.pop_routing_stats()[0]
    assert actual.dtype == torch.float16 and torch.isfinite(actual).all()
    assert relative_error(actual, expected) < 5e-3
    assert torch.equal(stats.expert_load, expected_stats.expert_load)
    assert stats.balance_loss.dtype == torch.float32 and torch.isfinite(stats.balance_loss)


# --- training runs --------------------------------------------------------------------------

DIVERGES = [*SMALL_BATCHES, "--lr", "1e10", "--lr-scheduler", "fixed", "--max-update", "20"]
RUNS = {
    # Adam with lr 1e10: update 1 succeeds and blows the weights up, update 2 is NaN/Inf.
    "fp32": DIVERGES,
    # fp16 on CPU: every update overflows; the loss scale halves 128 -> 1, then fairseq gives up.
    "fp16": [*DIVERGES, "--memory-efficient-fp16", "--min-loss-scale", "1"],
    # A healthy fp16 run that starts with a loss scale so large that the first updates overflow.
    "fp16_overflow": [*SMALL_BATCHES, "--memory-efficient-fp16", "--fp16-init-scale", str(2 ** 30),
                      "--max-update", "4"],
}


@pytest.fixture(scope="module")
def runs(trains, toy_data_bin, tmp_path_factory):
    def start(name):
        save = tmp_path_factory.mktemp(name)
        cmd = train_command(toy_data_bin, save, "baseline", *RUNS[name])
        proc = train_to_its_end(cmd)
        return proc.returncode, proc.stdout + proc.stderr, save

    return {name: start(name) for name in RUNS}


@pytest.mark.slow
def test_nan_loss_stops_training_with_the_update_number(runs):
    returncode, output, save = runs["fp32"]
    assert returncode == 1
    assert "num_updates=1," in output and "num_updates=2," not in output
    assert ("NonFiniteLossError: non-finite loss or gradients at update 2: "
            "gradients are Nan/Inf. The model before this update is in") in output
    assert (save / "crash.pt").exists()
    assert "StopIteration" not in output.splitlines()[-1]


@pytest.mark.slow
def test_fp16_nan_loss_stops_training_with_the_update_number(runs):
    returncode, output, _ = runs["fp16"]
    assert returncode == 1
    # 128 -> 2 in six skipped updates; the seventh overflow would reach --min-loss-scale 1.
    assert output.count("gradient overflow detected") == 6
    assert ("NonFiniteLossError: non-finite loss or gradients at update 2: "
            "Minimum loss scale reached (1.0)") in output


@pytest.mark.slow
def test_cpu_fp16_overflow_skips_the_update_instead_of_crashing(runs):
    returncode, output, save = runs["fp16_overflow"]
    assert returncode == 0, output[-3000:]
    assert "gradient overflow detected, ignoring gradient" in output
    assert "Torch not compiled with CUDA" not in output
    assert "num_updates=4," in output


@pytest.mark.slow
def test_fp16_without_cuda_is_refused_with_a_clear_message(toy_data_bin, tmp_path):
    proc = run_fairseq("train", toy_data_bin, "--arch", "transformer_prenorm_wmt_en_de",
                       *TINY_MODEL, *TRAIN_FLAGS, "--fp16", "--max-update", "1",
                       "--save-dir", tmp_path / "ck", check=False)
    assert proc.returncode != 0
    assert "--fp16 needs a CUDA GPU and none is available: drop --fp16" in proc.stderr
    assert "Torch not compiled with CUDA enabled" not in proc.stderr
    assert not (tmp_path / "ck" / "checkpoint_last.pt").exists()
