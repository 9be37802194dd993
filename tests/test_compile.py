"""``--compile-layers`` (multipath_nmt/fairseq_patches/compile_layers.py): every family's layers
compile without graph breaks, stop compiling after the first batches, train like eager and save
eager checkpoints. The backends here generate no code ("eager", "aot_eager"), so the suite stays
fast; inductor's speed and agreement are multipath-bench's (``--compiled``)."""
import collections

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import multipath_nmt  # noqa: F401  (installs the patches)
from helpers.training import (
    SMALL_BATCHES,
    assert_same_tensors,
    load_model_state,
    run,
    train_command,
    train_to_its_end,
)
from multipath_nmt.benchmark.batches import fake_data_dir, synthetic_batch
from multipath_nmt.benchmark.systems import SIZES, build_trainer, fairseq_flags, systems_for
from multipath_nmt.fairseq_patches import compile_layers
from conftest import run_fairseq

SIZE = dict(SIZES["tiny"], dim=16, ffn=32, heads=2, vocab=60)
# (batch, length) of successive batches: the first few may compile (dynamic shapes, the decoder's
# future-mask cache growing, a padding mask present or not); the later ones must not
SHAPES = [(4, 6), (3, 9), (5, 7), (2, 11), (6, 5), (3, 8)]
WARM = 3


class GraphCounter:
    """A torch.compile backend that runs each graph as traced and counts the graphs."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


# One system per family and layer code (the other systems of multipath-bench differ from these
# in sizes and flags only), so that the suite stays fast; multi-path with decoder paths too.
FAMILIES = ("stock prenorm L", "multi-path L x 4 (+cheap features)",
            "WideNet (shared attn + MoE E4 k2)", "EWA (E4, every-2)",
            "ParameterNet (routed, both)", "ParameterNet (dynamic, both)")


def _systems():
    systems = [s for s in systems_for(SIZE) if s.name in FAMILIES]
    for system in systems:
        if system.arch == "multipath_transformer":
            system.flags = [*system.flags, "--decoder-paths=2"]
    assert len(systems) == len(FAMILIES)
    return systems


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# make test-fast traces the multi-path family (about 13 s a family); make test every family
FAST_FAMILY = "multi-path L x 4 (+cheap features)"


@pytest.mark.parametrize("system", [
    pytest.param(s, id=s.name, marks=() if s.name == FAST_FAMILY else pytest.mark.slow)
    for s in _systems()])
def test_every_family_compiles_without_graph_breaks_or_recompiles(system):
    """Each layer's training forward is one graph per call (no graph break: dynamo's counter
    stays empty) and, after the first few batches, new batch shapes compile nothing more:
    fairseq's layers of the baselines, multi-path, WideNet, routed MoE/EWA/ParameterNet."""
    counter = GraphCounter()
    graphs_after = []
    with fake_data_dir(SIZE["vocab"]) as data:
        trainer, task = build_trainer(data, fairseq_flags(SIZE, system), "cpu", False)
        assert compile_layers.compile_model_layers(trainer.model, counter) >= 2
        for index, (batch, length) in enumerate(SHAPES):
            sample = synthetic_batch(dict(SIZE, batch=batch, length=length),
                                     len(task.source_dictionary), seed=index)
            if index % 2:  # some source padding, as in real batches
                sample["net_input"]["src_tokens"][0, :2] = task.source_dictionary.pad()
            trainer.train_step([sample])
            graphs_after.append(counter.graphs)
    assert dict(counters["graph_break"]) == {}, system.name
    assert counter.graphs > 0
    assert graphs_after[WARM - 1:] == [graphs_after[WARM - 1]] * (len(SHAPES) - WARM + 1), \
        (system.name, graphs_after)


def test_only_the_training_forward_is_compiled():
    """Eval mode, no_grad and incremental decoding run the layer eagerly; the state dict keeps
    its keys (no ``_orig_mod.``) and a second compile changes nothing."""
    from multipath_nmt.modules.multipath import MultiPathEncoderLayer

    layer = MultiPathEncoderLayer(16, 32, 2, 3)
    keys = list(layer.state_dict())
    counter = GraphCounter()
    compile_layers.compile_layer(layer, counter)
    forward = layer.forward
    compile_layers.compile_layer(layer, counter)
    assert layer.forward is forward and list(layer.state_dict()) == keys
    x = torch.randn(5, 2, 16)
    layer.eval()
    with torch.no_grad():
        expected = layer(x)
    assert counter.graphs == 0
    layer.train()
    layer(x).sum().backward()
    assert counter.graphs == 1
    layer.eval()
    torch.testing.assert_close(layer(x), expected)
    with torch.no_grad():
        layer.train()
        layer(x)
    assert counter.graphs == 1


