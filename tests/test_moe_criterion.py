"""label_smoothed_cross_entropy_with_moe: the balance term, its logging, and WideNet end to end."""
import math
import re
import shutil

import pytest
import torch
from conftest import TINY_MODEL, TRAIN_FLAGS, USER_DIR, run_fairseq
from fairseq import metrics
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from multipath_nmt.criterions.label_smoothed_cross_entropy_with_moe import (
    LabelSmoothedCrossEntropyWithMoeCriterion,
)
from multipath_nmt.host_syncs import HostSyncCounter
from multipath_nmt.modules.moe import pop_all_routing_stats

CRITERION = ["--criterion", "label_smoothed_cross_entropy_with_moe"]


def build(data, arch, *extra):
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(data), "--arch", arch, *TINY_MODEL, "--share-all-embeddings", "--cpu",
        "--user-dir", str(USER_DIR), "--label-smoothing", "0.1", *extra])
    task = tasks.setup_task(args)
    task.load_dataset("train")
    dataset = task.dataset("train")
    sample = dataset.collater([dataset[i] for i in range(4)])
    return task, task.build_model(args).train(), task.build_criterion(args), sample


def plain_criterion(task):
    return LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)


def test_balance_term_is_lambda_times_sample_size_times_summed_losses(toy_data_bin):
    task, model, criterion, sample = build(toy_data_bin, "widenet_transformer_wmt_en_de",
                                           *CRITERION, "--moe-balance-weight", "0.5")
    assert isinstance(criterion, LabelSmoothedCrossEntropyWithMoeCriterion)
    torch.manual_seed(3)
    loss, sample_size, log = criterion(model, sample)
    torch.manual_seed(3)  # the same dropout and router noise
    plain_loss, plain_size, _ = plain_criterion(task)(model, sample)
    calls = pop_all_routing_stats(model)
    assert len(calls) == 2  # one shared MoE, called by both encoder layers
    balance = sum(c.balance_loss for c in calls)
    assert sample_size == plain_size == sample["ntokens"]
    torch.testing.assert_close(loss, plain_loss + 0.5 * sample_size * balance)
    assert log["loss"] == plain_loss.data  # the logged loss stays the translation loss
    # logging outputs stay tensors (no host sync per micro-batch) until reduce_metrics
    assert all(torch.is_tensor(log[key]) for key in ("moe_balance_loss", "moe_dropped",
                                                      "moe_assignments", "moe_load_0"))
    assert log["moe_balance_loss"].item() == pytest.approx(balance.item() * sample_size)
    source_tokens = int(sample["net_input"]["src_lengths"].sum())
    assert log["moe_assignments"] == 2 * 2 * source_tokens  # 2 calls x top-2, no padding
    kept = sum(log[f"moe_load_{e}"] for e in range(4))
    assert kept + log["moe_dropped"] == log["moe_assignments"]
    router = next(m for m in model.modules() if hasattr(m, "router")).router
    (loss - plain_loss).backward()
    assert router.weight.grad.abs().sum() > 0  # the balance term trains the router


def test_models_without_routing_get_the_plain_loss(toy_data_bin):
    task, model, criterion, sample = build(toy_data_bin, "transformer", *CRITERION)
    torch.manual_seed(4)
    loss, _, log = criterion(model, sample)
    torch.manual_seed(4)
    plain_loss, _, plain_log = plain_criterion(task)(model, sample)
    assert torch.equal(loss, plain_loss) and log == plain_log


def test_reduce_metrics_hand_example():
    logs = [
        {"loss": 10.0, "nll_loss": 9.0, "ntokens": 10, "nsentences": 2, "sample_size": 10,
         "moe_balance_loss": 2.5 * 10, "moe_dropped": 3, "moe_assignments": 40,
         "moe_load_0": 30.0, "moe_load_1": 7.0},
        {"loss": 30.0, "nll_loss": 27.0, "ntokens": 30, "nsentences": 5, "sample_size": 30,
         "moe_balance_loss": 2.0 * 30, "moe_dropped": 1, "moe_assignments": 60,
         "moe_load_0": 20.0, "moe_load_1": 43.0},
    ]
    with metrics.aggregate(new_root=True) as aggregated:
        LabelSmoothedCrossEntropyWithMoeCriterion.reduce_metrics(logs)
        values = aggregated.get_smoothed_values()
    assert values["moe_balance_loss"] == pytest.approx((25 + 60) / 40)  # per-token weighted
    assert values["moe_dropped_frac"] == pytest.approx(4 / 100)
    assert values["moe_load_0"] == values["moe_load_1"] == pytest.approx(0.5)
    assert values["moe_load_entropy"] == pytest.approx(0.6931, abs=1e-4)  # ln 2: balanced


