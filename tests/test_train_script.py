"""scripts/train.sh: the paper's recipe per architecture family, its global batch on 1, 2, 3, 8
and 16 GPUs (MULTIPATH_NMT_NUM_GPUS) with the arithmetic printed, --batch-tokens, the CPU
fallback, the embedding sharing per data-bin (En-Fr: none), pass-through overrides, bad input, and
one real 2-update run."""
import json
import re
import shlex
import sys

import pytest
import torch

from conftest import (ROOT, TINY_MODEL, USER_DIR, clean_env, dictionaries_only_data_bin,
                      run_cli, script_env)

import multipath_nmt  # noqa: F401  (safe checkpoint loading on torch >= 2.6)
from fairseq import checkpoint_utils
from helpers import in_process
from multipath_nmt.cli import recipe_scripts

TRAIN_SH = ROOT / "scripts" / "train.sh"


# A WMT joined dictionary's size: the GPU memory model counts the output layer's logits per type.
WMT_TYPES = 32000
# The GPU card of the dry runs unless a test gives another: the 12 GB on which the authors'
# 4,096-token micro-batch fits (train.sh sizes the micro-batch from the card's memory).
CARD_MIB = "12288"


@pytest.fixture
def fake_data_bin(tmp_path):
    """A joined-dictionary en-de data-bin (dictionaries only: --dry-run reads nothing else)."""
    for lang in ("en", "de"):
        (tmp_path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(WMT_TYPES)))
    return tmp_path


def _dry_run(data_bin, *args, gpus="0", check=True, save="save", **env):
    # GPUs without bfloat16 unless a test says otherwise: what torch answers on a machine
    # without a GPU, given to the recipe so that it need not import torch to ask (2.5 s a run)
    # and the tests read the same on a machine with one (test_precision_auto_asks_the_gpu
    # leaves it to torch)
    if gpus != "0":
        env.setdefault("MULTIPATH_NMT_BF16", "0")
        env.setdefault("MULTIPATH_NMT_GPU_MEMORY_MIB", CARD_MIB)
    # what train.sh runs (scripts/run-recipe.sh), in this process
    proc = in_process.call(recipe_scripts.main, ["train.sh", data_bin, save, *args, "--dry-run"],
                           env={"MULTIPATH_NMT_NUM_GPUS": gpus, "MAX_TOKENS": None, **env})
    if check and proc.returncode != 0:
        pytest.fail(f"train.sh {' '.join(map(str, args))} --dry-run exited {proc.returncode}: "
                    f"{proc.stderr}")
    return proc


def _flags(proc):
    """The printed fairseq-train command as {flag: last value} (fairseq keeps the last one)."""
    line = [printed for printed in proc.stdout.splitlines() if "fairseq_cli.train" in printed][-1]
    words = shlex.split(line.split("train.sh: ", 1)[1])
    flags = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
            flags[word] = words[i + 1] if has_value else True
    return words, flags


