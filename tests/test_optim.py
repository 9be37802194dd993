"""``--optimizer adam_fused`` makes fairseq's Adam update (``--optimizer adam``) with PyTorch's
fused kernel: same numbers on its own, under fairseq's fp16 wrappers, and over 100
``fairseq-train`` updates."""
import pytest
import torch

from conftest import TRAIN_FLAGS
from fairseq.optim.adam import Adam
from helpers.optimizers import WRAPPERS, build_wrapped
from helpers.training import assert_same_tensors, load_model_state, run, train_command
from multipath_nmt.optim.adam_fused import TorchFusedAdam

HYPER = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
SHAPES = [(7, 5), (5,), (3, 4, 2), (11,)]


def run_side_by_side(dtype, steps=100, skip_every=3):
    """fairseq's Adam and ours on copies of the same tensors and gradients; tensor 3 gets no
    gradient every ``skip_every``-th step, so its step count falls behind the others'."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    optimizers = Adam(theirs, **HYPER), TorchFusedAdam(ours, **HYPER)
    for step in range(steps):
        for index, (mine, reference) in enumerate(zip(ours, theirs)):
            if index == 3 and step % skip_every == 0:
                mine.grad = reference.grad = None
                continue
            grad = (torch.randn(mine.shape, generator=gen) * 1e-3).to(dtype)
            mine.grad, reference.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    return ours, theirs, optimizers


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_same_update_as_fairseq_adam_in_float64(kernel, monkeypatch):
    """Decoupled weight decay and eps added to sqrt(v) (not to sqrt(v / (1 - b2^t)) as in
    torch.optim.Adam): in float64 the two agree to rounding, also for a tensor whose step count
    fell behind (it is updated in its own call with its own bias corrections). ``foreach`` is
    the form used on devices without a fused kernel."""
    from multipath_nmt.optim import adam_fused

    calls, adamw = [], adam_fused.adamw

    def recording_adamw(*args, **kwargs):
        calls.append(kwargs["fused"])
        return adamw(*args, **kwargs)

    monkeypatch.setattr(adam_fused, "adamw", recording_adamw)
    if kernel == "foreach":
        monkeypatch.setattr(adam_fused, "_get_fused_kernels_supported_devices", lambda: [])
    ours, theirs, (reference, mine) = run_side_by_side(torch.float64)
    assert set(calls) == {kernel == "fused"}
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-13)
    assert [mine.state[p]["step"] for p in ours] == [100, 100, 100, 66]
    assert [reference.state[p]["step"] for p in theirs] == [100, 100, 100, 66]


def test_state_is_fairseq_adams():
    """Same state names, types and dtypes as fairseq's Adam (BMUF's average_params and
    checkpoint readers see no difference)."""
    ours, theirs, (reference, mine) = run_side_by_side(torch.float32, steps=3)
    for p, q in zip(ours, theirs):
        a, b = mine.state[p], reference.state[q]
        assert sorted(a) == sorted(b) == ["exp_avg", "exp_avg_sq", "step"]
        assert type(a["step"]) is type(b["step"]) is int
        assert a["exp_avg"].dtype == b["exp_avg"].dtype == torch.float32


def test_half_precision_tensors_are_updated_in_fp32_like_fairseq_adam():
    """--memory-efficient-fp16 hands the optimizer fp16 parameters: both keep fp32 moments
    and update an fp32 copy; the fp16 results agree to one fp16 rounding step."""
    ours, theirs, (reference, mine) = run_side_by_side(torch.float16)
    for p, q in zip(ours, theirs):
        assert p.dtype == torch.float16
        assert mine.state[p]["exp_avg_sq"].dtype == torch.float32
        torch.testing.assert_close(p, q, rtol=2e-3, atol=1e-4)


def test_registered_with_adams_flags():
    from fairseq.optim import OPTIMIZER_REGISTRY

    from multipath_nmt.optim.adam_fused import FairseqAdamFused

    assert OPTIMIZER_REGISTRY["adam_fused"] is FairseqAdamFused
    optimizer = build_wrapped("adam_fused", "fp32")
    assert optimizer.optimizer_config == {"lr": 0.01, "betas": (0.9, 0.98), "eps": 1e-6,
                                          "weight_decay": 0.01}
    assert isinstance(optimizer.optimizer, TorchFusedAdam)


# --- under fairseq's wrappers -------------------------------------------------------------------



def train_tiny_model(optimizer_name, wrapper, steps=30):
    """A small fp16 (or fp32) MLP trained as fairseq's Trainer does: scaled backward, gradient
    norm (which unscales), step; the final parameters as fp32."""
    torch.manual_seed(0)
    dtype = torch.float32 if wrapper == "fp32" else torch.float16
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).to(dtype)
    optimizer = build_wrapped(optimizer_name, wrapper, list(model.parameters()))
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data).to(dtype)
        y = torch.randn(8, 4, generator=data)
        optimizer.zero_grad()
        optimizer.backward(((model(x).float() - y) ** 2).mean())
        optimizer.clip_grad_norm(0.0)
        optimizer.step()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_same_parameters_as_fairseq_adam_under_fairseqs_wrappers(wrapper):
    ours, theirs = train_tiny_model("adam_fused", wrapper), train_tiny_model("adam", wrapper)
    # fp32 rounding only; the fp16 model's weights can round the other way: one fp16 step
    tolerance = dict(rtol=1e-5, atol=1e-6) if wrapper == "fp32" else dict(rtol=2e-3, atol=2e-4)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **tolerance)
    assert any(not torch.equal(p, q) for p, q in zip(ours, train_tiny_model("adam", wrapper, 29)))


# --- through fairseq-train ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("precision, updates, tolerance", [
    ("fp32", 100, dict(atol=1e-5, rtol=1e-4)),
    # fp16 weights, and warm-up updates below one fp16 step (lr 1e-4 ... 1e-3 against steps of
    # 2.4e-4 - 4.9e-4 for weights of 0.25 - 0.5): an fp32 rounding difference can round a weight
    # to the other neighbour at each update. That is the tolerance (about 5 such steps); the
    # update's arithmetic is checked exactly above (float64, and the wrappers on one model).
    ("memory-efficient-fp16", 10, dict(atol=2.5e-3, rtol=0)),
])
def test_fairseq_train_updates_match_fairseq_adam(precision, updates, tolerance, toy_data_bin,
                                                  tmp_path):
    """On the CPU, a multi-path model, decoupled weight decay and a non-default eps."""
    assert "--optimizer" in TRAIN_FLAGS  # the later --optimizer wins
    states = {}
    for name in ("adam", "adam_fused"):
        save = tmp_path / name
        run(train_command(toy_data_bin, save, "multipath", "--optimizer", name,
                          "--weight-decay", "0.01", "--adam-eps", "1e-6",
                          "--max-update", updates, *WRAPPERS[precision],
                          "--batch-size", "8", "--required-batch-size-multiple", "1",
                          "--no-epoch-checkpoints"))
        states[name], done = load_model_state(save / "checkpoint_last.pt")
        assert done == updates
    assert_same_tensors(states["adam_fused"], states["adam"], **tolerance)