def test_reduce_metrics_reads_nothing_from_the_device(toy_data_bin):
    """reduce_metrics reads nothing from the device: the statistics stay tensors in fairseq's
    meters, read when it logs. A read per logged key is 7 host syncs per update, and one copy of
    them all still one more than stock fairseq (docs/history.md, 2026-11-27)."""
    _, model, criterion, sample = build(toy_data_bin, "widenet_transformer_wmt_en_de",
                                        *CRITERION)
    logs = [criterion(model, sample)[2] for _ in range(2)]  # two micro-batches
    syncs = {}
    for reduce in (LabelSmoothedCrossEntropyWithMoeCriterion, LabelSmoothedCrossEntropyCriterion):
        with torch.no_grad(), metrics.aggregate(new_root=True) as aggregated:
            with HostSyncCounter() as counter:
                reduce.reduce_metrics(logs)
            syncs[reduce] = counter.total
        if reduce is LabelSmoothedCrossEntropyWithMoeCriterion:
            values = aggregated.get_smoothed_values()
    moe, plain = syncs.values()
    assert moe == plain, syncs  # fairseq's own reads of loss, nll_loss, ..., none of ours
    kept = sum(float(sum(log[f"moe_load_{e}"] for log in logs)) for e in range(4))
    assert values["moe_load_0"] == pytest.approx(
        round(float(sum(log["moe_load_0"] for log in logs)) / kept, 3))


MOE_KEYS = ["moe_balance_loss", "moe_dropped_frac", "moe_load_0", "moe_load_1", "moe_load_2",
            "moe_load_entropy"]


def moe_log(sample_size, balance, dropped, assignments, loads):
    """One micro-batch's logging output as forward makes it: tensors, sample_size a number."""
    return {"loss": torch.tensor(4.0 * sample_size), "nll_loss": torch.tensor(3.0 * sample_size),
            "ntokens": sample_size, "nsentences": 2, "sample_size": sample_size,
            "moe_balance_loss": torch.tensor(balance * sample_size),
            "moe_dropped": torch.tensor(dropped), "moe_assignments": torch.tensor(assignments),
            **{f"moe_load_{e}": torch.tensor(float(load)) for e, load in enumerate(loads)}}


# Three updates of different sizes (the first of two micro-batches); expert 1 and 2 get nothing
# in the last one.
UPDATES = [
    [moe_log(10, 2.5, 3, 40, [20, 10, 7]), moe_log(20, 2.0, 1, 80, [40, 30, 9])],
    [moe_log(50, 3.0, 0, 100, [50, 25, 25])],
    [moe_log(5, 2.2, 10, 20, [10, 0, 0])],
]


def entropy(loads):
    return -sum(load / sum(loads) * math.log(load / sum(loads)) for load in loads if load > 0)


def old_moe_metrics(logging_outputs):
    """The MoE criterion's metrics before they were lazy: each update read to the host, then
    fairseq's weighted averages of the per-update values."""
    def total(key):
        return float(sum(log.get(key, 0) for log in logging_outputs))

    sample_size, assignments = total("sample_size"), total("moe_assignments")
    metrics.log_scalar("moe_balance_loss", total("moe_balance_loss") / max(sample_size, 1),
                       sample_size, round=4)
    metrics.log_scalar("moe_dropped_frac", total("moe_dropped") / max(assignments, 1),
                       assignments, round=4)
    load = [total(f"moe_load_{e}") for e in range(3)]
    kept = sum(load)
    if kept > 0:
        for e, expert_load in enumerate(load):
            metrics.log_scalar(f"moe_load_{e}", expert_load / kept, kept, round=3)
        metrics.log_scalar("moe_load_entropy", entropy(load), kept, round=4)