def test_base_recipe_on_cpu(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de")
    assert "no CUDA device found, training in fp32 on the CPU" in proc.stdout
    words, flags = _flags(proc)
    assert words[1:3] == ["-m", "fairseq_cli.train"] and words[3] == str(fake_data_bin)
    assert flags["--user-dir"] == str(USER_DIR)
    assert flags["--adam-betas"] == "(0.9, 0.997)" and flags["--optimizer"] == "adam_fused"
    assert flags["--lr-scheduler"] == "inverse_sqrt" and flags["--warmup-init-lr"] == "1e-07"
    assert flags["--clip-norm"] == "0.0"  # no gradient clipping
    assert (flags["--lr"], flags["--warmup-updates"]) == ("0.001", "8000")
    assert (flags["--max-tokens"], flags["--update-freq"]) == ("4096", "1")
    assert ("train.sh: batch: 4,096 max-tokens x 1 CPU process x 1 update-freq = 4,096 tokens per "
            "update (one GPU's share of the paper's batch on the CPU)") in proc.stdout
    assert flags["--criterion"] == "label_smoothed_cross_entropy" and flags["--label-smoothing"] == "0.1"
    assert flags["--share-all-embeddings"] is True and flags["--cpu"] is True
    assert "--fp16" not in flags and flags["--keep-last-epochs"] == "10"
    assert not (fake_data_bin / "save").exists()  # --dry-run runs nothing
    # the authors' group's pre-norm deep scripts' dropout
    assert (flags["--attention-dropout"], flags["--activation-dropout"]) == ("0.1", "0.1")
    # one length rule: 20 epochs unless told otherwise
    assert flags["--max-epoch"] == "20" and "--max-update" not in flags
    assert ("train.sh: length: 20 epochs (--max-epoch 20, the recipe's): the same data for every "
            "system, and the final model is the last epoch checkpoint, which average.sh's mean "
            "ends with") in proc.stdout
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", "--max-update=100")
    assert "train.sh: note:" not in proc.stdout and "--max-epoch" not in _flags(proc)[1]
    assert "train.sh: length: 100 updates (--max-update, given): systems with other" in proc.stdout


@pytest.mark.parametrize("args,flags,line", [
    (["--max-epoch", "7"], {"--max-epoch": "7"}, "length: 7 epochs (--max-epoch, given)"),
    (["--stop-time-hours", "2"], {"--stop-time-hours": "2"},
     "length: 2 hours (--stop-time-hours, given)"),
])
def test_a_given_length_replaces_the_recipes(fake_data_bin, args, flags, line):
    proc = _dry_run(fake_data_bin, "--arch", "multipath_transformer_wmt_en_de", *args)
    _, printed = _flags(proc)
    assert {k: printed.get(k) for k in flags} == flags and printed.get("--max-update") is None
    assert f"train.sh: {line}" in proc.stdout


def test_ewa_needs_a_number_of_updates_for_its_schedule(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "ewa_transformer_wmt_en_de", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "train.sh: error: ewa_transformer_wmt_en_de: EWA's share rate rises over --max-update "
        "updates; give --max-update N (or --ewa-schedule constant to train the recipe's 20 epochs)")
    _, flags = _flags(_dry_run(fake_data_bin, "--arch", "ewa_transformer_wmt_en_de",
                               "--ewa-schedule", "constant"))
    assert flags["--max-epoch"] == "20"


@pytest.mark.parametrize("args", [
    ["--arch", "ewa_early_transformer_wmt_en_de"],
    ["--arch", "ewa_early_transformer_wmt_en_de", "--ewa-schedule", "constant"],
    ["--arch", "ewa_early_transformer_wmt_en_de", "--max-epoch", "3"],
    ["--arch", "ewa_transformer_wmt_en_de", "--ewa-stop-at=0.3", "--ewa-schedule", "constant"],
])
def test_early_ewa_needs_a_number_of_updates_whatever_the_schedule(fake_data_bin, args):
    proc = _dry_run(fake_data_bin, *args, check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"train.sh: error: {args[1]}: early EWA averages the experts during the first fraction "
        "(--ewa-stop-at, 0.5 by default) of --max-update updates, whatever --ewa-schedule; give "
        "--max-update N")
    _, flags = _flags(_dry_run(fake_data_bin, *args, "--max-update", "100"))
    assert flags["--max-update"] == "100"


# The printed command gives max-tokens x GPUs x update-freq = 32,768 (base) / 65,536 (deep and
# multi-path, and the wide archs on the deep recipe); numbers computed by hand.
@pytest.mark.parametrize("arch,gpus,max_tokens,update_freq", [
    ("transformer_prenorm_wmt_en_de", "1", "4096", "8"),
    ("transformer_prenorm_wmt_en_de", "2", "4096", "4"),
    ("transformer_prenorm_wmt_en_de", "8", "4096", "1"),
    ("transformer_prenorm_wmt_en_de", "16", "2048", "1"),
    ("transformer_deep24_wmt_en_de", "1", "4096", "16"),
    ("multipath_transformer_wmt_en_de", "2", "4096", "8"),
    ("multipath_l12_p2_wmt_en_de", "8", "4096", "2"),
    ("widenet_transformer_wmt_en_de", "16", "4096", "1"),
])
def test_the_papers_global_batch_on_gpus(fake_data_bin, arch, gpus, max_tokens, update_freq):
    proc = _dry_run(fake_data_bin, "--arch", arch, gpus=gpus)
    words, flags = _flags(proc)
    deep = not arch.startswith("transformer_prenorm")
    total = 65536 if deep else 32768
    assert (flags["--max-tokens"], flags["--update-freq"]) == (max_tokens, update_freq)
    assert int(max_tokens) * int(gpus) * int(update_freq) == total
    assert (f"train.sh: batch: {int(max_tokens):,} max-tokens x {gpus} GPU(s) x {update_freq} "
            f"update-freq = {total:,} tokens per update (the paper's {total // 8:,}, read as per GPU, x 8 "
            f"GPUs)") in proc.stdout
    assert (flags["--lr"], flags["--warmup-updates"]) == (("0.002", "16000") if deep else ("0.001", "8000"))
    # every arch: fp16 autocast over fp32 weights on a GPU without bfloat16 (_dry_run's
    # MULTIPATH_NMT_BF16=0)
    assert flags["--amp"] is True and "--fp16" not in flags and "--bf16" not in flags
    assert "--cpu" not in flags
    assert (f"train.sh: {gpus} GPU(s), precision fp16 (float16 autocast, fp32 weights, dynamic "
            "loss scaling: --amp), the same for every arch") in proc.stdout
    assert flags["--distributed-world-size"] == gpus
    # one process per GPU, started by torchrun (not by fairseq's torch.multiprocessing.spawn)
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", gpus]
                if gpus != "1" else [])
    assert words[1:1 + len(launcher) + 2] == [*launcher, "-m", "fairseq_cli.train"]
    moe = arch.startswith("widenet")
    assert flags["--criterion"] == ("label_smoothed_cross_entropy_with_moe" if moe else "label_smoothed_cross_entropy")


