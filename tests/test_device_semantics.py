"""GPU semantics on the CPU (issue 29): every model family trains and decodes on a fake GPU (no
tensor of the CPU meets one of the device, in fp32, fp16 and bf16, with and without source
padding), and the custom backward passes sum half-precision gradients in fp32 (at the end).

A GPU run fails where code makes a tensor without ``device=`` (it lands on the CPU) and then
mixes it with the model's tensors; a CPU run cannot see that, every tensor being on the CPU.
This harness runs the models under ``FakeTensorMode`` on a fake accelerator: tensors carry
shapes, dtypes and devices but no data, every op checks its operands' devices by PyTorch's own
rules (a 0-dim CPU tensor may meet a device tensor, nothing bigger), and the model's parameters,
buffers and batch are on that device, as after ``model.cuda()``.

What it runs, per model family, dtype and padding: fairseq's criterion (the model's training
forward) and its backward, then inference as fairseq's ``SequenceGenerator`` runs it: the
encoder, its output expanded to the beams, three incremental decoder steps with the beams
reordered between them and one sentence leaving the batch (finished), each step's
``get_normalized_probs``.

How, on the CPU build of torch 2.13:

- The fake device is PyTorch's PrivateUse1 backend, registered from Python and named
  ``fakegpu``. A fake ``cuda`` tensor cannot be used: without a CUDA build PyTorch has no CUDA
  device guard (``torch._C._ensureCUDADeviceGuardSet`` installs one only in CUDA builds without
  a device), so indexing a fake CUDA tensor fails, and the autograd engine needs the CUDA
  accelerator to run a backward over CUDA tensors. PrivateUse1 has both from Python. To the code
  under test it is a device like ``cuda``: ``device.type`` is not ``"cpu"`` and a CPU tensor
  that meets it raises ``FakeTensorDeviceMismatchError`` ("found at least two devices,
  fakegpu:0 and cpu").
- Registering a backend cannot be undone, and afterwards ``torch.accelerator`` reports one (the
  DataLoader would pin memory with it), so the cases run in a child process: this file run as
  a script prints each case's result as JSON; the tests read them.
- Fake tensors have no values, but fairseq reads two on the host: whether the source batch has
  padding (``has_pads``, read per encoder layer) and whether the decoder input has. Each case
  first runs for real on the CPU and records every scalar read in order; the fake run answers
  its reads from that record, and fails if it makes a different number of them. Any other op
  whose output shape depends on values (a host sync on a GPU) fails the fake run.
- fairseq's sinusoidal positions take the input's shape as a tensor
  (``torch.onnx.operators.shape_as_tensor``), which a fake tensor cannot fill in; the harness
  gives them the shape as Python ints, the same numbers on the host, as a GPU run has them.
"""
import contextlib
import copy
import json
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.onnx.operators
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = "fakegpu"
MOE = ["--criterion", "label_smoothed_cross_entropy_with_moe"]
PLAIN = ["--criterion", "label_smoothed_cross_entropy"]
SYSTEMS = {
    "stock pre-norm": ["--arch", "transformer_prenorm_wmt_en_de", *PLAIN],
    "multi-path, 2 decoder paths": ["--arch", "multipath_transformer_wmt_en_de",
                                    "--encoder-paths", "2", "--decoder-paths", "2", *PLAIN],
    "multi-path, 3 paths, cheap features": ["--arch", "multipath_transformer_wmt_en_de",
                                            "--encoder-paths", "3", "--decoder-paths", "3",
                                            "--cheap-features", *PLAIN],
    "WideNet": ["--arch", "widenet_transformer_wmt_en_de", *MOE],
    "MoE": ["--arch", "moe_transformer_wmt_en_de", *MOE],
    "EWA": ["--arch", "ewa_transformer_wmt_en_de", *MOE],
    "ParameterNet, routed": ["--arch", "parameternet_transformer_wmt_en_de",
                             "--parameternet-mode", "routed", "--parameternet-proj", "both",
                             *MOE],
    "ParameterNet, dynamic": ["--arch", "parameternet_transformer_wmt_en_de",
                              "--parameternet-mode", "dynamic", "--parameternet-proj", "both",
                              *PLAIN],
}
DTYPES = ("fp32", "fp16", "bf16")
TINY = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--encoder-layers", "2", "--decoder-layers", "1", "--max-update", "10",
        "--share-all-embeddings", "--label-smoothing", "0.1"]
