"""Mixed precision through fairseq's own optimizer wrappers, checked update by update against
plain fp32 Adam on the CPU (``multipath_nmt/fairseq_patches/mixed_precision.py``): ``--amp``
with a CPU ``GradScaler`` standing in for the CUDA one, ``--fp16`` with its flat fp32 master,
``--memory-efficient-fp16``, and bfloat16 (``--amp --bf16`` autocast, fairseq's ``--bf16``).
Also: a non-finite gradient without loss scaling stops as in fp32, a resumed fp16 ``--amp``
run keeps its loss scale, the loss scaler takes ``--amp``'s flags, and ``--amp-batch-retries`` is
a budget per batch."""
import contextlib
import copy
import logging
import re
import sys

import pytest
import torch

import multipath_nmt  # noqa: F401  (registers adam_fused, installs the patches)
from helpers.optimizers import build_wrapped
from conftest import ROOT
from helpers.training import (SMALL_BATCHES, assert_same_tensors, load_model_state, run,
                              train_command, train_to_its_end)
from multipath_nmt.benchmark.batches import fake_data_dir, padded_batches
from multipath_nmt.benchmark.systems import build_trainer_from_argv
from multipath_nmt.fairseq_patches.mixed_precision import SCALER_STATE

SCALE = 128.0
TRAIN_LOSS = re.compile(r"\d+ / \d+ loss=([0-9.]+),")  # train_inner lines, --log-format simple


def fp32_adam_update(optimizer_name, start, grad):
    """The parameters after one step of the plain fp32 optimizer (no wrapper) on ``grad``."""
    p = torch.nn.Parameter(start.clone())
    optimizer = build_wrapped(optimizer_name, "fp32", [p])
    p.grad = grad.clone()
    optimizer.step()
    return p.detach()


def scaled_step(optimizer, params, grad_of_loss):
    """What fairseq's Trainer does: scaled backward, clip_grad_norm (which unscales), step."""
    optimizer.zero_grad()
    optimizer.backward(sum((p.float() * g).sum() for p, g in zip(params, grad_of_loss)))
    grad_norm = optimizer.clip_grad_norm(0.0)
    optimizer.step()
    return grad_norm


@pytest.mark.parametrize("optimizer_name", ["adam", "adam_fused"])
@pytest.mark.parametrize("grad", [1e-5, 1e-7, 3e-2])
def test_amp_update_is_fp32_adams(optimizer_name, grad):
    """fairseq 0.12's AMPOptimizer unscaled every gradient twice: at g = 1e-5 and a scale of 128
    Adam moved the weights by 3.0e-4 instead of 1.0e-3 (lr 1e-3), as if eps were 128 x eps."""
    start = torch.tensor([0.5, -0.25, 1.0])
    grads = torch.full((3,), grad)
    p = torch.nn.Parameter(start.clone())
    optimizer = build_wrapped(optimizer_name, "amp", [p])
    optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    grad_norm = scaled_step(optimizer, [p], [grads])
    torch.testing.assert_close(grad_norm, grads.norm())
    torch.testing.assert_close(p.grad, grads, rtol=1e-6, atol=0)  # unscaled once
    torch.testing.assert_close(p.detach(), fp32_adam_update(optimizer_name, start, grads),
                               rtol=1e-6, atol=1e-9)
    assert optimizer.scaler.get_scale() == SCALE


def test_amp_overflow_skips_the_update_and_halves_the_scale():
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = build_wrapped("adam_fused", "amp", [p])
    optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    grad_norm = scaled_step(optimizer, [p], [torch.tensor([float("inf"), 1.0])])
    assert not torch.isfinite(grad_norm)
    assert torch.equal(p.detach(), torch.ones(2))
    assert optimizer.scaler.get_scale() == SCALE / 2