def test_several_nodes_split_the_batch_over_every_gpu_behind_a_rendezvous(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "multipath_l6_p4_wmt_en_de", "--nnodes", "2",
                    "--rdzv-endpoint", "node01:29500", "--rdzv-id=mp", gpus="8")
    words, flags = _flags(proc)
    assert words[1:13] == ["-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", "node01:29500", "--rdzv-id", "mp",
                           "--nproc-per-node", "8"]
    assert words[13:15] == ["-m", "fairseq_cli.train"]
    assert flags["--distributed-world-size"] == "16" and "--nnodes" not in words[15:]
    assert (flags["--max-tokens"], flags["--update-freq"]) == ("4096", "1")  # 65,536 / 16 GPUs
    assert "train.sh: 2 nodes x 8 GPU(s), precision fp16" in proc.stdout
    assert "train.sh: launcher: torchrun, one process per GPU; SIGTERM, SIGINT and SIGUSR1 to " \
           "train.sh reach every worker" in proc.stdout


def test_the_gloo_stand_in_for_gpus_changes_the_device_flags_only(fake_data_bin):
    """MULTIPATH_NMT_DDP_ON_CPU=1, how tests/test_launcher.py runs the multi-GPU command."""
    args = ["--arch", "transformer_prenorm_wmt_en_de", "--max-update", "9"]
    gpu, _ = _flags(_dry_run(fake_data_bin, *args, gpus="2"))
    cpu, _ = _flags(_dry_run(fake_data_bin, *args, gpus="2", MULTIPATH_NMT_DDP_ON_CPU="1"))
    assert [w for w in gpu if w != "--amp"] == [w for w in cpu if w not in (
        "--cpu", "--distributed-backend", "gloo")]
    at = cpu.index("--cpu")
    assert cpu[at:at + 5] == ["--cpu", "--distributed-backend", "gloo", "--distributed-world-size",
                              "2"]


