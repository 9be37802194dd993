"""``--compile-layers``: the encoder and decoder layers of every model compiled with
``torch.compile`` for training.

fairseq 0.12 predates ``torch.compile``. This patch adds one training flag and compiles, after
fairseq's ``Trainer`` is built, each layer in ``model.encoder.layers`` and
``model.decoder.layers`` (fairseq's own layers of the baselines, the multi-path layers, the
WideNet stack, the MoE/EWA/ParameterNet layers alike, so that comparisons stay fair):

* ``--compile-layers`` compiles with inductor; ``--compile-layers BACKEND`` with another
  ``torch.compile`` backend (``aot_eager`` and ``eager`` are what the tests use: no code
  generation, so they compile in a second).
* Only the training forward is compiled: a layer in training mode, with gradients on and no
  ``incremental_state``. Validation (eval mode, no gradients) and incremental decoding (beam
  search, fairseq's ``SequenceGenerator``) run the same layer eagerly, as before; a checkpoint
  loaded by ``fairseq-generate`` is never compiled (no ``Trainer``).
* In place: the layer's ``forward`` attribute dispatches to the compiled function, so no module
  is wrapped and the checkpoint's keys are those of an eager run (no ``_orig_mod.``).
  Checkpoints, resume and averaging see no difference.
* Random numbers are eager's: inductor runs with ``fallback_random`` (dropout and router noise
  drawn by PyTorch's own ops from fairseq's seeded generator, not by inductor's Philox), so a
  compiled run makes the first updates of the eager run with the same seed, up to float
  rounding, and resumes the same way.
* Shapes are dynamic from the first batch (``dynamic=True``): fairseq's batches vary in batch
  size and length, and each layer class compiles once (the layers of one class share the code,
  the graph and its cache) instead of once static and again dynamic.
* Refused, with one line: ``--checkpoint-activations`` (fairseq's checkpoint wrapper is an
  autograd function around the layer with Python arguments: the compiled graph would stop at it).

Tested with fairseq 0.12.3 and torch 2.13 (``tests/test_compile.py``).

Reach beyond the plug-in's own models: a new flag on training parsers; given, any model's layers are
compiled (fairseq's ``transformer`` too); validation and incremental decoding stay eager.
Does nothing when: the flag is not given.
"""
import argparse
import functools

import torch

from multipath_nmt.fairseq_patches.wrapping import wrap

FLAG = "--compile-layers"
DEFAULT_BACKEND = "inductor"
# torch.compile's debugging backends, which ``list_backends()`` leaves out by default
DEBUG_BACKENDS = ("eager", "aot_eager")


class CompileLayersError(ValueError):
    """``--compile-layers`` cannot be used as asked."""


def backend_name(text):
    """``--compile-layers``'s argument: a ``torch.compile`` backend this torch has."""
    known = sorted({*torch._dynamo.list_backends(exclude_tags=()), *DEBUG_BACKENDS})
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown torch.compile backend {text!r}; choose one of {', '.join(known)}")
    return text


def add_flag(parser):
    """Add ``--compile-layers [BACKEND]`` to a training parser (a group of its own)."""
    if any(FLAG in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group("multipath_nmt: compiled training")
    group.add_argument(
        FLAG, nargs="?", const=DEFAULT_BACKEND, default=None, type=backend_name,
        metavar="BACKEND",
        help="compile every encoder and decoder layer with torch.compile for training "
             f"(backend {DEFAULT_BACKEND} unless named; 'aot_eager' checks tracing without code "
             "generation); validation and beam search stay eager; costs a compile of about "
             "10-40 s per layer class at the start, and whether it pays depends on the device: "
             "multipath-bench --compiled measures it (on a 2-core CPU, 0.81-0.86x eager's speed "
             "for every family but dynamic ParameterNet, 1.10x)")


def layers_of(model):
    """The encoder and decoder layers of a fairseq encoder-decoder ``model``, in order."""
    layers = []
    for part in ("encoder", "decoder"):
        coder = getattr(model, part, None)
        layers.extend(getattr(coder, "layers", None) or [])
    return layers


def _is_training_call(layer, kwargs):
    return layer.training and torch.is_grad_enabled() and kwargs.get("incremental_state") is None


def compile_layer(layer, backend=DEFAULT_BACKEND, dynamic=True):
    """Compile ``layer``'s training forward in place (see the module docstring); returns it."""
    if getattr(layer, "compiled_backend", None) is not None:
        return layer
    eager_forward = layer.forward
    # inductor would draw dropout masks from its own generator (Philox): the same seed would
    # give another run than eager; with fallback_random it draws eager's numbers
    options = dict(fallback_random=True) if backend == "inductor" else None
    compiled_forward = torch.compile(eager_forward, backend=backend, dynamic=dynamic,
                                     options=options)

    @functools.wraps(eager_forward)
    def forward(*args, **kwargs):
        if _is_training_call(layer, kwargs):
            return compiled_forward(*args, **kwargs)
        return eager_forward(*args, **kwargs)

    layer.forward = forward
    layer.compiled_backend = backend
    return layer


def compile_model_layers(model, backend=DEFAULT_BACKEND, dynamic=True):
    """Compile every layer of :func:`layers_of` ``model`` in place; returns how many."""
    layers = layers_of(model)
    for layer in layers:
        compile_layer(layer, backend, dynamic)
    return len(layers)


def asked_backend(cfg):
    """The backend ``--compile-layers`` asked for in a fairseq config, or None. The flag lives in
    the argparse namespace fairseq keeps as ``cfg.model`` (and as the other legacy groups)."""
    for group in ("model", "task", "criterion"):
        section = getattr(cfg, group, None)
        if isinstance(section, argparse.Namespace) and getattr(section, "compile_layers", None):
            return section.compile_layers
    return None


def check(cfg, backend):
    if getattr(getattr(cfg, "model", None), "checkpoint_activations", False):
        raise CompileLayersError(
            f"{FLAG} {backend} does not work with --checkpoint-activations (fairseq's "
            "checkpoint wrapper would split every compiled layer); drop one of the two")


def _add_flag_to_training_parsers(add_optimization_args):
    # get_training_parser calls add_optimization_args after --user-dir is imported (the parser
    # function itself runs before, so wrapping it would miss fairseq-train's own parser)
    @functools.wraps(add_optimization_args)
    def add_optimization_args_and_compile_flag(parser):
        group = add_optimization_args(parser)
        add_flag(parser)
        return group

    return add_optimization_args_and_compile_flag


def _compile_after_init(init):
    @functools.wraps(init)
    def __init__(self, cfg, task, model, criterion, *args, **kwargs):
        backend = asked_backend(cfg)
        if backend is not None:
            check(cfg, backend)
        init(self, cfg, task, model, criterion, *args, **kwargs)
        if backend is not None:
            compile_model_layers(self._model, backend)

    return __init__


def install():
    from fairseq import options
    from fairseq.trainer import Trainer

    wrap(options, "add_optimization_args", _add_flag_to_training_parsers)
    wrap(Trainer, "__init__", _compile_after_init)
