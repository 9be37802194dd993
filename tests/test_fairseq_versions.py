"""The patches know their fairseq (multipath_nmt/fairseq_patches/wrapping.py): a fairseq they are
not tested on, and an attribute a patch would wrap that is missing or not callable, are refused in
one line before anything is wrapped; ``MULTIPATH_NMT_PATCHES=off`` and
``MULTIPATH_NMT_UNTESTED_FAIRSEQ=1`` are the ways past it."""
import importlib.metadata
import inspect
import logging
import sys

import fairseq
import pytest

from multipath_nmt import fairseq_patches
from multipath_nmt.fairseq_patches import wrapping
from multipath_nmt.fairseq_patches.wrapping import (KNOWN_FAIRSEQ, PatchRefusedError,
                                                    installed_fairseq, patch_name, patches_of,
                                                    wrap)

KNOWN = "fairseq-fixed 0.12.3.1 and ve-fairseq 0.12.3"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No switch from the caller's environment; a refusal's hook is taken off again after."""
    for variable in (wrapping.SWITCH, wrapping.UNTESTED_SWITCH):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)


class _Distribution:
    """What ``importlib.metadata.distribution(name)`` returns, for a build that installed the
    ``fairseq`` package this process imports."""

    def __init__(self, version):
        self.version = version

    def locate_file(self, path):
        assert path == "fairseq/__init__.py"
        return fairseq.__file__


def _fake_fairseq(monkeypatch, version, distributions=()):
    """This process's fairseq says ``version``, and was installed by ``distributions`` (names);
    with none, by a distribution named fairseq (stock fairseq from PyPI)."""
    monkeypatch.setattr(fairseq, "__version__", version)

    def distribution(name):
        if name in distributions:
            return _Distribution(version)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        lambda: {"fairseq": list(distributions) or ["fairseq"]})


def _recording_installs(monkeypatch):
    """Replace every patch module's install() by one that records its name."""
    called = []
    for name, module in zip(fairseq_patches.NAMES, fairseq_patches.MODULES):
        monkeypatch.setattr(module, "install", lambda name=name: called.append(name))
    return called


def test_the_fairseq_of_this_venv_is_known():
    assert installed_fairseq() in KNOWN_FAIRSEQ
    assert KNOWN == " and ".join(f"{name} {version}" for name, version in KNOWN_FAIRSEQ)


@pytest.mark.parametrize("distributions, version, found", [
    (("fairseq-fixed",), "0.12.3.1", ("fairseq-fixed", "0.12.3.1")),
    (("ve-fairseq",), "0.12.3", ("ve-fairseq", "0.12.3")),
    # one installed over the other: both records claim the files; the code's version decides
    (("fairseq-fixed", "ve-fairseq"), "0.12.3", ("ve-fairseq", "0.12.3")),
    (("fairseq-fixed", "ve-fairseq"), "0.12.3.1", ("fairseq-fixed", "0.12.3.1")),
    ((), "0.12.2", ("fairseq", "0.12.2")),
    (("ve-fairseq",), "0.12.2", ("ve-fairseq", "0.12.2")),
])
def test_the_installed_fairseq_is_its_distribution_and_the_codes_version(
        monkeypatch, distributions, version, found):
    _fake_fairseq(monkeypatch, version, distributions)
    assert installed_fairseq() == found


@pytest.mark.parametrize("name", fairseq_patches.NAMES)
def test_every_patch_refuses_an_untested_fairseq_in_one_line_before_any_work(monkeypatch, name):
    """Only NAME in force (``-`` every other one): on fairseq 0.12.2 NAME refuses, naming itself
    and the versions it knows, before any module installs."""
    _fake_fairseq(monkeypatch, "0.12.2")
    others = [other for other in fairseq_patches.NAMES if other != name]
    monkeypatch.setenv("MULTIPATH_NMT_PATCHES", ",".join(f"-{other}" for other in others))
    called = _recording_installs(monkeypatch)
    with pytest.raises(PatchRefusedError) as refused:
        fairseq_patches.install()
    assert str(refused.value) == (
        f"multipath_nmt's patch {name} is tested with {KNOWN}, not with fairseq 0.12.2: "
        "MULTIPATH_NMT_UNTESTED_FAIRSEQ=1 installs anyway, MULTIPATH_NMT_PATCHES=off runs "
        "fairseq unpatched")
    assert called == []
    # the hook that prints it on one line went in just before it was raised
    assert patches_of(sys.excepthook)[-1] == patch_name(wrapping.one_line_refusals)


def test_all_patches_refuse_an_untested_fairseq_in_one_line(monkeypatch):
    _fake_fairseq(monkeypatch, "0.13.0", ["fairseq"])
    called = _recording_installs(monkeypatch)
    with pytest.raises(PatchRefusedError) as refused:
        fairseq_patches.install()
    assert str(refused.value) == (
        f"multipath_nmt's patches (all {len(fairseq_patches.NAMES)}) are tested with {KNOWN}, not "
        "with fairseq 0.13.0: MULTIPATH_NMT_UNTESTED_FAIRSEQ=1 installs anyway, "
        "MULTIPATH_NMT_PATCHES=off runs fairseq unpatched")
    assert called == []