@pytest.mark.parametrize("gpus,args,message", [
    ("8", ["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT (one of the nodes, the "
                             "same on every node; docs/troubleshooting.md)"),
    ("0", ["--nnodes", "2", "--rdzv-endpoint", "a:1"], "--nnodes 2 needs GPUs: no CUDA device found"),
    ("8", ["--rdzv-endpoint", "a:1"], "--rdzv-endpoint and --rdzv-id are for several nodes: give "
                                      "--nnodes N"),
    ("8", ["--nnodes", "0"], "--nnodes must be a positive integer, got '0'"),
])
def test_bad_node_requests_are_one_line(fake_data_bin, gpus, args, message):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", *args, gpus=gpus,
                    check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == f"train.sh: error: {message}"


PRECISION_WORDS = ("--amp", "--bf16", "--fp16", "--memory-efficient-fp16", "--cpu")


@pytest.mark.parametrize("gpus,bf16,args,expected", [
    ("4", "1", [], ["--amp", "--bf16"]),
    ("4", "0", [], ["--amp"]),
    ("1", "1", ["--precision", "fp16"], ["--amp"]),
    ("1", "1", ["--precision=fp32"], []),
    ("0", None, [], ["--cpu"]),
    ("0", None, ["--precision", "bf16"], ["--amp", "--bf16", "--cpu"]),
])
def test_multipath_and_deep_archs_get_the_same_precision_flags(fake_data_bin, gpus, bf16, args,
                                                                expected):
    """The comparison this project exists for: one precision for every system on a machine."""
    env = {} if bf16 is None else {"MULTIPATH_NMT_BF16": bf16}
    for arch in ("multipath_l6_p4_wmt_en_de", "transformer_deep24_wmt_en_de",
                 "transformer_prenorm_wmt_en_de", "ewa_transformer_wmt_en_de"):
        words, _ = _flags(_dry_run(fake_data_bin, "--arch", arch, *args, "--max-update", "9",
                                   gpus=gpus, **env))
        assert [w for w in words if w in PRECISION_WORDS] == expected, arch
        assert "--precision" not in words  # train.sh's own flag


def test_precision_auto_asks_the_gpu_whether_it_has_bfloat16(fake_data_bin):
    """Without MULTIPATH_NMT_BF16, train.sh asks torch about the first GPU."""
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", gpus="1",
                    MULTIPATH_NMT_BF16=None)
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert f"train.sh: 1 GPU(s), precision {'bf16' if bf16 else 'fp16'} (" in proc.stdout