@pytest.mark.parametrize("wrapper", ["fp16", "fp16-flat", "memory-efficient-fp16"])
def test_fp16_wrappers_with_adam_fused_update_like_fp32_adam(wrapper, monkeypatch):
    """fp16 weights, gradients exact in fp16 at the loss scale: the fp32 master (flat or per
    tensor) moves exactly as fp32 Adam; memory-efficient fp16 rounds that update to fp16."""
    # fairseq keys the flat master by torch.cuda.current_device() and looks the parameters up
    # by p.device.index: None on the CPU, where CUDA's current device would be
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    starts = [torch.tensor([0.5, -0.25, 1.0]), torch.tensor([[2.0, -1.5], [0.125, 4.0]])]
    grads = [torch.tensor([1e-5, -3e-3, 0.25]).half().float(),
             torch.tensor([[1e-4, 2e-2], [-5e-1, 7e-6]]).half().float()]
    params = [torch.nn.Parameter(s.half()) for s in starts]
    optimizer = build_wrapped("adam_fused", wrapper, params)
    scaled_step(optimizer, params, grads)
    expected = [fp32_adam_update("adam", s, g) for s, g in zip(starts, grads)]
    if wrapper == "memory-efficient-fp16":
        updated = [p.detach() for p in params]
        expected = [e.half() for e in expected]
    elif wrapper == "fp16-flat":
        flat = optimizer.fp32_params[None].detach()
        updated = list(flat.split([s.numel() for s in starts]))
        expected = [e.view(-1) for e in expected]
        assert flat.dtype == torch.float32
    else:
        updated = [p32.detach() for p32 in optimizer.fp32_params]
    for u, e in zip(updated, expected):
        torch.testing.assert_close(u, e, rtol=1e-6, atol=0)


def test_amp_bf16_has_no_loss_scaler_and_records_its_dtype():
    p = torch.nn.Parameter(torch.tensor([0.5, -0.25]))
    optimizer = build_wrapped("adam_fused", "amp-bf16", [p])
    assert not optimizer.scaler.is_enabled()
    assert optimizer.autocast_dtype is torch.bfloat16
    grads = torch.tensor([1e-7, 2e-3])
    scaled_step(optimizer, [p], [grads])
    torch.testing.assert_close(p.detach(), fp32_adam_update("adam_fused", torch.tensor(
        [0.5, -0.25]), grads), rtol=1e-6, atol=0)
    assert build_wrapped("adam_fused", "amp", [p]).autocast_dtype is torch.float16


def test_bf16_means_a_tpu_only_where_torch_xla_is_installed():
    from fairseq import options

    def parsed(*flags):
        return options.parse_args_and_arch(options.get_training_parser(), [
            "data", "--arch", "transformer", *flags])

    assert parsed("--bf16").tpu is False
    assert parsed("--bf16", "--tpu").tpu is True
    assert parsed("--memory-efficient-bf16").tpu is False


def test_amp_bf16_runs_the_criterion_under_bf16_autocast_with_fp32_weights():
    """fairseq's train_step autocasts only CUDA, and to float16; with --amp --bf16 the forward
    pass runs under bfloat16 autocast on the device of the model (here the CPU)."""
    from fairseq.tasks.fairseq_task import FairseqTask

    model = torch.nn.Linear(4, 3)
    model.set_num_updates = lambda num_updates: None  # what FairseqTask.train_step calls
    seen = {}

    def criterion(model, sample):
        out = model(sample)
        seen.update(autocast=torch.is_autocast_enabled("cpu"), dtype=out.dtype,
                    weight=model.weight.dtype)
        return out.float().sum(), 1, {}

    for wrapper, expected in (("amp-bf16", torch.bfloat16), ("amp", torch.float32)):
        optimizer = build_wrapped("adam_fused", wrapper, list(model.parameters()))
        FairseqTask.train_step(object.__new__(FairseqTask), torch.ones(2, 4), model, criterion,
                               optimizer, update_num=0)
        assert (seen["dtype"], seen["weight"]) == (expected, torch.float32), wrapper
        assert model.weight.grad.dtype == torch.float32
        model.zero_grad()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_checkpointed_layers_recompute_under_the_forward_autocast(dtype):
    """--checkpoint-activations: the backward pass recomputes the layer; without the forward's
    autocast it recomputed in fp32 and the gradients were those of another function."""
    from fairseq.modules.checkpoint_activations import checkpoint_wrapper

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    checkpointed = checkpoint_wrapper(copy.deepcopy(layer))  # wraps the module it is given
    x = torch.randn(5, 8)
    grads = []
    for module in (layer, checkpointed):
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            out = module(inputs)
        out.float().square().sum().backward()
        grads.append([inputs.grad, *(p.grad for p in module.parameters())])
    for plain, recomputed in zip(*grads):
        assert torch.equal(plain, recomputed)


