"""SIGTERM, SIGUSR1 or SIGINT during ``fairseq-train``: the update in flight is finished,
checkpoint_last.pt is saved with the iterator position, the process exits with 128 + the signal's
number, and the same command resumes bit-exactly (multipath_nmt/fairseq_patches/preemption.py).

Stock fairseq 0.12 dies at once on SIGTERM and SIGUSR1 and with a KeyboardInterrupt traceback on
SIGINT, and saves nothing. The runs below save no checkpoint of their own between epoch ends
(``--no-epoch-checkpoints``, no ``--save-interval-updates``), so whatever the resume starts from
was saved because of the signal.
"""
import json
import random
import re
import signal
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import clean_env, run_command
from helpers.signals import run_and_signal
from helpers.training import (DUMP_RANKS, SMALL_BATCHES, assert_ranks_identical,
                              assert_same_final_model, comparable_command, load_model_state, run,
                              train_command)

pytestmark = pytest.mark.slow

# The toy corpus makes 38 batches of SMALL_BATCHES per epoch: a signal may land in epoch 1 or 2.
MAX_UPDATE = 50
FLAGS = [*SMALL_BATCHES, "--max-update", MAX_UPDATE, "--no-epoch-checkpoints"]
SAVE_DURING_SAVE = Path(__file__).parent / "helpers" / "train_with_signals_during_save.py"


def _stopped_at(output, save_dir, signum, code):
    """The update the run stopped after, checked against its last line and its checkpoint."""
    assert code == 128 + signum, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    name = signal.Signals(signum).name
    lines = [line for line in output.splitlines() if f"| {name}: stopped after update" in line]
    assert len(lines) == 1, output[-4000:]
    _, updates = load_model_state(save_dir / "checkpoint_last.pt")
    assert f"{name}: stopped after update {updates} (epoch " in lines[0]
    assert lines[0].endswith(f"saved {save_dir / 'checkpoint_last.pt'} for an exact resume (run the "
                             f"same command); exiting with status {128 + signum}")
    assert 0 < updates < MAX_UPDATE
    return updates


def _resume_and_compare(command, save_dir, updates, reference):
    resumed = run(command)
    assert f"Loaded checkpoint {save_dir / 'checkpoint_last.pt'} (epoch " in resumed
    assert f" @ {updates} updates)" in resumed
    assert_same_final_model(save_dir, reference, MAX_UPDATE)


@pytest.mark.parametrize("model", ["baseline", "multipath"])
@pytest.mark.process
def test_sigterm_at_a_random_update_then_resume_is_bit_exact(model, toy_data_bin, tmp_path):
    at = random.Random(f"sigterm {model}").randint(3, MAX_UPDATE - 6)
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted reference runs alongside
        reference = pool.submit(run, train_command(toy_data_bin, tmp_path / "uninterrupted",
                                                   model, *FLAGS))
        command = train_command(toy_data_bin, tmp_path / "stopped", model, *FLAGS)
        code, output = run_and_signal(command, at, signal.SIGTERM)
        updates = _stopped_at(output, tmp_path / "stopped", signal.SIGTERM, code)
        assert updates >= at
        reference.result()
    _resume_and_compare(command, tmp_path / "stopped", updates, tmp_path / "uninterrupted")


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGINT], ids=["SIGUSR1", "SIGINT"])
@pytest.mark.process
def test_sigusr1_and_sigint_stop_the_same_way(signum, toy_data_bin, tmp_path):
    command = train_command(toy_data_bin, tmp_path / "stopped", "baseline", *FLAGS)
    code, output = run_and_signal(command, 4, signum)
    assert _stopped_at(output, tmp_path / "stopped", signum, code) >= 4
    assert "KeyboardInterrupt" not in output


@pytest.mark.process
def test_signals_during_the_save_change_nothing(toy_data_bin, tmp_path):
    """A SIGTERM and a SIGINT arrive while checkpoint_last.pt is being written (after its bytes,
    before its rename): both are logged and ignored, the save completes, and the resume is
    exact."""
    at = random.Random("second signal").randint(3, MAX_UPDATE - 6)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run, train_command(toy_data_bin, tmp_path / "uninterrupted",
                                                   "baseline", *FLAGS))
        command = [sys.executable, str(SAVE_DURING_SAVE),
                   *train_command(toy_data_bin, tmp_path / "stopped", "baseline", *FLAGS)[3:]]
        code, output = run_and_signal(command, at, signal.SIGTERM)
        updates = _stopped_at(output, tmp_path / "stopped", signal.SIGTERM, code)
        reference.result()
    for name in ("SIGTERM", "SIGINT"):
        assert f"{name} received again: ignored, training is already stopping" in output
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == ["checkpoint_last.pt"]
    _resume_and_compare(train_command(toy_data_bin, tmp_path / "stopped", "baseline", *FLAGS),
                        tmp_path / "stopped", updates, tmp_path / "uninterrupted")