def test_fp16_on_the_cpu_is_refused_in_one_line(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "multipath_transformer_wmt_en_de", "--precision",
                    "fp16", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("train.sh: error: --precision fp16 needs a CUDA GPU (its loss "
                                   "scaler and float16 autocast are CUDA's); on the CPU use "
                                   "--precision bf16 or fp32")


@pytest.mark.parametrize("arch,message", [
    ("transformer_prenorm_wmt_en_de", "32,768 tokens per update (the paper's 4,096, read as per GPU, x 8 GPUs) "
     "cannot be split evenly over 3 GPUs; use a GPU count that divides it (CUDA_VISIBLE_DEVICES "
     "selects them) or pass --batch-tokens 32766 (5461 max-tokens x 3 workers x 2 update-freq)"),
    ("multipath_l6_p4_wmt_en_de", "65,536 tokens per update (the paper's 8,192, read as per GPU, x 8 GPUs) "
     "cannot be split evenly over 3 GPUs; use a GPU count that divides it (CUDA_VISIBLE_DEVICES "
     "selects them) or pass --batch-tokens 65535 (4369 max-tokens x 3 workers x 5 update-freq)"),
])
def test_three_gpus_are_refused_with_a_batch_that_works(fake_data_bin, arch, message):
    proc = _dry_run(fake_data_bin, "--arch", arch, gpus="3", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == f"train.sh: error: {message}"
    batch_tokens, max_tokens, update_freq = re.search(
        r"--batch-tokens (\d+) \((\d+) max-tokens .* x (\d+) update-freq", message).groups()
    proc = _dry_run(fake_data_bin, "--arch", arch, "--batch-tokens", batch_tokens, gpus="3")
    _, flags = _flags(proc)
    assert (flags["--max-tokens"], flags["--update-freq"]) == (max_tokens, update_freq)


# The micro-batch sized from the card's memory (MULTIPATH_NMT_GPU_MEMORY_MIB stands in for it):
# one 141 GB H200 takes each worker's whole share at once, a 12 GB card the authors' 4,096, 8 GPUs
# a share of 4,096; the tokens per update stay the paper's.
@pytest.mark.parametrize("arch,gpus,card_mib,max_tokens,update_freq", [
    ("transformer_prenorm_wmt_en_de", "1", "143771", "32768", "1"),
    ("multipath_l6_p4_wmt_en_de", "1", "143771", "65536", "1"),
    ("transformer_deep24_wmt_en_de", "1", "143771", "65536", "1"),
    ("transformer_prenorm_wmt_en_de", "8", "143771", "4096", "1"),
    ("transformer_prenorm_wmt_en_de", "1", "12288", "4096", "8"),
    ("multipath_l6_p4_wmt_en_de", "1", "12288", "4096", "16"),
    ("transformer_prenorm_wmt_en_de", "1", "32768", "16384", "2"),  # a 32 GB card
])
def test_the_micro_batch_is_sized_from_the_gpus_memory(fake_data_bin, arch, gpus, card_mib,
                                                       max_tokens, update_freq):
    proc = _dry_run(fake_data_bin, "--arch", arch, gpus=gpus, MULTIPATH_NMT_BF16="1",
                    MULTIPATH_NMT_GPU_MEMORY_MIB=card_mib)
    _, flags = _flags(proc)
    assert (flags["--max-tokens"], flags["--update-freq"]) == (max_tokens, update_freq)
    total = 32768 if arch.startswith("transformer_prenorm") else 65536
    assert int(max_tokens) * int(gpus) * int(update_freq) == total
    line = next(printed for printed in proc.stdout.splitlines() if printed.startswith("train.sh: micro-batch:"))
    assert line.startswith(f"train.sh: micro-batch: {int(max_tokens):,} tokens, each worker's "
                           f"share cut into equal parts of at most ")
    assert line.endswith(f"the micro-batch that fits {int(card_mib):,} MiB "
                         f"(MULTIPATH_NMT_GPU_MEMORY_MIB) with a 2x margin: " + line.split(
                             "2x margin: ")[1])
    assert "(multipath_nmt/recipe/memory_model.py)" in line


def test_a_given_max_tokens_caps_the_gpu_sized_micro_batch(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", "--max-tokens",
                    "4096", gpus="1", MULTIPATH_NMT_BF16="1", MULTIPATH_NMT_GPU_MEMORY_MIB="143771")
    assert (_flags(proc)[1]["--max-tokens"], _flags(proc)[1]["--update-freq"]) == ("4096", "8")
    assert ("train.sh: micro-batch: 4,096 tokens, each worker's share cut into equal parts of at "
            "most 4,096: --max-tokens given (a cap)") in proc.stdout


@pytest.mark.parametrize("value,message", [
    ("12GB", "MULTIPATH_NMT_GPU_MEMORY_MIB must be a positive number of MiB, got '12GB'"),
    ("900", "transformer_prenorm_wmt_en_de does not fit this GPU's memory (the micro-batch that "
            "fits 900 MiB (MULTIPATH_NMT_GPU_MEMORY_MIB) with a 2x margin: 1,037 MiB of weights "
            "and optimizer state + 723 KiB per token (multipath_nmt/recipe/memory_model.py)); "
            "give --max-tokens N to try a micro-batch anyway"),
])
def test_a_card_memory_that_cannot_plan_is_one_line(fake_data_bin, value, message):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", gpus="1",
                    MULTIPATH_NMT_GPU_MEMORY_MIB=value, check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == f"train.sh: error: {message}"


def test_a_dry_run_for_gpus_on_a_machine_without_them_is_one_line(fake_data_bin):
    """MULTIPATH_NMT_NUM_GPUS=8 train.sh ... --dry-run where PyTorch sees no GPU (a login node;
    CUDA_VISIBLE_DEVICES='' hides any): one line naming the variable that gives the card's
    memory, status 1, no traceback (it was torch's "Torch not compiled with CUDA enabled")."""
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", gpus="8",
                    MULTIPATH_NMT_GPU_MEMORY_MIB=None, CUDA_VISIBLE_DEVICES="", check=False)
    [line] = proc.stderr.splitlines()
    assert proc.returncode == 1 and proc.stdout == ""
    assert line.startswith("train.sh: error: MULTIPATH_NMT_NUM_GPUS=8 counts GPUs that PyTorch ")
    assert line.endswith("set MULTIPATH_NMT_GPU_MEMORY_MIB to one GPU's memory in MiB "
                         "(nvidia-smi's memory.total on the GPU machine, e.g. 143771 for an "
                         "H200) or give --max-tokens N")


@pytest.mark.parametrize("arch,gpus,args,max_tokens,update_freq", [
    ("multipath_l6_p2_wmt_en_de", "0", [], "4096", "2"),                      # CPU: 8,192
    ("transformer_prenorm_wmt_en_de", "8", ["--batch-tokens", "65536"], "4096", "2"),
    # 12 GB hold 6,250 tokens of deep12 (memory_model.py): 30,000 = 6,000 x 5
    ("transformer_deep12_wmt_en_de", "1", ["--batch-tokens=30000"], "6000", "5"),
    ("ewa_transformer_wmt_en_de", "0", ["--batch-tokens", "65536", "--max-update", "9"], "4096",
     "16"),
    ("transformer_deep24_wmt_en_de", "2", ["--max-tokens", "3000"], "2048", "16"),
])
def test_cpu_batch_batch_tokens_and_max_tokens_cap(fake_data_bin, arch, gpus, args, max_tokens, update_freq):
    proc = _dry_run(fake_data_bin, "--arch", arch, *args, gpus=gpus)
    _, flags = _flags(proc)
    assert (flags["--max-tokens"], flags["--update-freq"]) == (max_tokens, update_freq)
    assert "--batch-tokens" not in flags  # train.sh's own flag, not fairseq's
    if gpus == "0":
        assert "--cpu" in flags and "--fp16" not in flags
        assert "1 CPU process" in proc.stdout


def test_explicit_update_freq_is_kept_and_printed(fake_data_bin):
    # The quickstart's and the study's own batch: --max-tokens 2048 --update-freq 1.
    proc = _dry_run(fake_data_bin, "--arch", "multipath_transformer_wmt_en_de",
                    "--max-tokens", "2048", "--update-freq", "1")
    _, flags = _flags(proc)
    assert (flags["--max-tokens"], flags["--update-freq"]) == ("2048", "1")
    assert ("2,048 max-tokens x 1 CPU process x 1 update-freq = 2,048 tokens per update "
            "(--update-freq given: not the recipe's batch)") in proc.stdout


def test_max_tokens_from_env_and_overrides_win(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_wmt_en_de", "--lr", "0.0007",
                    "--max-update", "300000", gpus="1", MAX_TOKENS="2048")
    words, flags = _flags(proc)
    assert (flags["--max-tokens"], flags["--update-freq"]) == ("2048", "16")  # 2048 x 16 = 32768
    assert flags["--lr"] == "0.0007" and flags["--max-update"] == "300000"
    assert words.index("0.0007") > words.index("0.001")  # after the recipe: the user's value wins
    proc = _dry_run(fake_data_bin, "--arch", "transformer_wmt_en_de", "--max-tokens", "1024",
                    gpus="1", MAX_TOKENS="2048")
    assert _flags(proc)[1]["--max-tokens"] == "1024"  # the command line wins over MAX_TOKENS


@pytest.mark.parametrize("src,tgt,joined,args,shared", [
    ("en", "de", True, [], True),           # the paper's En-De: one shared embedding
    ("en", "fr", True, [], False),          # Table 3's En-Fr sizes: nothing shared
    ("fr", "en", False, [], False),
    ("en", "fr", True, ["--embeddings", "shared"], True),
    ("en", "de", True, ["--embeddings=separate"], False),
])
def test_embedding_sharing_follows_the_data_bin(tmp_path, src, tgt, joined, args, shared):
    data_bin = dictionaries_only_data_bin(tmp_path / "bin", src, tgt, joined)
    proc = _dry_run(data_bin, "--arch", "transformer_prenorm_wmt_en_de", *args)
    _, flags = _flags(proc)
    assert ("--share-all-embeddings" in flags) == shared
    assert "--embeddings" not in flags and "--share-decoder-input-output-embed" not in flags
    sharing = ("all shared (joined dictionary)" if shared else
               "nothing shared (encoder input, decoder input, output projection)")
    assert f"train.sh: embeddings: {sharing} for dict.{src}.txt, dict.{tgt}.txt" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--lr", "0.1"], "--arch ARCH is required"),
    (["--arch", "transformer_wmt_en_de", "--max-tokens", "many"], "max-tokens must be a positive integer"),
    (["--arch", "transformer_wmt_en_de", "--batch-tokens", "0"], "--batch-tokens must be a positive integer"),
    (["--arch", "transformer_wmt_en_de", "--batch-tokens", "8192", "--update-freq", "2"],
     "give --batch-tokens or --update-freq, not both"),
    (["--arch", "transformer_wmt_en_de", "--batch-tokens"], "--batch-tokens needs a value"),
])
def test_bad_arguments(fake_data_bin, args, message):
    proc = _dry_run(fake_data_bin, *args, check=False)
    assert proc.returncode == 1 and message in proc.stderr


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_arch_without_a_recipe_is_refused_in_one_line(fake_data_bin, tmp_path, dry_run):
    """An arch that the arch table (multipath_nmt/arch_table.py) has no row for (a user's own
    variant, a stock fairseq arch the paper's recipes do not cover) is refused before anything
    runs: it is never given the base model's learning rate and batch."""
    args = ["train.sh", fake_data_bin, tmp_path / "save", "--arch", "my_multipath_variant",
            *(["--dry-run"] if dry_run else [])]
    proc = in_process.call(recipe_scripts.main, args, env={"MULTIPATH_NMT_NUM_GPUS": "0"})
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (
        "train.sh: error: unknown arch 'my_multipath_variant': no recipe for it in "
        "multipath_nmt/arch_table.py's ARCHS; add a row (recipe base or deep) for it there\n")
    assert not (tmp_path / "save").exists()