@pytest.mark.slow
def test_fairseq_train_in_bf16_on_the_cpu(toy_data_bin, tmp_path):
    """Both bfloat16 modes train a multi-path model through fairseq-train with the plug-in and
    come within a few percent of fp32's loss over the same 30 updates (same seed and batches).
    The checkpoints hold fp32 weights (fairseq saves the bf16 model of --bf16 as fp32)."""
    losses = {}
    for name, precision in (("fp32", []), ("amp-bf16", ["--amp", "--bf16"]),
                            ("bf16", ["--bf16"])):
        save = tmp_path / name
        output = run(train_command(toy_data_bin, save, "multipath", "--optimizer", "adam_fused",
                                   "--max-update", "30", "--no-epoch-checkpoints", *precision))
        losses[name] = [float(m) for m in TRAIN_LOSS.findall(output)]
        state, updates = load_model_state(save / "checkpoint_last.pt")
        assert updates == 30 and len(losses[name]) == 30
        assert {p.dtype for p in state.values() if p.is_floating_point()} == {torch.float32}
    print({name: (round(loss[0], 3), round(loss[-1], 3)) for name, loss in losses.items()})
    assert losses["fp32"][-1] < 0.9 * losses["fp32"][0]
    for name in ("amp-bf16", "bf16"):
        assert abs(losses[name][-1] - losses["fp32"][-1]) < 0.03 * losses["fp32"][-1], name


# --- a non-finite gradient without loss scaling -------------------------------------------------

def amp_without_a_scaler(wrapper, params):
    """AMPOptimizer as --amp --bf16 builds it, or as --amp on a machine without CUDA (fairseq's
    CUDA GradScaler disables itself there; the same disabled scaler on any machine)."""
    optimizer = build_wrapped("adam", wrapper, params)
    if wrapper == "amp":
        optimizer._grad_scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert not optimizer.scaler.is_enabled()
    return optimizer


@pytest.mark.parametrize("wrapper", ["amp-bf16", "amp"])
def test_amp_without_a_scaler_stops_at_a_non_finite_gradient_as_fp32_does(wrapper):
    """fairseq treated the NaN/Inf as an fp16 overflow and asked the disabled scaler for a lower
    scale: AttributeError '_backoff_factor'. Now clip_grad_norm raises fairseq's fp32 error
    inside the trainer's train_step (fp32's path: crash.pt, the update named), and nothing
    steps: the weights and Adam's state are untouched."""
    start = torch.tensor([0.5, -0.25, 1.0])
    p = torch.nn.Parameter(start.clone())
    optimizer = amp_without_a_scaler(wrapper, [p])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(FloatingPointError, match=r"^gradients are Nan/Inf$"):
            scaled_step(optimizer, [p], [torch.tensor([bad, 1e-3, 2e-3])])
        assert torch.equal(p.detach(), start)
        assert not optimizer.optimizer.state  # Adam never stepped


@pytest.mark.parametrize("wrapper", ["amp-bf16", "amp"])
@pytest.mark.parametrize("clip_norm", [0.0, 1e-3])
def test_amp_without_a_scaler_steps_on_finite_gradients_as_fp32_does(wrapper, clip_norm):
    """Finite gradients: the same norm, the same clipping and the same update, to the bit, as
    the fp32 optimizer (what fairseq's clip_grad_norm did before, through a no-op unscale_)."""
    start, grads = torch.tensor([0.5, -0.25, 1.0]), torch.tensor([1e-5, -3e-3, 2.5e-1])
    results = []
    for name in ("fp32", wrapper):
        p = torch.nn.Parameter(start.clone())
        optimizer = (build_wrapped("adam", "fp32", [p]) if name == "fp32"
                     else amp_without_a_scaler(wrapper, [p]))
        norms = []
        for _ in range(3):
            optimizer.zero_grad()
            optimizer.backward((p * grads).sum())
            norms.append(optimizer.clip_grad_norm(clip_norm))
            optimizer.step()
        results.append((torch.stack(norms), p.detach().clone()))
    (fp32_norms, fp32_p), (amp_norms, amp_p) = results
    assert torch.equal(amp_norms, fp32_norms) and torch.equal(amp_p, fp32_p)
    assert not torch.equal(amp_p, start)


DIVERGES = [*SMALL_BATCHES, "--lr", "1e10", "--lr-scheduler", "fixed", "--max-update", "20"]
NON_FINITE = re.compile(r"^\S*NonFiniteLossError: (.*)$", re.M)


