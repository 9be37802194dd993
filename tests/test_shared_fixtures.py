"""The suite's trained fixtures are built once per run, also when pytest-xdist's workers all ask
for them (``built_once`` in tests/conftest.py)."""
import os
import uuid

import pytest

from conftest import built_once


def test_a_folder_is_built_once_and_read_by_every_later_request(tmp_path_factory):
    name, builds = f"once-{uuid.uuid4().hex}", []

    def build(folder):
        builds.append(folder)
        (folder / "model.pt").write_text("trained")

    first = built_once(tmp_path_factory, name, build)
    assert built_once(tmp_path_factory, name, build) == first
    assert builds == [first] and (first / "model.pt").read_text() == "trained"
    run_folder = tmp_path_factory.getbasetemp()
    assert first.parent == (run_folder.parent if os.environ.get("PYTEST_XDIST_WORKER")
                            else run_folder)


def test_workers_share_the_run_folder_and_a_failed_build_starts_afresh(tmp_path_factory,
                                                                      monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    name = f"once-{uuid.uuid4().hex}"

    def fails(folder):
        (folder / "half-written.pt").write_text("")
        raise RuntimeError("the training failed")

    with pytest.raises(RuntimeError, match="the training failed"):
        built_once(tmp_path_factory, name, fails)
    folder = built_once(tmp_path_factory, name, lambda f: (f / "model.pt").write_text("ok"))
    # beside the workers' own folders, where every worker of the run finds it
    assert folder.parent == tmp_path_factory.getbasetemp().parent
    assert sorted(p.name for p in folder.iterdir()) == ["model.pt"]