def test_missing_data_bin(tmp_path):
    proc = _dry_run(tmp_path / "nope", "--arch", "transformer_wmt_en_de", check=False)
    assert proc.returncode == 1 and "has no dict.*.txt" in proc.stderr


@pytest.mark.slow
@pytest.mark.process  # the whole script: train.sh becomes fairseq-train
def test_real_two_update_run(toy_data_bin, tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = run_cli(["bash", TRAIN_SH, toy_data_bin, save_dir, "--arch", "transformer_prenorm_wmt_en_de",
                    *TINY_MODEL, "--max-tokens", "400", "--max-update", "2", "--num-workers", "0",
                    "--no-progress-bar", "--log-format", "simple", "--disable-validation", "--seed", "1"],
                   env=script_env())
    assert "training in fp32 on the CPU" in proc.stdout
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save_dir / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 2
    cfg = state["cfg"]
    assert cfg["model"].arch == "transformer_prenorm_wmt_en_de"
    assert tuple(cfg["optimization"]["lr"]) == (0.001,) and cfg["optimizer"]["adam_betas"] == "(0.9, 0.997)"
    assert cfg["lr_scheduler"]["warmup_updates"] == 8000 and cfg["criterion"]["label_smoothing"] == 0.1
    assert cfg["common"]["cpu"] and not cfg["common"]["fp16"]
    # the micro-batch the run trained with, for a resume on another number of GPUs
    assert json.loads((save_dir / "train-sh-batch.json").read_text()) == {"max_tokens": 256}  # 4,096 / 16


def test_a_resume_keeps_the_micro_batch_of_the_run_it_resumes(fake_data_bin, tmp_path):
    """A resume mid-epoch on another number of GPUs continues the epoch only with the same batches:
    on 4 H200s base would take 8,192 tokens a micro-batch, but the run that saved on 8 took 4,096,
    so the resume keeps 4,096 (x 2). Without checkpoint_last.pt the record is not read; a record
    that the card cannot hold is not kept."""
    save = tmp_path / "save"
    save.mkdir()
    (save / "train-sh-batch.json").write_text('{"max_tokens": 4096}')

    def plan(card_mib="143771"):
        proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", gpus="4",
                        save=save, MULTIPATH_NMT_BF16="1", MULTIPATH_NMT_GPU_MEMORY_MIB=card_mib)
        flags = _flags(proc)[1]
        return (flags["--max-tokens"], flags["--update-freq"]), proc.stdout

    assert plan()[0] == ("8192", "1")  # no checkpoint_last.pt: a new run
    (save / "checkpoint_last.pt").write_bytes(b"")
    batch, printed = plan()
    assert batch == ("4096", "2")
    assert (f"train.sh: micro-batch: 4,096 tokens, each worker's share cut into equal parts of "
            f"at most 4,096: the micro-batch of the run that saved checkpoint_last.pt "
            f"({save / 'train-sh-batch.json'}), so that a resume on another number of GPUs has "
            f"its batches; --max-tokens N to change it") in printed
    (save / "train-sh-batch.json").write_text('{"max_tokens": 16384}')
    assert plan("12288")[0] == ("4096", "2")  # 12 GB hold 7,241: the memory's cap