@pytest.mark.slow
def test_fairseq_train_amp_bf16_stops_at_a_non_finite_gradient_as_fp32_does(toy_data_bin,
                                                                              tmp_path):
    """Adam at lr 1e10: update 1 blows the weights up, update 2's gradients are NaN/Inf. fp32
    stops there with one error naming update 2 and saves crash.pt before any step; --amp
    --bf16 (and CPU --amp, whose CUDA scaler is disabled) now do exactly the same, where they
    crashed with an AttributeError and no update number."""
    errors = {}
    for name, precision in (("fp32", []), ("amp-bf16", ["--amp", "--bf16"]),
                            ("amp-cpu", ["--amp"])):
        save = tmp_path / name
        proc = train_to_its_end(train_command(toy_data_bin, save, "baseline", *DIVERGES, *precision))
        proc.stdout += proc.stderr
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert "AttributeError" not in proc.stdout
        assert "num_updates=1," in proc.stdout and "num_updates=2," not in proc.stdout, name
        errors[name] = NON_FINITE.findall(proc.stdout.replace(str(save), "SAVE"))
        crash, updates = load_model_state(save / "crash.pt")  # saved before update 2's step
        assert updates == 1
        assert all(torch.isfinite(t).all() for t in crash.values() if t.is_floating_point())
    assert errors["fp32"][0].startswith("non-finite loss or gradients at update 2: gradients "
                                        "are Nan/Inf. The model before this update is in "
                                        "SAVE/crash.pt")
    assert errors["amp-bf16"] == errors["amp-cpu"] == errors["fp32"]


# --- the fp16 AMP loss scale across a resume -----------------------------------------------------

def amp_with_a_cpu_scaler(params, growth_interval=2):
    optimizer = build_wrapped("adam", "amp", params)
    optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE,
                                                  growth_interval=growth_interval)
    return optimizer


def test_amp_optimizer_state_holds_the_loss_scaler_state():
    """fairseq saved --fp16's loss scale (FP16Optimizer) but not --amp's: a resume started again
    at 128 with a fresh growth count. The state dict now holds the scaler's state, the torch
    optimizer still gets exactly its own state dict, and the scaler's flags stay the command
    line's."""
    p = torch.nn.Parameter(torch.tensor([0.5, -0.25]))
    optimizer = amp_with_a_cpu_scaler([p])
    for _ in range(3):  # 128 -> 256 after two clean steps, then one more: tracker at 1
        scaled_step(optimizer, [p], [torch.tensor([1e-3, -2e-3])])
    state = optimizer.state_dict()
    assert state[SCALER_STATE] == optimizer.scaler.state_dict()
    assert (state[SCALER_STATE]["scale"], state[SCALER_STATE]["_growth_tracker"]) == (256.0, 1)

    resumed = amp_with_a_cpu_scaler([torch.nn.Parameter(torch.zeros(2))], growth_interval=5)
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.scaler.state_dict() == {**state[SCALER_STATE], "growth_interval": 5}
    torch_state = {k: v for k, v in state.items() if k != SCALER_STATE}
    assert str(resumed.optimizer.state_dict()) == str(torch_state)


def test_a_checkpoint_without_the_scaler_state_loads_with_fairseqs_initial_scale():
    """Checkpoints saved before this patch (or by a bf16 run) have no scaler state: the Adam
    state loads, the scale is fairseq's initial one. A bf16 optimizer (disabled scaler) saves
    none and ignores one it is given."""
    p = torch.nn.Parameter(torch.tensor([0.5, -0.25]))
    optimizer = amp_with_a_cpu_scaler([p])
    for _ in range(2):
        scaled_step(optimizer, [p], [torch.tensor([1e-3, -2e-3])])
    state = optimizer.state_dict()
    assert optimizer.scaler.get_scale() == 2 * SCALE
    old = {k: v for k, v in state.items() if k != SCALER_STATE}

    resumed = amp_with_a_cpu_scaler([torch.nn.Parameter(torch.zeros(2))])
    resumed.load_state_dict(copy.deepcopy(old))
    assert resumed.scaler.get_scale() == SCALE
    assert str(resumed.optimizer.state_dict()) == str(old)

    bf16 = build_wrapped("adam", "amp-bf16", [torch.nn.Parameter(torch.zeros(2))])
    bf16.load_state_dict(copy.deepcopy(state))
    assert str(bf16.optimizer.state_dict()) == str(old)
    assert SCALER_STATE not in bf16.state_dict()


# tests/helpers/train_with_cpu_amp.py: fairseq-train --amp on the CPU with an enabled GradScaler
# at --amp-init-scale (128) and a growth interval of 2: the scale doubles every second clean
# update, 128 -> 8192 by update 12, and fp16 gradients overflow there.
LOSS_SCALE = re.compile(r"\bloss_scale=([0-9.e+]+)")
UPDATE = re.compile(r"\bnum_updates=(\d+)\b")


