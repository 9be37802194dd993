"""multipath_nmt.fairseq_patches: one install(), idempotent, in a stated order, and its table names
tests that exist."""
import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest

from helpers.patch_switch import patched_attributes
from multipath_nmt import fairseq_patches
from multipath_nmt.fairseq_patches import (ewa_trainer, mixed_precision, numerics, out_of_memory,
                                           preemption)
from multipath_nmt.fairseq_patches.wrapping import patch_name, patches_of, wrap

TESTS = Path(__file__).parent


_patched_attributes = patched_attributes


def test_install_twice_wraps_nothing_again():
    before = {(id(owner), name): getattr(owner, name) for owner, name in _patched_attributes()}
    fairseq_patches.install()
    fairseq_patches.install()
    for owner, name in _patched_attributes():
        current = getattr(owner, name)
        assert current == before[(id(owner), name)], name
        marks = patches_of(current)
        assert marks and len(set(marks)) == len(marks), (name, marks)


def test_train_step_is_wrapped_by_numerics_then_mixed_precision_then_ewa():
    from fairseq.trainer import Trainer

    # preemption marks the step outermost, for its all-reduce of the stop flag; the
    # weight casts kept over the update also serve numerics' re-run of a non-finite update;
    # out_of_memory, next to numerics, turns the out-of-memory error it lets pass into one line
    assert patches_of(Trainer.train_step) == (
        patch_name(numerics._report_update),
        patch_name(out_of_memory._stopping_on_out_of_memory),
        patch_name(mixed_precision._weights_cast_once_per_update),
        patch_name(ewa_trainer._flagging_train_step), patch_name(preemption._in_train_step))


def test_wrap_keeps_static_and_class_methods_and_marks_each_patch():
    class Owner:
        @staticmethod
        def static(x):
            return x

        @classmethod
        def made_by(cls):
            return cls

    def plus_one(original):
        return lambda x: original(x) + 1

    def named(original):
        return lambda *args: ("named", original(*args))

    assert wrap(Owner, "static", plus_one)
    assert not wrap(Owner, "static", plus_one)
    assert wrap(Owner, "static", named)
    assert Owner.static(1) == ("named", 2) and Owner().static(1) == ("named", 2)
    assert patches_of(Owner.static) == (patch_name(plus_one), patch_name(named))
    assert wrap(Owner, "made_by", named)
    assert Owner.made_by() == ("named", Owner)


def _every_wrap_table():
    """The rows of docs/patches.md's "Every wrap" table, the one home of that list: (module,
    what is patched, the rest of the row)."""
    doc = (TESTS.parent / "docs" / "patches.md").read_text()
    section = doc[doc.index("## Every wrap"):doc.index("### Why each is a wrap")]
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (.*) \|$", section, re.M)
    assert rows, "no rows in docs/patches.md's Every wrap table"
    return section, rows


def test_the_table_names_tests_that_exist():
    section, _ = _every_wrap_table()
    named = re.findall(r"tests/(test_\w+\.py)::(test_\w+)", section)
    assert len(named) >= 20
    for file, test in named:
        source = (TESTS / file).read_text()
        assert re.search(rf"^def {test}\(", source, re.M), f"{file}::{test}"


def test_the_table_lists_every_patch_module():
    _, rows = _every_wrap_table()
    assert {module for module, _, _ in rows} == set(fairseq_patches.NAMES)


def _every_wrap(monkeypatch):
    """(module, target) of every wrap install() makes in a fresh process without apex: what
    every module's install() asks for under planning() (grad_norm as without apex)."""
    from fairseq import utils

    import fairseq_cli.train  # noqa: F401  (preemption and save_dirs wrap it where it is loaded)
    from multipath_nmt.fairseq_patches import grad_norm
    from multipath_nmt.fairseq_patches.wrapping import planning

    monkeypatch.setattr(utils, "multi_tensor_l2norm_available", False)
    monkeypatch.setattr(grad_norm, "foreach_takes_dtype", lambda: True)
    with planning() as plan:
        for module in fairseq_patches.MODULES:
            module.install()
    return [(module, target) for module, target, _ in plan]


def test_every_wrap_has_its_row_in_the_table_and_the_counts_are_the_docs(monkeypatch):
    """Each wrap the code makes is named in a row of its module (docs/patches.md, "Every wrap"),
    each attribute a row names is wrapped by that module, and the counts the page gives are the
    code's."""
    wraps = _every_wrap(monkeypatch)
    section, rows = _every_wrap_table()
    named = {(module, target) for module, patched, _ in rows
             for target in re.findall(r"`([\w.]+)`", patched)}
    assert sorted(set(wraps) - named) == []
    # what a row names that is no wrap: torch_compat's allow-list, grad_norm's flag
    assert named - set(wraps) == {("torch_compat", "torch.serialization"),
                                  ("grad_norm", "utils.multi_tensor_l2norm_available")}
    trainer = [target for _, target in wraps if target.startswith("Trainer.")]
    private = {target for _, target in wraps if target.rsplit(".", 1)[1].startswith("_")
               and not target.endswith(".__init__")}
    hooks = [target for _, target in wraps if target == "sys.excepthook"]
    assert (f"makes {len(wraps)} wraps of {len({t for _, t in wraps})} attributes: "
            f"{len(trainer)} of them wrap `Trainer` ({len(set(trainer))} of its methods), "
            f"{len(hooks)} `sys.excepthook`, and {len(private)} targets are private") \
        in " ".join(section.split())


# The values of MULTIPATH_NMT_PATCHES the tests below look at, all probed by one process.
SWITCH_VALUES = ("on", "off", "no", "-attention,-preemption", "-atention", "attention",
                 *(f"-{name}" for name in fairseq_patches.NAMES))