@pytest.mark.process  # the scripts' interpreter
@pytest.mark.parametrize("script", ["train.sh", "translate.sh"])
def test_an_interpreter_without_the_plugin_is_one_error_line(tmp_path, script):
    bare_python = tmp_path / "bare-python"  # no site-packages: multipath_nmt cannot be imported
    bare_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare_python.chmod(0o755)
    checkpoint = tmp_path / "model.pt"
    checkpoint.touch()
    proc = run_cli(["bash", ROOT / "scripts" / script, tmp_path, checkpoint, tmp_path / "out"],
                   env={**clean_env(), "PYTHON": str(bare_python)}, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"{script}: error: {bare_python} cannot import multipath_nmt; activate its environment "
        "or set PYTHON"]


@pytest.mark.parametrize("args, value", [(["--compile-layers"], True),
                                         (["--compile-layers", "aot_eager"], "aot_eager"),
                                         (["--compile-layers=aot_eager"], None)])
def test_compile_layers_is_passed_on_to_fairseq_train(fake_data_bin, args, value):
    """--compile-layers [BACKEND] (multipath_nmt/fairseq_patches/compile_layers.py) reaches
    fairseq-train as given, after the recipe, for every arch family."""
    for arch in ("transformer_prenorm_wmt_en_de", "multipath_transformer_wmt_en_de",
                 "widenet_transformer_wmt_en_de"):
        words, flags = _flags(_dry_run(fake_data_bin, "--arch", arch, *args))
        assert words[-len(args):] == args
        if value is not None:
            assert flags["--compile-layers"] == value