def test_reduce_metrics_makes_no_host_sync_and_logs_the_old_values_lazily():
    """Over a log interval of three updates, reduce_metrics and the trainer's per-update
    get_smoothed_values (its legacy logging output) read nothing from the device; what fairseq
    prints at the end of the interval is what the per-update host reads gave before."""
    with torch.no_grad(), metrics.aggregate(new_root=True) as interval:  # train_inner
        shown = []
        with HostSyncCounter() as syncs:
            for logs in UPDATES:
                with metrics.aggregate() as update:  # Trainer._reduce_and_log_stats
                    LabelSmoothedCrossEntropyWithMoeCriterion.reduce_metrics(logs)
                    shown += [update.get_smoothed_value(key) for key in MOE_KEYS]
        values = interval.get_smoothed_values()
    assert syncs.total == 0, syncs.by_site
    assert all(torch.is_tensor(value) for value in shown), shown  # read when fairseq logs
    values = {key: float(value) if torch.is_tensor(value) else value
              for key, value in values.items()}

    expected = {  # by hand: sums over the interval
        "moe_balance_loss": round((25 + 40 + 150 + 11) / (10 + 20 + 50 + 5), 4),  # 2.6588
        "moe_dropped_frac": round((3 + 1 + 0 + 10) / (40 + 80 + 100 + 20), 4),  # 0.0583
        "moe_load_0": round(120 / 226, 3), "moe_load_1": round(65 / 226, 3),
        "moe_load_2": round(41 / 226, 3),
        # each update's entropy, weighted by its kept assignments (116, 100, 10)
        "moe_load_entropy": round((116 * entropy([60, 40, 16]) + 100 * entropy([50, 25, 25])
                                   + 10 * 0.0) / 226, 4),  # 0.9638
    }
    assert expected["moe_balance_loss"] == 2.6588 and expected["moe_load_entropy"] == 0.9638
    assert {key: values[key] for key in MOE_KEYS} == pytest.approx(expected, abs=1e-12)

    with metrics.aggregate(new_root=True) as old:
        for logs in UPDATES:
            LabelSmoothedCrossEntropyCriterion.reduce_metrics(logs)
            old_moe_metrics(logs)
        old_values = old.get_smoothed_values()
    assert {key: values[key] for key in MOE_KEYS} == pytest.approx(
        {key: old_values[key] for key in MOE_KEYS}, abs=1e-12)
    # the same keys printed, in the same order, and no hidden sum among them
    assert [key for key in values if key.startswith("moe")] == MOE_KEYS
    assert list(values) == list(old_values)


LOG_LINE = re.compile(r"train_inner \| epoch \d+:\s+\d+ / \d+ (.*)$")
TIMING = {"wps", "ups", "wall", "train_wall"}


def logged_updates(output):
    """{num_updates: {metric: value}} of the train_inner lines, timings left out."""
    updates = {}
    for line in output.splitlines():
        match = LOG_LINE.search(line)
        if match:
            fields = dict(item.split("=", 1) for item in match.group(1).split(", "))
            updates[int(fields["num_updates"])] = {k: v for k, v in fields.items()
                                                   if k not in TIMING}
    return updates


def train(data, save_dir, max_update, *extra):
    flags = [f if f != "label_smoothed_cross_entropy" else CRITERION[1] for f in TRAIN_FLAGS]
    proc = run_fairseq("train", data, "--arch", "widenet_transformer_wmt_en_de", *TINY_MODEL,
                       *flags, "--save-dir", save_dir, "--max-update", str(max_update),
                       "--no-epoch-checkpoints", *extra)
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_widenet_trains_resumes_bit_exactly_and_decodes(toy_data_bin, tmp_path):
    # The straight run also saves its state after update 2, which the second run resumes from.
    straight = train(toy_data_bin, tmp_path / "straight", 4, "--save-interval-updates", "2")
    updates = logged_updates(straight)
    assert sorted(updates) == [1, 2, 3, 4]
    for logged in updates.values():
        # two routing calls, each at least K = 2 (Eq. 4 counts both selections of a token)
        assert float(logged["moe_balance_loss"]) > 3.9
        assert 0 <= float(logged["moe_dropped_frac"]) < 1
        assert 0 < float(logged["moe_load_entropy"]) <= 1.3863  # ln 4
        assert {f"moe_load_{e}" for e in range(4)} <= logged.keys()

    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "straight" / "checkpoint_1_2.pt",
                tmp_path / "resumed" / "checkpoint_last.pt")
    resumed = logged_updates(train(toy_data_bin, tmp_path / "resumed", 4))
    assert sorted(resumed) == [3, 4]  # really resumed from checkpoint_last.pt
    assert resumed[3] == updates[3] and resumed[4] == updates[4]
    final = [torch.load(tmp_path / run / "checkpoint_last.pt", weights_only=False)["model"]
             for run in ("straight", "resumed")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])

    generated = run_fairseq("generate", toy_data_bin, "--path",
                            tmp_path / "straight" / "checkpoint_last.pt", "--gen-subset", "test",
                            "--beam", "2", "--max-tokens", "400", "--cpu").stdout
    assert len(re.findall(r"^H-\d+\t", generated, flags=re.M)) == 40


@pytest.mark.slow
def test_widenet_trains_with_memory_efficient_fp16(toy_data_bin, tmp_path):
    output = train(toy_data_bin, tmp_path / "fp16", 2, "--memory-efficient-fp16",
                   "--moe-groups", "1")
    updates = logged_updates(output)
    assert 2 in updates
    for logged in updates.values():
        balance = float(logged["moe_balance_loss"])
        assert 1.9 < balance < 4  # one routing call (one group over 2 layers), at least K = 2
        assert float(logged["loss"]) < 20