@pytest.fixture(scope="module")
def switch_runs():
    """value -> what importing the plug-in under ``MULTIPATH_NMT_PATCHES=value`` did, each in a
    process of its own (forked after fairseq's import: tests/helpers/patch_switch.py)."""
    from conftest import run_command

    proc = run_command([sys.executable, TESTS / "helpers" / "patch_switch.py", *SWITCH_VALUES],
                       cwd=TESTS, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {value: types.SimpleNamespace(**run) for value, run in
            json.loads(proc.stdout.splitlines()[-1]).items()}


def test_the_switch_turns_every_patch_off(switch_runs):
    """MULTIPATH_NMT_PATCHES=off: none of the attributes the patches replace is wrapped, the
    plug-in's models still register, and a wrong value is refused in one line."""
    runs = switch_runs
    assert runs["off"].returncode == 0 and (runs["off"].wrapped, runs["off"].registered) == (0, True)
    assert "MULTIPATH_NMT_PATCHES=off: fairseq runs without the plug-in's patches" in \
        runs["off"].stderr
    assert runs["on"].wrapped >= len(_patched_attributes()) and runs["on"].registered
    assert runs["no"].returncode != 0
    assert "ValueError: MULTIPATH_NMT_PATCHES must be 'on' or 'off', got 'no'" in runs["no"].stderr
    assert runs["on"].modules == sorted(fairseq_patches.NAMES)
    assert runs["off"].modules == [] and not runs["off"].namespace_allowed


@pytest.mark.parametrize("name", fairseq_patches.NAMES)
def test_a_minus_name_leaves_out_that_patch_module_only(name, switch_runs):
    """MULTIPATH_NMT_PATCHES=-NAME: none of NAME's wrappers is in place, every other module's
    are, the models register, and the warning names what is off."""
    run = switch_runs[f"-{name}"]
    assert run.returncode == 0 and run.registered
    assert run.modules == sorted(set(fairseq_patches.NAMES) - {name})
    assert run.stderr == (f"MULTIPATH_NMT_PATCHES=-{name}: fairseq runs without the plug-in's "
                          f"patches {name}\n")
    # torch_compat's allow-list is no wrapper: it goes with the module too
    assert run.namespace_allowed == (name != "torch_compat")


def test_several_names_leave_out_each(switch_runs):
    run = switch_runs["-attention,-preemption"]
    assert run.returncode == 0 and run.registered
    assert run.modules == sorted(set(fairseq_patches.NAMES) - {"attention", "preemption"})


def test_an_unknown_name_is_refused_with_the_known_ones(switch_runs):
    known = ", ".join(fairseq_patches.NAMES)
    last_line = switch_runs["-atention"].stderr.strip().splitlines()[-1]
    assert switch_runs["-atention"].returncode != 0
    assert last_line == ("ValueError: MULTIPATH_NMT_PATCHES=-atention: unknown patch 'atention'; "
                         f"known patches: {known}")
    # a name without its minus: only exclusions are offered, and the message says how
    last_line = switch_runs["attention"].stderr.strip().splitlines()[-1]
    assert switch_runs["attention"].returncode != 0
    assert last_line == ("ValueError: MULTIPATH_NMT_PATCHES must be 'on' or 'off', got "
                         "'attention'; or -NAME,-NAME to leave out some patches, NAME one of "
                         f"{known}")


def test_the_names_are_the_modules_and_the_docs_list_each():
    assert fairseq_patches.NAMES == tuple(module.__name__.rsplit(".", 1)[1]
                                          for module in fairseq_patches.MODULES)
    doc = (TESTS.parent / "docs" / "patches.md").read_text()
    switches = doc[doc.index("## Turning patches off"):]
    for name in fairseq_patches.NAMES:
        assert f"`-{name}`" in switches, name


@pytest.mark.parametrize("value, in_force", [
    ("off", "none"),
    ("-attention,-preemption", ", ".join(n for n in fairseq_patches.NAMES
                                         if n not in ("attention", "preemption"))),
])
@pytest.mark.parametrize("fairseq_command, level", [(True, logging.INFO), (False, logging.DEBUG)])
def test_install_logs_the_patches_in_force(monkeypatch, caplog, value, in_force,
                                           fairseq_command, level):
    """One line: INFO in a fairseq command (a fairseq-train log has it at its start:
    tests/test_compat.py), DEBUG elsewhere, so that our tools print nothing of it."""
    monkeypatch.setenv("MULTIPATH_NMT_PATCHES", value)
    monkeypatch.setattr(fairseq_patches, "running_a_fairseq_command", lambda: fairseq_command)
    with caplog.at_level(logging.DEBUG, logger="multipath_nmt.fairseq_patches"):
        fairseq_patches.install()  # every patch is already in place: nothing is wrapped again
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno <= logging.INFO] == [
        (level, f"patches in force: {in_force} (MULTIPATH_NMT_PATCHES switches them)")]


@pytest.mark.parametrize("main_spec, argv0, expected", [
    ("fairseq_cli.train", "/x/fairseq_cli/train.py", True),  # python -m fairseq_cli.train
    (None, "/venv/bin/fairseq-train", True),
    (None, "/venv/bin/fairseq-generate", True),
    (None, "/venv/bin/multipath-score", False),
    ("pytest", "/x/pytest/__main__.py", False),
])
def test_a_fairseq_command_is_told_from_our_tools(monkeypatch, main_spec, argv0, expected):
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=main_spec) if main_spec else None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0])
    assert fairseq_patches.running_a_fairseq_command() is expected