VOCAB, SENTENCES, SOURCE_LEN, TARGET_LEN, BEAM = 40, 3, 7, 5, 2


def case_id(system, dtype, padded):
    return f"{system}, {dtype}, {'padded' if padded else 'no padding'}"


CASES = [(system, dtype, padded) for system in SYSTEMS for dtype in DTYPES
         for padded in (True, False)]


# --- the child process ----------------------------------------------------------------------

def install_fake_gpu():
    """Register PrivateUse1 as the fake accelerator ``fakegpu`` (once per process)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    class Backend:  # what torch asks of a backend module
        is_initialized = is_available = staticmethod(lambda: True)
        current_device = staticmethod(lambda: 0)
        device_count = staticmethod(lambda: 1)
        _is_in_bad_fork = staticmethod(lambda: False)
        manual_seed_all = staticmethod(lambda seed: None)
        get_amp_supported_dtype = staticmethod(lambda: [torch.float16, torch.bfloat16])

    _setup_privateuseone_for_python_backend(DEVICE, backend_module=Backend())
    # the shape as Python ints: fake tensors cannot fill in a shape tensor
    torch.onnx.operators.shape_as_tensor = lambda x: x.shape


class ReplayingFakeTensorMode(FakeTensorMode):
    """Fake tensors whose scalar reads are answered from a recorded real run."""

    # The fake device has no kernels: never run an op for real on it (by default, fake tensors
    # run small constant computations for real when an accelerator is available).
    avoid_device_init = True

    def __init__(self, reads):
        super().__init__()
        self.reads = list(reads)

    def dispatch(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if not self.reads:
                raise AssertionError("the fake run reads a value the real run did not")
            return self.reads.pop(0)
        return super().dispatch(func, types, args, kwargs)


@contextlib.contextmanager
def recorded_scalar_reads():
    """Every scalar read (``_local_scalar_dense``) of a real run, in order, but those of
    ``one_hot``'s class-range check, which only its CPU kernel makes."""

    reads, in_one_hot = [], []

    class OneHot(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            in_one_hot.append(func is F.one_hot)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                in_one_hot.pop()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._local_scalar_dense.default and not any(in_one_hot):
                reads.append(out)
            return out

    with OneHot(), Reads():
        yield reads


def build(system):
    """fairseq's task, model (real, on the CPU, fp32) and criterion for ``system``."""
    from fairseq import options
    from fairseq.tasks.translation import TranslationTask

    from multipath_nmt.params import _dictionary

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["unused-data-dir", "--task", "translation",
                                                *TINY, *SYSTEMS[system]])
    dictionary = _dictionary(VOCAB, "--dict-size")
    task = TranslationTask(args, dictionary, dictionary)
    return task, task.build_model(args), task.build_criterion(args)