def test_two_patches_are_named_both(monkeypatch):
    _fake_fairseq(monkeypatch, "0.12.2")
    monkeypatch.setenv("MULTIPATH_NMT_PATCHES", ",".join(
        f"-{n}" for n in fairseq_patches.NAMES if n not in ("batching", "attention")))
    with pytest.raises(PatchRefusedError, match="^multipath_nmt's patches batching, attention are "
                                                "tested with "):
        fairseq_patches.install()


@pytest.mark.parametrize("version, distributions", [("0.12.3.1", ["fairseq-fixed"]),
                                                    ("0.12.3", ["ve-fairseq"])])
def test_a_known_fairseq_installs_every_patch(monkeypatch, version, distributions):
    _fake_fairseq(monkeypatch, version, distributions)
    called = _recording_installs(monkeypatch)
    fairseq_patches.install()
    # once to check every wrap (planning), once to wrap
    assert called == [*fairseq_patches.NAMES, *fairseq_patches.NAMES]


def test_off_checks_no_version(monkeypatch):
    _fake_fairseq(monkeypatch, "0.12.2")
    monkeypatch.setenv("MULTIPATH_NMT_PATCHES", "off")
    assert _recording_installs(monkeypatch) == [] and fairseq_patches.install() is None


def test_the_override_tries_an_untested_fairseq_with_one_warning(monkeypatch, caplog):
    _fake_fairseq(monkeypatch, "0.12.2")
    monkeypatch.setenv("MULTIPATH_NMT_UNTESTED_FAIRSEQ", "1")
    called = _recording_installs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="multipath_nmt.fairseq_patches"):
        fairseq_patches.install()
    assert called == [*fairseq_patches.NAMES, *fairseq_patches.NAMES]
    assert [r.getMessage() for r in caplog.records] == [
        f"MULTIPATH_NMT_UNTESTED_FAIRSEQ=1: trying the patches on fairseq 0.12.2, not tested "
        f"(tested: {KNOWN})"]


def test_wrap_refuses_a_missing_or_uncallable_target_in_one_line():
    class Trainer:
        cfg = None

    def _wrapper(original):
        return original

    _wrapper.__module__ = "multipath_nmt.fairseq_patches.numerics"
    found = " ".join(installed_fairseq())
    for name, what in (("train_step", "no such attribute"), ("cfg", "a NoneType, not callable")):
        with pytest.raises(PatchRefusedError) as refused:
            wrap(Trainer, name, _wrapper)
        assert str(refused.value) == (
            f"multipath_nmt's patch numerics cannot wrap Trainer.{name}: {what} in {found} "
            f"(tested: {KNOWN}); MULTIPATH_NMT_PATCHES=-numerics leaves that patch out, "
            "MULTIPATH_NMT_PATCHES=off all of them")
    assert not hasattr(Trainer, "train_step")


def test_a_missing_target_is_refused_before_any_patch_is_wrapped(monkeypatch):
    """out_of_memory wraps ``Trainer._sync_stats``; without it, install() refuses before numerics
    (installed first) has wrapped ``Trainer.train_step``."""
    from fairseq.trainer import Trainer

    fairseqs_train_step = inspect.unwrap(Trainer.train_step)
    monkeypatch.setattr(Trainer, "train_step", fairseqs_train_step)
    monkeypatch.delattr(Trainer, "_sync_stats")
    with pytest.raises(PatchRefusedError, match=r"^multipath_nmt's patch out_of_memory cannot "
                                                r"wrap Trainer._sync_stats: no such attribute"):
        fairseq_patches.install()
    assert Trainer.train_step is fairseqs_train_step and patches_of(Trainer.train_step) == ()


def test_planning_checks_and_records_every_wrap_and_replaces_nothing():
    from fairseq.trainer import Trainer

    before = Trainer.train_step
    with wrapping.planning() as plan:
        for module in fairseq_patches.MODULES:
            module.install()
    assert Trainer.train_step is before
    assert [(module, patch) for module, target, patch in plan if target == "Trainer.train_step"] \
        == [(name.split(".")[2], name) for name in patches_of(before)]


@pytest.mark.process  # a fresh fairseq-train, whose plug-in import refuses
def test_fairseq_train_on_an_untested_fairseq_says_one_line():
    """A fresh ``fairseq-train --user-dir multipath_nmt`` whose fairseq says 0.12.2: one line on
    stderr, status 1, before it reads its data."""
    from conftest import USER_DIR, run_command

    code = ("import sys, fairseq\n"
            "fairseq.__version__ = '0.12.2'\n"
            f"sys.argv = ['fairseq-train', '--user-dir', {str(USER_DIR)!r}, '/no/such/data-bin']\n"
            "from fairseq_cli.train import cli_main\n"
            "cli_main()\n")
    proc = run_command([sys.executable, "-c", code], timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    found = installed_fairseq()[0]
    assert proc.stderr == (
        f"fairseq-train: error: multipath_nmt's patches (all {len(fairseq_patches.NAMES)}) are "
        f"tested with {KNOWN}, not with {found} 0.12.2: MULTIPATH_NMT_UNTESTED_FAIRSEQ=1 installs "
        "anyway, MULTIPATH_NMT_PATCHES=off runs fairseq unpatched\n")