@pytest.mark.parametrize("arch,gpus,every,seconds", [
    # numbers by hand: 10 min x 60 / (tokens per update / (GPUs x the H200's tokens/s)), two digits
    ("transformer_prenorm_wmt_en_de", "1", "940", "0.637"),   # 32,768 / 51,420
    ("transformer_prenorm_wmt_en_de", "8", "7500", "0.0797"),
    ("transformer_deep24_wmt_en_de", "1", "250", "2.4"),      # 65,536 / 27,307
    ("multipath_l6_p4_wmt_en_de", "8", "2000", "0.3"),
])
def test_a_periodic_save_every_ten_minutes_by_default(fake_data_bin, arch, gpus, every, seconds):
    proc = _dry_run(fake_data_bin, "--arch", arch, gpus=gpus)
    _, flags = _flags(proc)
    assert (flags["--save-interval-updates"], flags["--keep-interval-updates"]) == (every, "1")
    assert (f"train.sh: periodic save: checkpoint_last.pt every {int(every):,} updates, about 10 "
            f"minutes at an H200's speed ({seconds} s an update;") in proc.stdout
    assert flags["--keep-last-epochs"] == "10"  # the epoch checkpoints average.sh reads, as before


@pytest.mark.parametrize("args,gpus,line", [
    ([], "0", "periodic save: none on the CPU (no measured speed to size it): at epoch ends; "
              "--save-interval-updates N saves every N updates"),
    (["--save-interval-minutes", "0"], "8",
     "periodic save: none (--save-interval-minutes 0): at epoch ends only"),
    (["--save-interval-updates", "500"], "8", "periodic save: --save-interval-updates given"),
])
def test_no_periodic_save_on_the_cpu_when_off_or_given(fake_data_bin, args, gpus, line):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de", *args, gpus=gpus)
    words, flags = _flags(proc)
    assert f"train.sh: {line}" in proc.stdout
    assert words.count("--save-interval-updates") == (1 if "500" in args else 0)
    assert "--keep-interval-updates" not in flags and "--save-interval-minutes" not in flags