def test_incremental_decoding_stays_eager():
    """fairseq's SequenceGenerator calls the decoder layers with ``incremental_state``: those
    calls are eager even in training mode with gradients on."""
    called = collections.Counter()

    class Layer(torch.nn.Module):
        def forward(self, x, incremental_state=None):
            called["eager" if torch.compiler.is_compiling() is False else "compiled"] += 1
            return x * 2

    layer = compile_layers.compile_layer(Layer(), "eager")
    x = torch.randn(3, requires_grad=True)
    layer(x, incremental_state={})
    assert called == {"eager": 1}
    layer(x)
    assert called["compiled"] == 1


@pytest.mark.slow
def test_fairseq_train_compiled_matches_eager_and_saves_eager_keys(toy_data_bin, tmp_path):
    """fairseq-train --compile-layers aot_eager (a multi-path model with 2 decoder paths) makes
    the same first updates as eager (fp32, within float tolerance), its checkpoint has the same
    keys (no ``_orig_mod.``), it resumes, and fairseq-generate loads it."""
    states = {}
    for name, flags in (("eager", []), ("compiled", ["--compile-layers", "aot_eager"])):
        save = tmp_path / name
        run(train_command(toy_data_bin, save, "multipath", *SMALL_BATCHES, "--max-update", "3",
                          "--no-epoch-checkpoints", *flags))
        states[name], updates = load_model_state(save / "checkpoint_last.pt")
        assert updates == 3
    assert not [key for key in states["compiled"] if "_orig_mod" in key]
    assert_same_tensors(states["compiled"], states["eager"], atol=1e-5, rtol=1e-4)
    output = run(train_command(toy_data_bin, tmp_path / "compiled", "multipath", *SMALL_BATCHES,
                               "--max-update", "5", "--no-epoch-checkpoints",
                               "--compile-layers", "aot_eager"))
    assert "loaded checkpoint" in output.lower()
    assert load_model_state(tmp_path / "compiled" / "checkpoint_last.pt")[1] == 5
    generated = run_fairseq("generate", toy_data_bin, "--path",
                            tmp_path / "compiled" / "checkpoint_last.pt", "--gen-subset", "test",
                            "--beam", "2", "--cpu", "--no-progress-bar").stdout
    sources = [line for line in generated.splitlines() if line.startswith("S-")]
    hypotheses = [line for line in generated.splitlines() if line.startswith("H-")]
    assert len(sources) == len(hypotheses) > 0


def test_compile_flag_refuses_bad_input_in_one_line(toy_data_bin, tmp_path):
    """An unknown backend is an argparse error naming the choices; with
    --checkpoint-activations, one line saying why."""
    base = train_command(toy_data_bin, tmp_path, "baseline", "--max-update", "1")
    bad = train_to_its_end([*base, "--compile-layers", "nosuch"])
    assert bad.returncode == 2
    assert "unknown torch.compile backend 'nosuch'; choose one of" in bad.stderr
    assert "aot_eager" in bad.stderr and "inductor" in bad.stderr
    with pytest.raises(compile_layers.CompileLayersError, match="--checkpoint-activations"):
        import argparse

        cfg = argparse.Namespace(model=argparse.Namespace(checkpoint_activations=True))
        compile_layers.check(cfg, "inductor")


def test_the_flag_is_on_training_parsers_only():
    from fairseq import options

    train = options.get_training_parser()
    assert any("--compile-layers" in a.option_strings for a in train._actions)
    generate = options.get_generation_parser()
    assert not any("--compile-layers" in a.option_strings for a in generate._actions)
    args = options.parse_args_and_arch(train, ["data", "--arch", "transformer_prenorm_wmt_en_de",
                                               "--compile-layers"])
    assert args.compile_layers == "inductor"