def batch(task, padded):
    """A training batch on the CPU, sources left-padded as fairseq pads them."""

    generator = torch.Generator().manual_seed(0)
    dictionary = task.source_dictionary
    src = torch.randint(dictionary.nspecial, VOCAB, (SENTENCES, SOURCE_LEN), generator=generator)
    lengths = torch.full((SENTENCES,), SOURCE_LEN)
    if padded:
        src[1, :3] = dictionary.pad()
        lengths[1] = SOURCE_LEN - 3
    target = torch.randint(dictionary.nspecial, VOCAB, (SENTENCES, TARGET_LEN),
                           generator=generator)
    prev = torch.cat([torch.full((SENTENCES, 1), dictionary.eos()), target[:, :-1]], 1)
    return {"id": torch.arange(SENTENCES), "nsentences": SENTENCES,
            "ntokens": SENTENCES * TARGET_LEN, "target": target,
            "net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}}


def train_step(model, criterion, sample):
    model.train()
    loss, _, _ = criterion(model, sample)
    loss.backward()
    return loss


def decode(model, sample, eos):
    """Inference as fairseq's SequenceGenerator runs it, greedy within each beam: encoder, beams,
    incremental decoder steps with reordering, a finished sentence leaving the batch."""

    model.eval()
    src = sample["net_input"]["src_tokens"]
    device = src.device
    with torch.no_grad():
        if hasattr(model, "set_beam_size"):
            model.set_beam_size(BEAM)
        net_input = {k: v for k, v in sample["net_input"].items() if k != "prev_output_tokens"}
        encoder_out = model.encoder.forward_torchscript(net_input)
        sentences = src.size(0)
        order = torch.arange(sentences, device=device).view(-1, 1).repeat(1, BEAM).view(-1)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
        tokens = torch.full((sentences * BEAM, 1), eos, dtype=torch.long, device=device)
        state = {}
        outputs = []
        for step in range(3):
            decoder_out = model.decoder.forward(tokens, encoder_out=encoder_out,
                                                incremental_state=state)
            lprobs = model.get_normalized_probs((decoder_out[0][:, -1:, :], None),
                                                log_probs=True)
            outputs.append(lprobs)
            best = lprobs[:, -1].argmax(-1)
            if step == 0:  # swap the two beams of every sentence
                reorder = torch.arange(sentences * BEAM, device=device).view(-1, BEAM).flip(1)
                reorder = reorder.reshape(-1)
            else:  # sentence 0 finished: it leaves the batch
                reorder = torch.arange(BEAM, sentences * BEAM, device=device)
                sentences -= 1
            model.decoder.reorder_incremental_state_scripting(state, reorder)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, reorder)
            tokens = torch.cat([tokens[reorder], best[reorder].unsqueeze(1)], 1)
    return outputs


