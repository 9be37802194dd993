"""scripts/train.sh on more than one GPU runs what it prints: torchrun, one process per GPU,
fairseq-train in each (not fairseq's own torch.multiprocessing.spawn, under which a SIGTERM to
the parent never reaches the workers and a worker's exit 143 makes the parent exit 1).

Two CPU processes over gloo stand in for 2 GPUs: ``MULTIPATH_NMT_NUM_GPUS=2`` sets the count and
``MULTIPATH_NMT_DDP_ON_CPU=1`` only swaps the device flags (``--cpu --distributed-backend gloo``,
fp32) in the command train.sh builds and runs. For each model family: the run trains; a SIGTERM
to train.sh (what SLURM and Kubernetes send) reaches both workers, which stop after the same
update, rank 0 saves once, and train.sh exits 143; the same command resumes to parameters
bit-identical to an uninterrupted run. The multi-node command of docs/troubleshooting.md (its
SLURM form) runs as two launchers of one process each, with a c10d rendezvous on this machine.
"""
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL, run_command, script_env
from helpers.signals import alive, run_and_signal, worker_of_rank
from helpers.training import (UPDATE_LOGGED, _fail, assert_same_final_model, free_port, kill_tree,
                              load_model_state, read_until, run, run_until_killed, started)

pytestmark = pytest.mark.slow

TRAIN_SH = ROOT / "scripts" / "train.sh"
TIMEOUT = 400
MAX_UPDATE = 12
# fairseq-train flags after the recipe's (they override it): a tiny model, small batches (the toy
# corpus makes 19 updates per epoch on 2 ranks), no checkpoint but the one the signal saves.
SHORT_RUN = ["--max-tokens", "400", "--batch-size", "8", "--required-batch-size-multiple", "1",
             "--update-freq", "1", "--max-update", MAX_UPDATE, "--no-epoch-checkpoints",
             "--disable-validation", "--num-workers", "0", "--seed", "1", "--no-progress-bar",
             "--log-format", "simple", "--log-interval", "1"]
