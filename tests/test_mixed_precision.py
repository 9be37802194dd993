"""Mixed precision through fairseq's own optimizer wrappers, checked update by update against
plain fp32 Adam on the CPU (``multipath_nmt/fairseq_patches/mixed_precision.py``): ``--amp``
with a CPU ``GradScaler`` standing in for the CUDA one, ``--fp16`` with its flat fp32 master,
``--memory-efficient-fp16``, and bfloat16 (``--amp --bf16`` autocast, fairseq's ``--bf16``)."""
import copy
import re

import pytest
import torch

import multipath_nmt  # noqa: F401  (registers adam_fused, installs the patches)
from helpers.optimizers import build_wrapped
from helpers.training import load_model_state, run, train_command

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