def amp_on_the_cpu(data, save, updates):
    cmd = train_command(data, save, "baseline", *SMALL_BATCHES, "--amp", "--max-update", updates,
                        "--no-epoch-checkpoints")
    output = run([sys.executable, ROOT / "tests" / "helpers" / "train_with_cpu_amp.py", *cmd[3:]])
    scales = {}  # update -> the loss scale after it, from the train_inner lines
    for line in output.splitlines():
        scale, update = LOSS_SCALE.search(line), UPDATE.search(line)
        if scale and update and " / " in line:
            scales[int(update.group(1))] = float(scale.group(1))
    return scales, output


def saved_training_state(save):
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(str(save / "checkpoint_last.pt"))
    optimizer = state["last_optimizer_state"]
    return state["model"], optimizer["state"], optimizer.get(SCALER_STATE)


@pytest.mark.slow
@pytest.mark.process
def test_fp16_amp_resume_keeps_the_loss_scale_and_is_bit_exact(toy_data_bin, tmp_path):
    """7 updates, save, resume, 7 more: the weights, Adam's moments and the scaler's state are
    those of 14 uninterrupted updates, to the bit, and the loss scale logged after the resume is
    the uninterrupted run's (stock fairseq restarted at 128 with a fresh growth count, so it
    took other overflows and skips). Update 7 ends at scale 1024 with the growth tracker at 1;
    the uninterrupted run overflows after the resume point."""
    whole, output = amp_on_the_cpu(toy_data_bin, tmp_path / "whole", 14)
    assert "AMP: overflow detected" in output
    first, _ = amp_on_the_cpu(toy_data_bin, tmp_path / "resumed", 7)
    _, _, at_7 = saved_training_state(tmp_path / "resumed")
    resumed, output = amp_on_the_cpu(toy_data_bin, tmp_path / "resumed", 14)
    assert "Loaded checkpoint" in output and "num_updates=7," not in output
    assert sorted(whole) == list(range(1, 15)) and sorted(first) == list(range(1, 8))
    assert {**first, **resumed} == whole
    assert min(resumed) == 8 and resumed[8] != SCALE
    assert (at_7["scale"], at_7["_growth_tracker"]) == (1024.0, 1)

    model, adam, scaler = saved_training_state(tmp_path / "resumed")
    whole_model, whole_adam, whole_scaler = saved_training_state(tmp_path / "whole")
    assert_same_tensors(model, whole_model)
    assert sorted(adam) == sorted(whole_adam)
    for key, moments in whole_adam.items():  # step (an int in fairseq's Adam), exp_avg, ...
        assert_same_tensors({k: torch.as_tensor(v) for k, v in adam[key].items()},
                            {k: torch.as_tensor(v) for k, v in moments.items()})
    assert scaler == whole_scaler and scaler["scale"] != SCALE


# --- the loss scaler's flags, and the retry budget of a batch ------------------------------------

def cpu_scaler(**kwargs):
    """fairseq's ``torch.cuda.amp.GradScaler(**kwargs)`` as an enabled CPU scaler: without CUDA
    the CUDA one disables itself and keeps none of its arguments."""
    return torch.amp.GradScaler("cpu", **kwargs)


# fp16's own flags, set to values of their own: they must not reach the AMP scaler
FP16_FLAGS = ["--fp16-init-scale", "1024", "--fp16-scale-window", "7"]


@pytest.mark.parametrize("amp_flags, scale, growth_interval", [
    (["--amp-init-scale", "4"], 4, 2000),
    (["--amp-scale-window", "3"], 128, 3),
    ([], 128, 2000),  # --amp-init-scale's default 2**7; no window: GradScaler's default
], ids=["init-scale", "scale-window", "defaults"])
def test_amp_loss_scaler_takes_the_amp_flags(amp_flags, scale, growth_interval, monkeypatch):
    """fairseq 0.12 built the --amp scaler from --fp16-init-scale and, for --amp-scale-window N,
    with the growth interval --amp-init-scale: --amp-init-scale 4 gave 1024 here, and
    --amp-scale-window 3 grew the scale every 128 clean updates."""
    monkeypatch.setattr(torch.cuda.amp, "GradScaler", cpu_scaler)
    optimizer = build_wrapped("adam", "amp", extra=[*FP16_FLAGS, *amp_flags])
    assert optimizer.scaler.is_enabled()
    assert optimizer.scaler.get_growth_interval() == growth_interval
    assert optimizer.scaler.get_scale() == scale


