"""One activation table for every model: ``--activation-fn NAME`` is fairseq's function for NAME
(fairseq.utils.get_activation_fn) in the multi-path, MoE/EWA/ParameterNet and WideNet models,
as in fairseq's own layers of the same models (multipath_nmt.modules.ACTIVATIONS)."""
import pytest
import torch
from conftest import TINY_MODEL
from fairseq import utils

from multipath_nmt.modules import ACTIVATIONS, get_activation_fn
from multipath_nmt.params import build_model

# fairseq warns that gelu_fast is renamed gelu_accurate each time it is asked for it
pytestmark = pytest.mark.filterwarnings("ignore:--activation-fn=gelu_fast has been renamed")

# Every name fairseq's get_activation_fn knows.
FAIRSEQ_NAMES = ("relu", "relu_squared", "gelu", "gelu_fast", "gelu_accurate", "tanh", "linear",
                 "swish")

# One configuration per model family with an FFN of the plug-in's own (fairseq's layers around
# it are checked too).
FAMILIES = {
    "multipath": ("multipath_transformer", "--encoder-paths", "2", "--decoder-paths", "2"),
    "moe": ("moe_transformer", "--encoder-ffn", "moe"),
    "ewa": ("ewa_transformer_wmt_en_de",),
    "parameternet_routed": ("moe_transformer", "--encoder-ffn", "parameternet",
                            "--parameternet-mode", "routed"),
    "parameternet_dynamic": ("moe_transformer", "--encoder-ffn", "parameternet",
                             "--parameternet-mode", "dynamic"),
    "widenet": ("widenet_transformer_wmt_en_de",),
}


def fairseq_activation(name):
    """fairseq's function for ``name``; for swish fairseq 0.12 returns the class torch.nn.SiLU
    (not applicable to a tensor), whose function is what swish means."""
    function = utils.get_activation_fn(name)
    return function() if function is torch.nn.SiLU else function


def _input(dtype):
    # wide enough for tanh's and gelu's tails, fine enough for their middles, and exact zeros
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64)
    return torch.cat([x, torch.randn(1000, dtype=torch.float64) * 3]).to(dtype)


@pytest.mark.parametrize("name", FAIRSEQ_NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
def test_the_table_computes_fairseqs_function(name, dtype):
    x = _input(dtype)
    ours, theirs = get_activation_fn(name)(x), fairseq_activation(name)(x)
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_the_table_has_every_name_fairseq_offers_and_refuses_others_in_one_line():
    assert set(utils.get_available_activation_fns()) <= set(ACTIVATIONS)
    assert set(FAIRSEQ_NAMES) == set(ACTIVATIONS)
    with pytest.raises(ValueError, match=r"^unknown --activation-fn 'gleu'; choose one of relu, "):
        get_activation_fn("gleu")


def test_default_relu_is_torchs_relu():
    # the default's numbers stay what they were: the very function, not a wrapper of it
    assert get_activation_fn("relu") is torch.nn.functional.relu


def _activations(model):
    """(module type, activation_fn) of every FFN of ``model``: the plug-in's (modules/) and
    fairseq's layers. Not the adapters of models/: moe_transformer's encoder layer keeps fairseq's
    forward with an identity activation, the FFN it calls applies the activation."""
    return [(type(module), module.activation_fn) for module in model.modules()
            if callable(getattr(module, "activation_fn", None))
            and type(module).__module__.startswith(("multipath_nmt.modules.", "fairseq."))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", utils.get_available_activation_fns())
def test_every_model_family_maps_each_name_to_fairseqs_function(family, name):
    arch, *flags = FAMILIES[family]
    model = build_model(arch, 100, [*TINY_MODEL, *flags, "--activation-fn", name], device="cpu")
    found = _activations(model)
    ours = [function for kind, function in found if kind.__module__.startswith("multipath_nmt.")]
    assert ours, f"{family}: no FFN of the plug-in found"
    assert all(function is ACTIVATIONS[name] for function in ours), (family, ours)
    x = _input(torch.float64)
    expected = fairseq_activation(name)(x)
    for kind, function in found:  # the plug-in's FFNs and fairseq's own layers of the model
        torch.testing.assert_close(function(x), expected, rtol=0, atol=0,
                                   msg=f"{family}: {kind.__name__}'s {name}")
