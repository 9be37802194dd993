"""The plug-in makes fairseq checkpoints load on PyTorch >= 2.6 while keeping weights_only
(multipath_nmt.fairseq_patches.torch_compat), copies checkpoints atomically and keeps every
sentence in a batch (fairseq_patches.checkpoints, fairseq_patches.batching)."""
import pickle
import sys

import pytest
import torch

from conftest import TOY_BASELINE, USER_DIR, copy_run, run_cli, run_fairseq

from multipath_nmt import fairseq_patches
from multipath_nmt.checkpoint_io import UntrustedCheckpointError
from multipath_nmt.fairseq_patches import checkpoints as checkpoint_patches


class NotAllowListed:
    pass


@pytest.fixture(scope="module")
def trained(toy_baseline_run, toy_data_bin, tmp_path_factory):
    """(the flags that resume it, its save dir, None): the session's 3-update baseline, copied
    because the resume test trains on in it."""
    save = copy_run(toy_baseline_run, tmp_path_factory.mktemp("compat"))
    common = [toy_data_bin, *TOY_BASELINE, "--save-dir", save]
    return common, save, None


def test_namespace_is_allowed_and_nothing_more(trained, tmp_path):
    from fairseq import checkpoint_utils

    _, save, _ = trained
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save / "checkpoint_last.pt"))
    assert state["cfg"]["model"].arch == "transformer_prenorm_wmt_en_de"  # an argparse.Namespace

    raw = torch.load(save / "checkpoint_last.pt", weights_only=False)
    raw["extra_state"]["evil"] = NotAllowListed()
    path = tmp_path / "untrusted.pt"
    torch.save(raw, path)
    with pytest.raises(UntrustedCheckpointError) as err:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    message = str(err.value)
    assert "test_compat.NotAllowListed" in message
    assert "MULTIPATH_NMT_TRUST_GLOBALS=test_compat.NotAllowListed" in message


def test_weights_only_protection_stays_on(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"x": NotAllowListed()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)


def test_atomic_copy_leaves_no_partial_file(tmp_path, monkeypatch):
    from fairseq.file_io import PathManager

    src = tmp_path / "checkpoint1.pt"
    src.write_bytes(b"new" * 1000)
    dst = tmp_path / "checkpoint_last.pt"
    dst.write_bytes(b"old")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # a kill in the middle of the copy

    monkeypatch.setattr(checkpoint_patches.shutil, "copyfileobj", crash)
    with pytest.raises(KeyboardInterrupt):
        PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint1.pt", "checkpoint_last.pt"]
    monkeypatch.undo()
    assert PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.process  # a fresh fairseq-train's log: the patches the plug-in's import installs
def test_train_resume_and_generate_without_environment(trained, toy_data_bin):
    """Stock fairseq on torch >= 2.6 cannot resume; through the plug-in it can."""
    common, save, _ = trained
    resumed = run_cli([sys.executable, "-m", "fairseq_cli.train", *common, "--max-update", "6",
                       "--user-dir", USER_DIR])
    log = resumed.stderr + resumed.stdout
    assert "Loaded checkpoint" in log and "num_updates 6" in log
    assert (f"| INFO | multipath_nmt.fairseq_patches | patches in force: {', '.join(fairseq_patches.NAMES)} "
            "(MULTIPATH_NMT_PATCHES switches them)\n") in log
    out = run_fairseq("generate", toy_data_bin, "--path", save / "checkpoint_last.pt",
                      "--beam", "2", "--max-len-b", "10", "--cpu", "--max-sentences", "8")
    assert out.stdout.count("\nH-") == 40


@pytest.mark.parametrize("batch_size,multiple", [(128, 8), (7, 8), (10, 3), (1, 1)])
def test_batching_keeps_every_sentence(batch_size, multiple):
    """fairseq 0.12 dropped the last batch when it was not a multiple of
    --required-batch-size-multiple (500 sentences, batch 128: 496 translated)."""
    import numpy as np
    from fairseq.data import data_utils

    indices = np.random.RandomState(0).permutation(500)
    sizes = np.random.RandomState(1).randint(3, 30, size=500)
    batches = data_utils.batch_by_size(indices, sizes.__getitem__, num_tokens_vec=sizes[indices],
                                       max_sentences=batch_size,
                                       required_batch_size_multiple=multiple)
    assert np.array_equal(np.concatenate(batches), indices)
    assert all(len(b) <= batch_size for b in batches)


def test_generate_translates_every_test_sentence(trained, toy_data_bin):
    """40 test sentences in batches of 16: fairseq 0.12 alone prints 32 of them."""
    _, save, _ = trained
    out = run_fairseq("generate", toy_data_bin, "--path", save / "checkpoint_last.pt",
                      "--beam", "1", "--max-len-b", "10", "--cpu", "--batch-size", "16",
                      "--required-batch-size-multiple", "16")
    assert out.stdout.count("\nH-") == 40