def to_fake_device(mode, model, sample, dtype):
    """The model (parameters and buffers, shared ones once) and the batch on the fake device,
    floating-point tensors in ``dtype``: what ``model.cuda().half()`` and fairseq's
    ``move_to_cuda`` do."""

    device = torch.device(DEVICE, 0)
    converted = {}

    def move(tensor):
        if id(tensor) not in converted:
            with torch.no_grad():
                fake = mode.from_tensor(tensor).to(
                    device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
            if isinstance(tensor, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
            converted[id(tensor)] = fake
        return converted[id(tensor)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensors[name] = move(tensor)
    return tree_map(lambda x: move(x) if isinstance(x, torch.Tensor) else x, sample)


def run_case(system, dtype_name, padded):

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(1)
    task, model, criterion = build(system)
    sample = batch(task, padded)
    eos = task.target_dictionary.eos()
    # the real run on the CPU: the values fairseq reads on the host
    with recorded_scalar_reads() as reads:
        train_step(model, criterion, sample)
        decode(model, sample, eos)
    model.zero_grad(set_to_none=True)

    with ReplayingFakeTensorMode(reads) as mode:
        sample = to_fake_device(mode, model, sample, dtype)
        loss = train_step(model, criterion, sample)
        problems = [f"{name}: gradient {None if p.grad is None else (p.grad.device, p.grad.dtype)}"
                    for name, p in model.named_parameters() if p.requires_grad
                    and (p.grad is None or p.grad.device != p.device or p.grad.dtype != dtype)]
        outputs = decode(model, sample, eos)
        problems += [f"decoder step {step}: log-probabilities on {out.device}"
                     for step, out in enumerate(outputs) if out.device.type != DEVICE]
        if loss.device.type != DEVICE:
            problems.append(f"loss on {loss.device}")
        if mode.reads:
            problems.append(f"the fake run made {len(mode.reads)} fewer scalar reads")
    assert not problems, problems


def self_check():
    """What the harness must catch: a CPU-made index meeting device rows (as an EWA partition
    drawn on the CPU would), and an output shape that depends on values (a host sync)."""

    caught = []
    with ReplayingFakeTensorMode([]):
        rows = torch.zeros(6, 4, device=DEVICE)
        for name, bad in (("CPU index", lambda: rows.index_select(0, torch.randperm(6))),
                          ("boolean mask", lambda: rows[rows.sum(1) > 0])):
            try:
                bad()
            except Exception as error:  # noqa: BLE001
                caught.append(f"{name}: {type(error).__name__}")
    return caught


def describe(error):
    """The error and the frames of its traceback outside torch (where the model code is)."""

    torch_dir = os.path.dirname(torch.__file__)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not frame.filename.startswith(torch_dir)]
    return "".join(traceback.format_list(frames[-12:]) +
                   traceback.format_exception_only(type(error), error))


def main(selected):

    torch.set_num_threads(1)
    install_fake_gpu()
    import multipath_nmt  # noqa: F401 (registers the architectures)

    results = {"self-check": self_check()}
    for system, dtype, padded in CASES:
        name = case_id(system, dtype, padded)
        if selected is not None and name not in selected:
            continue
        try:
            run_case(system, dtype, padded)
            results[name] = "ok"
        except Exception as error:  # noqa: BLE001 (reported to the test)
            results[name] = describe(error)
    print(json.dumps(results))


# --- the tests ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake_gpu_results(trains, request):
    """Every selected case trained and decoded on the fake GPU, in one process of its own (about a
    minute for all of them): its tests are slow."""
    selected = sorted({item.callspec.params["case"] for item in request.session.items
                       if item.fspath == request.fspath and hasattr(item, "callspec")
                       and "case" in item.callspec.params})
    from conftest import run_command

    proc = run_command([sys.executable, __file__, "--only", *selected],
                       cwd=Path(__file__).resolve().parents[1], timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"the fake-GPU harness exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_harness_catches_a_cpu_tensor_on_the_device_and_a_value_dependent_shape(
        fake_gpu_results):
    assert fake_gpu_results["self-check"] == [
        "CPU index: FakeTensorDeviceMismatchError",
        "boolean mask: DynamicOutputShapeException"]


@pytest.mark.parametrize("case", [case_id(*case) for case in CASES])
def test_trains_and_decodes_on_a_fake_gpu(fake_gpu_results, case):
    assert fake_gpu_results[case] == "ok", fake_gpu_results[case]


# --- half-precision sums in the custom backward passes -----------------------------------------
# The autograd Functions of multipath_nmt/modules sum over many tokens (weight and bias gradients
# of ParameterNet's mixed projection, PathNorm's parameters) or channels (the gate gradients of
# the MoE combine). With fp16/bf16 operands those sums must accumulate in fp32 and round once at
# the end: summed in half precision, small terms stop adding up once the running sum is about
# 2^11 (fp16) or 2^8 (bf16) times larger than them. Each test feeds thousands of small positive
# terms, checks the gradient against a float64 computation on the same half-precision inputs
# to one rounding of the output dtype, and checks that the data would expose a half-precision
# accumulation (summed term by term in that dtype, it misses a quarter of the mass or more).

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
MANY = 8192


def half_accumulated(terms, dtype):
    """sum(terms) added one term at a time in ``dtype``: what a half-precision accumulator does."""
    total = torch.zeros((), dtype=dtype)
    for term in terms.to(dtype):
        total = total + term
    return total.double()


def assert_one_rounding(actual, reference, dtype, terms):
    """``actual`` within one rounding of ``dtype`` of the float64 ``reference``, and
    ``terms`` (the summands of reference's first element) too many to sum in ``dtype``."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(actual.double(), reference.double(), rtol=eps, atol=0)
    exact = terms.double().sum()
    assert half_accumulated(terms, dtype) < 0.75 * exact, "the terms do not test accumulation"


def positive(*shape, low=0.5, high=1.0, generator):
    return torch.empty(*shape, dtype=torch.float64).uniform_(low, high, generator=generator)


@pytest.mark.parametrize("name", list(HALF))
def test_mixed_projection_sums_its_weight_and_bias_gradients_in_fp32(name):
    """Dynamic ParameterNet's _MixedProjection: dW_i = sum_t alpha_ti x_t^T dy_t and
    db_i = sum_t alpha_ti dy_t over 8,192 tokens, in fp16 and bf16."""
    from multipath_nmt.modules.parameternet import _MixedProjection

    dtype, generator = HALF[name], torch.Generator().manual_seed(0)
    inputs = [positive(MANY, 3, generator=generator), positive(MANY, 2, generator=generator),
              positive(3, 2, 4, generator=generator), positive(2, 4, generator=generator)]
    grad = positive(MANY, 4, low=2 ** -8, high=2 ** -7, generator=generator)
    half = [t.to(dtype).requires_grad_() for t in inputs]
    exact = [t.to(dtype).double().requires_grad_() for t in inputs]
    _MixedProjection.apply(*half).backward(grad.to(dtype))
    _MixedProjection.apply(*exact).backward(grad.to(dtype).double())
    x, alpha = exact[0].detach(), exact[1].detach()
    dy = grad.to(dtype).double()
    assert_one_rounding(half[2].grad, exact[2].grad, dtype, x[:, 0] * alpha[:, 0] * dy[:, 0])
    assert_one_rounding(half[3].grad, exact[3].grad, dtype, alpha[:, 0] * dy[:, 0])


@pytest.mark.parametrize("name", list(HALF))
def test_moe_combine_and_dispatch_sum_their_gradients_in_fp32(name):
    """SlotPlan's _Combine: the gradient of each gate is a dot product over 8,192 channels;
    _Dispatch: each token's gradient sums its top-2 slots."""
    from multipath_nmt.modules.moe import TopKRouter

    dtype, generator = HALF[name], torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    router = TopKRouter(4, num_experts=4, k=2, capacity_factor=2.0, noise=False)
    routing = router(torch.randn(16, 4))
    assert routing.plan.kept.all()
    slots = routing.num_experts * routing.capacity
    output = positive(slots, MANY, generator=generator).to(dtype)
    tokens = positive(16, MANY, generator=generator).to(dtype)
    grad = positive(16, MANY, low=2 ** -8, high=2 ** -7, generator=generator).to(dtype)
    results = {}
    for kind, cast in (("half", lambda t: t.clone()), ("exact", torch.Tensor.double)):
        rows = cast(output).requires_grad_()
        gates = routing.gates.detach().requires_grad_()
        combined = routing.plan.combine(rows, gates * routing.plan.kept)
        inputs = cast(tokens).requires_grad_()
        dispatched = routing.plan.dispatch(inputs)
        (combined * cast(grad)).sum().backward()
        dispatched.backward(cast(output))
        results[kind] = gates.grad, inputs.grad
    slot = routing.plan.slot_of_assignment[0]
    assert_one_rounding(results["half"][0], results["exact"][0], dtype,
                        output[slot].double() * grad[0].double())
    torch.testing.assert_close(results["half"][1].double(), results["exact"][1],
                               rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("name", list(HALF))
def test_path_norm_sums_its_parameter_gradients_in_fp32(name):
    """PathMixer's _NormalizedSum over half-precision paths: the gradients of alpha, gamma and
    beta sum over 8,192 tokens in fp32 (the parameters' dtype), with cheap features."""
    from multipath_nmt.modules.multipath import PathMixer

    dtype, generator = HALF[name], torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mixer = PathMixer(3, 8, cheap_features=True)
    paths = torch.randn(3, MANY, 8, generator=generator).to(dtype)
    grad = positive(MANY, 8, low=2 ** -8, high=2 ** -7, generator=generator)
    exact = copy.deepcopy(mixer).double()
    mixer.normalized_sum(paths).backward(grad.float())
    exact.normalized_sum(paths.double()).backward(grad)
    for name_, parameter in mixer.named_parameters():
        reference = dict(exact.named_parameters())[name_].grad
        if parameter.grad is not None:
            # fp32 rounding of sums that cancel: a half-precision sum errs by 1e-3 of the terms
            torch.testing.assert_close(parameter.grad.double(), reference, rtol=1e-4, atol=1e-4,
                                       msg=name_)
    # beta_f's gradient is alpha_f times the sum of the output gradient over the tokens
    assert half_accumulated(grad[:, 0], dtype) < 0.75 * grad[:, 0].sum()


if __name__ == "__main__":
    # "--only CASE...": those cases (none: the self-check alone); no arguments: every case
    main(set(sys.argv[2:]) if sys.argv[1:2] == ["--only"] else None)