TORCHRUN_TIMEOUT = 300
RANK_FLAGS = [*SMALL_BATCHES, "--max-update", 16, "--no-epoch-checkpoints"]


def _ranks_stopped_at(output, save_dir, code):
    """The update a 2-rank torchrun job stopped after on SIGTERM, checked against its log and its
    checkpoint: both workers exit 143, which torchrun reports as a failure, with one traceback
    (its own)."""
    assert code == 1, output[-4000:]
    assert output.count("exitcode  : 143") == 2, output[-4000:]
    assert output.count("Traceback") == 1, output[-4000:]
    _, updates = load_model_state(save_dir / "checkpoint_last.pt")
    assert f"SIGTERM: stopped after update {updates} " in output
    return updates


@pytest.mark.process
def test_two_ranks_stop_after_the_same_update_when_one_is_signalled(toy_data_bin, tmp_path):
    """SIGTERM reaches rank 1 only (which saves nothing itself): both ranks agree on the update,
    rank 0 saves, both exit 143; the resumed 2-rank run ends where one process with
    --update-freq 2 ends that was never interrupted (tests/test_distributed.py)."""
    ddp = tmp_path / "ddp"
    command = comparable_command(toy_data_bin, ddp, "multipath", *RANK_FLAGS, ranks=2)
    at = random.Random("two ranks").randint(3, 10)
    code, output = run_and_signal(command, at, signal.SIGTERM, rank=1, timeout=TORCHRUN_TIMEOUT)
    updates = _ranks_stopped_at(output, ddp, code)
    assert at <= updates < 16
    dumps = sorted(p.name for p in ddp.glob("rank*-update*.pt"))
    assert dumps == [f"rank0-update{updates}.pt", f"rank1-update{updates}.pt"]  # the same update
    assert_ranks_identical(ddp, updates)

    resumed = run(command, timeout=TORCHRUN_TIMEOUT)
    assert f"(epoch 1 @ {updates} updates)" in resumed
    run(comparable_command(toy_data_bin, tmp_path / "single", "multipath", *RANK_FLAGS,
                           "--update-freq", 2))
    assert_same_final_model(ddp, tmp_path / "single", 16)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.process
def test_asynchronous_writes_are_awaited_before_the_exit(ranks, toy_data_bin, tmp_path):
    """--write-checkpoints-asynchronously: the stop waits for ioPath's writer threads, as
    fairseq-train does at its end. Without that, one process shut their pool down under them at
    exit (a traceback, the last write jobs dropped), and a rank's os._exit waits for nothing."""
    save = tmp_path / "stopped"
    command = comparable_command(toy_data_bin, save, "baseline", *RANK_FLAGS,
                                 "--write-checkpoints-asynchronously", ranks=ranks)
    code, output = run_and_signal(command, 3, signal.SIGTERM, rank=None if ranks == 1 else 1,
                                  timeout=TORCHRUN_TIMEOUT)
    if ranks == 1:
        _stopped_at(output, save, signal.SIGTERM, code)
    else:
        _ranks_stopped_at(output, save, code)


@pytest.mark.process
def test_the_stop_names_the_files_it_wrote(toy_data_bin, tmp_path):
    """--write-checkpoints-asynchronously --save-interval-updates 1: fairseq has just saved the
    update the signal stops after, so the stop saves nothing more; its line names the files
    that save wrote (checkpoint_1_N.pt, and checkpoint_last.pt written from the same bytes), each
    complete and at that update, never a checkpoint_last.pt that was not written (fairseq's own
    asynchronous mode copies nothing to it)."""
    save = tmp_path / "stopped"
    command = train_command(toy_data_bin, save, "baseline", *FLAGS, "--save-interval-updates", 1,
                            "--keep-interval-updates", 2, "--write-checkpoints-asynchronously")
    code, output = run_and_signal(command, 4, signal.SIGTERM)
    assert code == 143 and "Traceback" not in output, output[-4000:]
    [line] = [line for line in output.splitlines() if "| SIGTERM: stopped after update" in line]
    updates = int(re.search(r"stopped after update (\d+) ", line).group(1))
    assert line.endswith(f"saved {save / f'checkpoint_1_{updates}.pt'} and {save / 'checkpoint_last.pt'} "
                         "for an exact resume (run the same command); exiting with status 143")
    for name in (f"checkpoint_1_{updates}.pt", "checkpoint_last.pt"):
        assert load_model_state(save / name)[1] == updates


