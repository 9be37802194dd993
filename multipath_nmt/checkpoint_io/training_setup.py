"""A resume whose command trains another model, criterion or optimizer than the checkpoint's:
what differs, in one line, and which flag accepts it.

fairseq 0.12's ``Trainer.load_checkpoint`` fails on such a resume with ``Exception("Cannot load
model parameters ...; please ensure that the architectures match.")`` chained to torch's list of
every missing and unexpected key (another ``--arch`` or model flags), or with an
``AssertionError`` "Criterion does not match" / "Optimizer does not match" that names classes,
not flags. :func:`explain_failed_resume` is asked only after fairseq's load has failed, so it
never refuses a checkpoint that loads; it compares the checkpoint's structure
(:func:`~multipath_nmt.checkpoint_io.reading.peek_checkpoint`: names and shapes, no tensor data)
with the trainer's model and fairseq's own test of the criterion and optimizer (their class
names, checked unless ``--reset-optimizer``), and returns a :class:`TrainingSetupMismatchError`
or None when that is not what failed.
"""
from typing import Optional

from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.checkpoint_io.reading import _TensorShape, architecture, peek_checkpoint


class TrainingSetupMismatchError(CheckpointError):
    """The checkpoint was trained with another --arch (or model flags), --criterion or
    --optimizer than the command that resumes it."""


# fairseq's message when the model's state dict does not load (Trainer.load_checkpoint).
_MODEL_LOAD_FAILED = "Cannot load model parameters from checkpoint"
_START_OVER = "give another --save-dir to train from the start"
_RESET = ("pass --reset-optimizer to go on from its weights with a new optimizer state, "
          "learning-rate schedule and update count")


def _name(section) -> Optional[str]:
    """The registered name (``_name``) of a config section: a dict (a checkpoint's), an
    OmegaConf node or a Namespace (the trainer's)."""
    if section is None:
        return None
    value = section.get("_name") if isinstance(section, dict) else getattr(section, "_name", None)
    return value if isinstance(value, str) else None


def _arch(model_cfg) -> Optional[str]:
    value = model_cfg.get("arch") if isinstance(model_cfg, dict) else getattr(model_cfg, "arch", None)
    return value if isinstance(value, str) else _name(model_cfg)


def _model_difference(saved, model):
    """(the first difference between the checkpoint's model tensors ``saved`` (name -> shape) and
    ``model``'s state dict, the number of tensors that differ), or None when names and shapes
    agree."""
    here = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    first, count = None, 0
    for name, shape in saved.items():
        if name not in here:
            first, count = first or f"'{name}' is in the checkpoint only", count + 1
        elif tuple(shape) != here[name]:
            first = first or (f"'{name}' is {list(shape)} in the checkpoint but "
                              f"{list(here[name])} here")
            count += 1
    for name in here:
        if name not in saved:
            first, count = first or f"'{name}' is not in the checkpoint", count + 1
    return (first, count) if count else None


def _component(flag, saved_name, saved_class, name, class_name):
    """``--flag NAME`` for the checkpoint and for this command, with the classes fairseq
    compares when the names alone do not tell them apart (``adam`` under ``--amp``)."""
    if saved_name == name or saved_name is None:
        return f"{flag} {saved_name or '?'} ({saved_class})", f"{flag} {name} ({class_name})"
    return f"{flag} {saved_name}", f"{flag} {name}"


def explain_failed_resume(path, trainer, reset_optimizer, error) -> Optional[CheckpointError]:
    """The one-line error for fairseq's failed ``trainer.load_checkpoint(path, ...)`` (``error``)
    when the checkpoint's model, criterion or optimizer is not this command's, else None."""
    path = str(path)
    if "://" in path:
        return None
    try:
        state = peek_checkpoint(path)
    except (CheckpointError, OSError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return None
    cfg = state.get("cfg") if isinstance(state.get("cfg"), dict) else {}
    differences = []
    model_differs = _MODEL_LOAD_FAILED in str(error)
    if model_differs:
        saved = {name: tensor.shape for name, tensor in state["model"].items()
                 if isinstance(tensor, _TensorShape)}
        found = _model_difference(saved, trainer.get_model())
        if found is None:
            return None  # the names and shapes agree: something else failed
        first, count = found
        more = f" (and {count - 1} more tensors differ)" if count > 1 else ""
        differences.append(f"its model (--arch {architecture(state) or '?'}) has other parameters "
                           f"than this command's (--arch {_arch(trainer.cfg.model) or '?'}): "
                           f"{first}{more}")
    history = state.get("optimizer_history") or [{}]
    last = history[-1] if isinstance(history[-1], dict) else {}
    if not reset_optimizer and state.get("last_optimizer_state") is not None and last:
        saved_side, here_side = [], []
        for flag, key, section in (("--criterion", "criterion_name", "criterion"),
                                   ("--optimizer", "optimizer_name", "optimizer")):
            class_name = _class_name(trainer, section)
            if class_name is not None and last.get(key) != class_name:
                saved_as, here_as = _component(flag, _name(cfg.get(section)), last.get(key),
                                               _name(getattr(trainer.cfg, section, None)),
                                               class_name)
                saved_side.append(saved_as)
                here_side.append(here_as)
        if saved_side:
            differences.append(f"its optimizer state was saved with {' and '.join(saved_side)}, "
                               f"not this command's {' and '.join(here_side)}")
    if not differences:
        return None
    if not model_differs:
        return TrainingSetupMismatchError(path, f"{differences[0]}: {_RESET}, or {_START_OVER}")
    flags = "the checkpoint's --arch and model flags" if len(differences) == 1 else \
        "the checkpoint's flags for these"
    return TrainingSetupMismatchError(path, f"{'; and '.join(differences)}; resume with {flags}, "
                                            f"or give another --save-dir to train this model "
                                            f"from the start")


def _class_name(trainer, section):
    """The class name fairseq records for the trainer's criterion or optimizer; the optimizer
    is built for it if the failed load had not got that far (None if that fails too)."""
    if section == "criterion":
        return type(trainer.get_criterion()).__name__
    try:
        return type(trainer.optimizer).__name__
    except Exception:  # noqa: BLE001 - only a description: fairseq's own error is chained
        return None