AMP_SKIPS = "AMP: skipping this batch."
AMP_OVERFLOW = "AMP: overflow detected"


def test_amp_batch_retries_are_a_budget_per_batch(tmp_path, monkeypatch, caplog):
    """--amp-batch-retries 1 on a real Trainer (CPU loss scaler): batches 1 and 4 overflow once
    each, batch 6 twice (an inf put into a gradient after the backward pass). Each batch gets one
    retry: 1 and 4 are retried and update, 6 is retried once more and then skipped. fairseq 0.12
    set its retry count back to 0 only on a skip: batch 4, three clean updates after batch 1's
    retry, found the budget spent and was skipped without a retry. Between updates the count is
    0, what the fresh Trainer of a resumed run starts with."""
    with fake_data_dir(100) as data:
        trainer, task = build_trainer_from_argv(train_command(
            data, tmp_path, "baseline", "--source-lang", "src", "--target-lang", "tgt", "--amp",
            "--amp-batch-retries", "1")[3:])
        trainer.optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE,
                                                              growth_interval=10 ** 6)
        batches = padded_batches(task, trainer.model, 200, 8, mean_length=10)
    overflows = {1: 1, 4: 1, 6: 2}  # batch -> how many of its attempts overflow
    attempts = []  # the batch of each forward and backward pass, retries included
    task_train_step = task.train_step

    def train_step_overflowing(*args, **kwargs):
        result = task_train_step(*args, **kwargs)
        attempts.append(current)
        if attempts.count(current) <= overflows.get(current, 0):  # this attempt overflows
            next(trainer.model.parameters()).grad.view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(task, "train_step", train_step_overflowing)
    caplog.set_level(logging.INFO, logger="fairseq")
    retry_counts = []  # the count after each batch: where a checkpoint would be saved
    for current, batch in enumerate(batches):
        trainer.train_step([batch])
        retry_counts.append(trainer._amp_retries)
    assert attempts == [0, 1, 1, 2, 3, 4, 4, 5, 6, 6, 7]
    messages = [record.getMessage() for record in caplog.records]
    assert sum(m.startswith(AMP_OVERFLOW) for m in messages) == 4
    assert messages.count(AMP_SKIPS) == 1
    assert trainer.get_num_updates() == 7  # every batch but 6
    assert trainer.optimizer.scaler.get_scale() == SCALE / 2 ** 4
    assert retry_counts == [0] * len(batches)


def _bf16_update(tmp_path, update_freq, seed_batches=3):
    """One --amp --bf16 update of ``update_freq`` micro-batches on the CPU: the casts of fp32
    weights it made, its loss and the weights after it."""
    from multipath_nmt.benchmark.kernels import KernelLaunchCounter

    with fake_data_dir(100) as data:
        trainer, task = build_trainer_from_argv(train_command(
            data, tmp_path, "baseline", "--source-lang", "src", "--target-lang", "tgt", "--amp",
            "--bf16", "--update-freq", str(update_freq))[3:])
        batches = padded_batches(task, trainer.model, 200, update_freq, mean_length=10,
                                 seed=seed_batches)
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}

    class WeightCasts(KernelLaunchCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and \
                    args[0].untyped_storage().data_ptr() in weights:
                self.by_op["weight cast"] += 1
            return func(*args, **(kwargs or {}))

    with WeightCasts() as casts:
        logging_output = trainer.train_step(batches)
    return (casts.by_op["weight cast"], len(weights), logging_output["loss"],
            {k: v.clone() for k, v in trainer.model.state_dict().items()})


def test_bf16_autocast_casts_the_weights_once_per_update(tmp_path, monkeypatch):
    """Under --amp --bf16 every weight is cast once per update however many micro-batches it
    has; fairseq cast it again in each (its autocast region per micro-batch drops the casts).
    The update is the same, bit for bit, as with a cast per micro-batch."""
    from multipath_nmt.fairseq_patches import mixed_precision

    once = {n: _bf16_update(tmp_path, n) for n in (1, 4)}
    casts, weights = once[4][:2]
    assert casts == once[1][0] and weights / 2 < casts <= weights  # the matrices, not the norms
    monkeypatch.setattr(mixed_precision, "weight_casts_kept", contextlib.nullcontext)
    every = _bf16_update(tmp_path, 4)
    assert every[0] == 4 * casts  # fairseq's own: a cast per micro-batch
    assert every[2] == once[4][2]
    assert_same_tensors(every[3], once[4][3])