COUNT_SYNCS = Path(__file__).parent / "helpers" / "count_host_syncs_per_update.py"


def _syncs_per_update(toy_data_bin, save_dir, patches):
    command = comparable_command(toy_data_bin, save_dir, "baseline", *SMALL_BATCHES,
                                 "--max-update", 6, "--no-epoch-checkpoints", "--no-save", ranks=2)
    command[command.index(str(DUMP_RANKS))] = str(COUNT_SYNCS)
    run(command, timeout=TORCHRUN_TIMEOUT, env=clean_env(MULTIPATH_NMT_PATCHES=patches))
    return [json.loads((save_dir / f"host-syncs-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.process
def test_the_stop_decision_adds_no_host_sync_per_update(toy_data_bin, tmp_path):
    """Two ranks: every update makes exactly the host syncs it makes without the preemption patch
    (MULTIPATH_NMT_PATCHES=-preemption), counted by HostSyncCounter over train_step and
    validate_and_save. The flag rides in fairseq's own all-reduce of its statistics; a flag of its
    own would add a host-to-device copy, a collective and an .item() per update on every rank.
    That one rank's signal still stops both after the same update:
    test_two_ranks_stop_after_the_same_update_when_one_is_signalled."""
    patched = _syncs_per_update(toy_data_bin, tmp_path / "patched", "on")
    stock = _syncs_per_update(toy_data_bin, tmp_path / "without", "-preemption")
    for rank in (0, 1):
        assert sorted(patched[rank], key=int) == [str(n) for n in range(1, 7)]
        assert {u: c["total"] for u, c in patched[rank].items()} == \
            {u: c["total"] for u, c in stock[rank].items()}, (patched[rank], stock[rank])
        for update, counts in patched[rank].items():
            moved = Counter(counts["by_site"])
            moved.subtract(stock[rank][update]["by_site"])
            moved = {site: n for site, n in moved.items() if n}
            # the patch's one read of the summed statistics replaces fairseq's read of the
            # sample size in train_step (``sample_size or 1.0``), which now gets a number
            assert sorted(moved.values()) == [-1, 1], moved
            assert [site for site, n in moved.items() if n > 0][0].split(":")[0].endswith(
                "preemption.py") and "fairseq/trainer.py" in min(moved, key=moved.get), moved


FAILING_WRITE = Path(__file__).parent / "helpers" / "train_with_a_failing_write.py"


@pytest.mark.process
def test_sigterm_after_a_failed_asynchronous_write_saves_and_exits_143(toy_data_bin, tmp_path):
    """--write-checkpoints-asynchronously: the background write of checkpoint_last.pt at update 4
    fails once (EIO), then SIGTERM. The failure is one line at once; the save's other file is
    still written; the log says "Saved" only for files written; the stop writes
    checkpoint_last.pt at the update it stopped after and exits 143. The failed write must not
    stop the rest of its save (checkpoint_1_4.pt, logged as saved), nor the stop re-raise its
    error (exit 1, nothing on disk)."""
    save = tmp_path / "stopped"
    command = [sys.executable, str(FAILING_WRITE),
               *train_command(toy_data_bin, save, "baseline", *FLAGS, "--save-interval-updates", 4,
                              "--write-checkpoints-asynchronously")[3:]]
    proc = run_command(command, merge_stderr=True, timeout=240)
    output = proc.stdout
    assert proc.returncode == 143 and "Traceback" not in output, output[-4000:]
    last = save / "checkpoint_last.pt"
    [failed] = [line for line in output.splitlines() if "background write failed" in line]
    assert failed.endswith(f"{last}: the background write failed (Input/output error, errno 5); "
                           "training goes on, and the next save or the end of the run writes it "
                           "again (the error stops training if it stays)")
    saved = re.findall(r"Saved checkpoint (\S+)", output)
    assert saved.count(str(save / "checkpoint_1_4.pt")) == 1
    assert "Queued checkpoint " + str(save / "checkpoint_1_4.pt") in output
    # "Saved" follows the failure for checkpoint_last.pt: nothing claims it before it is written
    assert output.index(failed) < output.index(f"Saved checkpoint {last}")
    [line] = [line for line in output.splitlines() if "| SIGTERM: stopped after update" in line]
    updates = int(re.search(r"stopped after update (\d+) ", line).group(1))
    assert line.endswith(f"{last} for an exact resume (run the same command); exiting with status 143")
    assert load_model_state(last)[1] == updates >= 4
    assert load_model_state(save / "checkpoint_1_4.pt")[1] == 4
    assert not list(save.glob("*.tmp"))