FAMILIES = {
    "baseline": ["--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL],
    "multipath": ["--arch", "multipath_transformer_wmt_en_de", *TINY_MODEL, "--encoder-paths", "3",
                  "--cheap-features", "--decoder-paths", "2"],
    # a routed top-2 MoE FFN in encoder layer 2 of 2, its balance loss in the recipe's criterion
    "moe": ["--arch", "moe_transformer_wmt_en_de", *TINY_MODEL],
    "parameternet": ["--arch", "parameternet_transformer_wmt_en_de", *TINY_MODEL,
                     "--parameternet-mode", "routed", "--parameternet-proj", "both"],
}


def gloo_env(gpus):
    return ["env", f"PYTHON={sys.executable}", f"PYTHON_EXEC={sys.executable}",
            f"MULTIPATH_NMT_NUM_GPUS={gpus}", "MULTIPATH_NMT_DDP_ON_CPU=1"]


def train_sh(data_bin, save_dir, family, gpus=2):
    """train.sh as a user runs it, through ``env`` (which execs it: the pid is train.sh's)."""
    return [*gloo_env(gpus), "bash", str(TRAIN_SH), str(data_bin), str(save_dir),
            *FAMILIES[family], *map(str, SHORT_RUN)]


def printed_command(output):
    """The command train.sh printed (its last ``train.sh: `` line before fairseq's output)."""
    return shlex.split([line for line in output.splitlines()
                        if line.startswith("train.sh: ") and "fairseq_cli.train" in line][0][10:])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.process
def test_train_sh_on_two_ranks_trains_stops_on_sigterm_and_resumes_exactly(family, toy_data_bin,
                                                                             tmp_path):
    reference = run(train_sh(toy_data_bin, tmp_path / "uninterrupted", family), timeout=TIMEOUT)
    words = printed_command(reference)
    assert words[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert words[6:8] == ["-m", "fairseq_cli.train"]
    assert "--cpu" in words and words[words.index("--distributed-backend") + 1] == "gloo"
    assert reference.count("distributed init (rank ") == 2
    _, updates = load_model_state(tmp_path / "uninterrupted" / "checkpoint_last.pt")
    assert updates == MAX_UPDATE

    command = train_sh(toy_data_bin, tmp_path / "stopped", family)
    at = random.Random(f"launcher {family}").randint(2, MAX_UPDATE - 6)
    code, output = run_and_signal(command, at, signal.SIGTERM, timeout=TIMEOUT)  # to train.sh
    assert code == 143, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    # the launcher passed the signal on to both workers; they stopped after the same update
    assert output.count("SIGTERM received: training stops after the update in flight") == 2, \
        output[-6000:]
    assert output.count("exitcode  : 143") == 0  # no torchrun failure report
    assert "train.sh: every worker stopped on SIGTERM (status 143); run the same command to " \
           "resume" in output
    _, stopped_at = load_model_state(tmp_path / "stopped" / "checkpoint_last.pt")
    assert at <= stopped_at < MAX_UPDATE
    assert output.count(f"SIGTERM: stopped after update {stopped_at} (epoch 1") == 1
    assert len(re.findall(r"Saved checkpoint \S+checkpoint_last\.pt", output)) == 1  # rank 0, once
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == [
        "checkpoint_last.pt", "train-sh-batch.json"]  # and train.sh's record of its micro-batch

    resumed = run(command, timeout=TIMEOUT)
    assert f"(epoch 1 @ {stopped_at} updates)" in resumed
    assert_same_final_model(tmp_path / "stopped", tmp_path / "uninterrupted", MAX_UPDATE)


def slurm_command():
    """The ``srun scripts/train.sh ...`` command of docs/troubleshooting.md's multi-node job."""
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    block = re.search(r"#SBATCH --nodes=2.*?\n```", text, re.S).group(0)
    lines = block.replace("\\\n", " ").splitlines()
    line = [line for line in lines if line.startswith("srun ")]
    assert len(line) == 1, block
    return line[0][len("srun "):]


@pytest.mark.process
def test_the_documented_multi_node_command_runs_as_two_launchers(toy_data_bin, tmp_path):
    """Two nodes of one process each (SLURM's srun starts train.sh once per node), a c10d
    rendezvous on this machine; a SIGTERM to one node's train.sh stops both nodes after the same
    update, with status 143 each."""
    command = slurm_command()
    assert "--nnodes \"$SLURM_NNODES\" --rdzv-endpoint \"$head:29500\" --rdzv-id " \
           "\"$SLURM_JOB_ID\"" in command
    data_bin, save_dir, arch = re.match(r"scripts/train\.sh (\S+) (\S+) --arch (\S+)",
                                        command).groups()
    save = tmp_path / "ckpt"
    command = (command.replace(data_bin, str(toy_data_bin)).replace(save_dir, str(save))
               .replace(":29500", f":{free_port()}"))
    env = script_env(SLURM_NNODES="2", SLURM_JOB_ID="4242", head="127.0.0.1",
                     MULTIPATH_NMT_NUM_GPUS="1", MULTIPATH_NMT_DDP_ON_CPU="1")
    argv = ["bash", "-c", f"exec {command} {shlex.join(map(str, [*TINY_MODEL, *SHORT_RUN]))}"]
    nodes = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs, sent = [[], []], threading.Event()

    def read(index):  # rank 0, which logs the updates, may be on either node
        for line in nodes[index].stdout:
            outputs[index].append(line)
            logged = UPDATE_LOGGED.search(line)
            if logged and int(logged.group(1)) >= 3 and not sent.is_set():
                sent.set()
                nodes[1].send_signal(signal.SIGTERM)

    readers = [threading.Thread(target=read, args=(index,)) for index in range(2)]
    watchdog = threading.Timer(TIMEOUT, lambda: [kill_tree(node.pid) for node in nodes])
    watchdog.start()
    try:
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        codes = [node.wait() for node in nodes]
    finally:
        timed_out = watchdog.finished.is_set()
        watchdog.cancel()
    outputs = ["".join(lines) for lines in outputs]
    both = "\n--- node 1\n".join(outputs)
    if timed_out or not sent.is_set():
        _fail(argv, "timed out" if timed_out else "logged no update", both)
    assert f"--arch {arch}" in both and "2 nodes x 1 GPU(s)" in both
    words = printed_command(outputs[0])
    assert printed_command(outputs[1]) == words
    assert words[1:12] == ["-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", words[8], "--rdzv-id", "4242", "--nproc-per-node"]
    assert words[8].startswith("127.0.0.1:") and words[12] == "1"
    assert both.count("distributed init (rank ") == 2, both[-6000:]
    assert codes == [143, 143], both[-6000:]
    _, stopped_at = load_model_state(save / "checkpoint_last.pt")
    assert 3 <= stopped_at < MAX_UPDATE
    assert both.count(f"SIGTERM: stopped after update {stopped_at} ") == 1, both[-6000:]


@pytest.mark.process
def test_sigterm_while_the_workers_start_exits_143(toy_data_bin, tmp_path):
    """A SIGTERM that reaches the workers before fairseq-train's handlers are installed (they
    import, build the model, join the rendezvous) kills them (-15): train.sh still exits 143, the
    status a scheduler's requeue script reads as "stopped by the signal"."""
    command = train_sh(toy_data_bin, tmp_path / "ckpt", "baseline")
    with started(command, TIMEOUT) as proc:
        while True:  # both workers exist: the signal is passed on to them
            try:
                [worker_of_rank(proc.pid, rank) for rank in range(2)]
                break
            except LookupError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        output = proc.stdout.read()
        code = proc.wait()
    assert code == 143, output[-6000:]
    assert "num_updates=" not in output  # it stopped before training
    assert "train.sh: SIGTERM while the workers were starting: they stopped before training, " \
           "nothing to save; exiting with status 143" in output, output[-6000:]
    assert "Traceback" not in output, output[-6000:]


@pytest.mark.process
def test_train_sh_saves_checkpoint_last_mid_epoch_by_default(toy_data_bin, tmp_path):
    """train.sh's periodic save (sized in minutes; here 0.001 so that the toy batches, 800 tokens
    on 2 ranks, come to 7 updates) writes checkpoint_last.pt within the epoch (19 updates) and
    keeps one checkpoint_E_U.pt: a SIGKILL after it loses only the updates since (fairseq's
    default saves at epoch ends only)."""
    save = tmp_path / "ckpt"
    output = run_until_killed([*train_sh(toy_data_bin, save, "baseline"),
                               "--save-interval-minutes", "0.001"], 9, timeout=TIMEOUT)
    words = printed_command(output)
    assert words[words.index("--save-interval-updates") + 1] == "7"
    assert words[words.index("--keep-interval-updates") + 1] == "1"
    _, saved = load_model_state(save / "checkpoint_last.pt")
    assert saved in (7, 14)  # mid-epoch
    # and the save dir's lock file, which a SIGKILL leaves behind (its lock went with the process)
    assert sorted(p.name for p in save.iterdir()) == ["checkpoint_1_%d.pt" % saved,
                                                     "checkpoint_last.pt", "fairseq-train.lock",
                                                     "train-sh-batch.json"]


@pytest.mark.process
def test_train_sh_killed_with_sigkill_takes_its_workers_along(toy_data_bin, tmp_path):
    """kill -9 of train.sh on 2 ranks, with fairseq's default data loading (one worker each) and
    validation: both workers end at once (their parent's death kills them), and the same command
    run again is not refused. Workers that outlived it would train on with no parent, rank 0
    holding the save dir.
    Real processes, not the suite's forked ones (whose server kills a killed command's tree
    itself): PYTHON is this interpreter, torchrun starts its workers with it."""
    flags = [str(flag) for flag in SHORT_RUN]
    for dropped in (["--num-workers", "0"], ["--disable-validation"]):
        at = flags.index(dropped[0])
        del flags[at:at + len(dropped)]
    flags[flags.index("--max-update") + 1] = "100000"  # longer than the test
    command = ["env", f"PYTHON={sys.executable}", "MULTIPATH_NMT_NUM_GPUS=2",
               "MULTIPATH_NMT_DDP_ON_CPU=1", "bash", str(TRAIN_SH), str(toy_data_bin),
               str(tmp_path / "ckpt"), *FAMILIES["baseline"], *flags]
    workers = []
    # env execs bash, which execs the launcher: proc.pid is it
    with started(command, TIMEOUT) as proc:
        try:
            read_until(proc, command, UPDATE_LOGGED.search, "an update")
            workers = [worker_of_rank(proc.pid, rank) for rank in range(2)]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + 60  # they go within milliseconds
            while any(map(alive, workers)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(map(alive, workers)), "the workers train on without train.sh"
        finally:
            for pid in filter(alive, workers):
                os.kill(pid, signal.SIGKILL)
    code, output = run_and_signal(command, 1, signal.SIGTERM, timeout=TIMEOUT)
    assert code == 143 and "is in use by" not in output, output[-6000:]


def _sentences_per_update(output):
    """{update: sentences it trained} from fairseq's per-update lines (--log-interval 1)."""
    counts = {}
    for line in output.splitlines():
        update, sentences = re.search(r"num_updates=(\d+)", line), re.search(r"\bbsz=(\d+)", line)
        if update and sentences and "epoch 001" in line:
            counts[int(update.group(1))] = int(sentences.group(1))
    return counts


@pytest.mark.process
def test_a_resume_on_another_number_of_ranks_trains_each_sentence_of_the_epoch_once(
        toy_data_bin, tmp_path):
    """Stopped after update 3 or so on 2 ranks, resumed on 1 and on 4: epoch 1 trains its 300
    sentences, each once (the batches of its 38 that the stopped run took, 2 per update, are not
    taken again; the rest are dealt out to the new ranks). The saved position counted one rank's
    own batches: resumed on 1 rank the epoch trained 332 sentences of 300 (stopped at 4), on 4
    fairseq stopped with "dataloader mismatch". Other batches are refused in one line."""
    one_epoch = ["--max-update", "100", "--max-epoch", "1"]
    stopped = tmp_path / "stopped"
    command = [*train_sh(toy_data_bin, stopped, "baseline"), *one_epoch]
    code, output = run_and_signal(command, 3, signal.SIGTERM, timeout=TIMEOUT)
    assert code == 143, output[-6000:]
    _, at = load_model_state(stopped / "checkpoint_last.pt")
    before = {u: n for u, n in _sentences_per_update(output).items() if u <= at}
    assert sorted(before) == list(range(1, at + 1)) and at < 19
    for ranks in (1, 4):
        save = Path(shutil.copytree(stopped, tmp_path / f"on{ranks}"))
        resumed = run([*train_sh(toy_data_bin, save, "baseline", gpus=ranks), *one_epoch],
                      timeout=TIMEOUT)
        after = _sentences_per_update(resumed)
        assert min(after) == at + 1 and sorted(after) == list(range(at + 1, max(after) + 1))
        assert sum(before.values()) + sum(after.values()) == 300, (ranks, before, after)
        assert (f"epoch 1 was saved on 2 process(es) after {2 * at} of its 38 batches: the "
                f"{38 - 2 * at} left are dealt out to {ranks} process(es)") in resumed
    # other batches (another --batch-size or --max-tokens) cannot continue the epoch: one line
    # before any update
    save = Path(shutil.copytree(stopped, tmp_path / "other-batches"))
    proc = run_command([*train_sh(toy_data_bin, save, "baseline", gpus=1), *one_epoch,
                        "--batch-size", "4"], merge_stderr=True, timeout=TIMEOUT)
    assert proc.returncode == 1 and "num_updates=" not in proc.stdout, proc.stdout[-4000:]
    assert (f"train.py: error: cannot continue epoch 1 where the checkpoint stopped (after {2 * at} "
            "of its batches): this run cuts the data into other batches (") in proc.stdout
    assert ("another --max-tokens, --batch-size or other data). Resume with the batch flags and "
            "data of the run that saved it, or pass --reset-dataloader to start the epoch over") \
        in proc.stdout
    assert "Traceback" not in proc.stdout
