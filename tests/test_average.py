"""multipath-average: exact float64 mean of real fairseq checkpoints, fairseq's file selection,
atomic output that fairseq-generate loads, and clear refusals."""
import collections

import pytest
import torch

from conftest import ROOT, TINY_MODEL, TRAIN_FLAGS, run_cli, run_fairseq, run_tool, script_env

from multipath_nmt import averaging
from multipath_nmt.checkpoint_io.dictionaries import DICTIONARIES
from multipath_nmt.cli.average import average, build_parser
from multipath_nmt.scoring import multi_bleu_files, score_generate_output
from fairseq import checkpoint_utils

pytestmark = pytest.mark.slow  # every test here uses a real fairseq-train run


@pytest.fixture(scope="module")
def run_dir(trains, toy_data_bin, tmp_path_factory):
    """Three epochs of a tiny model: checkpoint{1,2,3}.pt and update checkpoints every 4 updates."""
    save_dir = tmp_path_factory.mktemp("avg") / "ckpt"
    run_fairseq("train", toy_data_bin, "--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL,
                *TRAIN_FLAGS, "--max-epoch", "3", "--save-interval-updates", "4",
                "--save-dir", save_dir)
    return save_dir


def _model(path):
    return checkpoint_utils.load_checkpoint_to_cpu(str(path))["model"]


def _average(*argv):
    return average(build_parser().parse_args([str(a) for a in argv]))


def test_average_is_the_exact_mean(run_dir, tmp_path):
    inputs = [run_dir / f"checkpoint{e}.pt" for e in (3, 1, 2)]
    out = tmp_path / "avg.pt"
    _average("--inputs", *inputs, "--output", out)
    averaged = checkpoint_utils.load_checkpoint_to_cpu(str(out))
    models = [_model(p) for p in inputs]
    assert list(averaged["model"]) == list(models[0])
    for key, value in averaged["model"].items():
        expected = torch.stack([m[key].double() for m in models]).mean(0).to(models[0][key].dtype)
        assert value.dtype == models[0][key].dtype
        assert torch.equal(value, expected), key
    weight = "encoder.layers.0.fc1.weight"
    assert not torch.equal(averaged["model"][weight], models[0][weight])
    # Everything but the weights comes from the first input, as in fairseq's script.
    first = checkpoint_utils.load_checkpoint_to_cpu(str(inputs[0]))
    assert averaged["cfg"]["model"].arch == "transformer_prenorm_wmt_en_de"
    assert averaged["extra_state"]["train_iterator"] == first["extra_state"]["train_iterator"]
    # the dictionaries' symbols too, for fairseq-generate's check of the data-bin
    assert averaged[DICTIONARIES] == first[DICTIONARIES] and len(first[DICTIONARIES]["source"]) > 4
    assert not list(tmp_path.glob("*.tmp"))


def test_last_n_selection(run_dir):
    pick = averaging.last_n_checkpoints
    assert pick(run_dir, 2, update_based=False) == [str(run_dir / "checkpoint3.pt"), str(run_dir / "checkpoint2.pt")]
    assert pick(run_dir, 2, update_based=False, upper_bound=2) == \
        [str(run_dir / "checkpoint2.pt"), str(run_dir / "checkpoint1.pt")]
    updates = sorted((int(p.stem.split("_")[2]), p.name) for p in run_dir.glob("checkpoint_*_*.pt"))
    assert len(updates) >= 3
    assert pick(run_dir, 3, update_based=True) == [str(run_dir / n) for _, n in updates[::-1][:3]]
    with pytest.raises(averaging.AveragingError, match="found 3 epoch .* but need 4"):
        pick(run_dir, 4, update_based=False)


@pytest.mark.process
def test_average_sh_and_generate_load_the_result(run_dir, toy_data_bin, tmp_path):
    out = tmp_path / "avg.pt"
    env = script_env()
    proc = run_cli(["bash", ROOT / "scripts" / "average.sh", run_dir, "2", out], env=env)
    assert "checkpoint3.pt" in proc.stdout and "checkpoint2.pt" in proc.stdout
    expected = (_model(run_dir / "checkpoint3.pt")["encoder.embed_tokens.weight"].double()
                + _model(run_dir / "checkpoint2.pt")["encoder.embed_tokens.weight"].double()) / 2
    assert torch.equal(_model(out)["encoder.embed_tokens.weight"], expected.float())
    # fairseq-generate (through translate.sh, with the paper's decoding defaults) loads it.
    prefix = tmp_path / "test"
    run_cli(["bash", ROOT / "scripts" / "translate.sh", toy_data_bin, out, prefix,
             "--max-tokens", "2000"], env=env)
    generate = (prefix.parent / "test.generate").read_text()
    assert "Generate test with beam=4" in generate
    hyps = (prefix.parent / "test.hyp").read_text().splitlines()
    refs = (prefix.parent / "test.ref").read_text().splitlines()
    assert len(hyps) == len(refs) == 40
    by_id = {int(line.split("\t")[0][2:]): line.split("\t")[1] for line in generate.splitlines()
             if line.startswith("T-")}
    assert refs == [by_id[i] for i in range(40)]
    # ... and the scorer reads the same generate output (sorted by id) into the same files.
    stats = score_generate_output(prefix.parent / "test.generate").multi_bleu
    assert stats == multi_bleu_files(prefix.parent / "test.hyp", prefix.parent / "test.ref")


def _edited_copy(run_dir, tmp_path, edit):
    state = checkpoint_utils.load_checkpoint_to_cpu(str(run_dir / "checkpoint1.pt"))
    edit(state)
    path = tmp_path / "edited.pt"
    averaging.save_atomically(state, path)
    return path


def _set_arch(state):
    state["cfg"]["model"].arch = "transformer_deep12_wmt_en_de"


def _reshape(state):
    state["model"]["encoder.layers.0.fc1.weight"] = torch.zeros(3, 3)


def _drop_key(state):
    del state["model"]["encoder.layers.0.fc1.bias"]


def _other_symbols(state):
    symbols = state[DICTIONARIES]["target"] = list(state[DICTIONARIES]["target"])
    symbols[4], symbols[5] = symbols[5], symbols[4]


def _int_buffer(value):
    def edit(state):
        state["model"] = collections.OrderedDict(state["model"], **{"encoder.counter": torch.tensor([value])})
    return edit


@pytest.mark.parametrize("edit,message", [
    (_set_arch, "is a 'transformer_deep12_wmt_en_de' model but .* is a 'transformer_prenorm_wmt_en_de'"),
    (_reshape, r"encoder.layers.0.fc1.weight is torch.float32 \(3, 3\) in .*edited.pt but torch.float32 \(64, 32\)"),
    (_drop_key, r"different parameters \(only in the former: \[\], only in the latter: \['encoder.layers.0.fc1.bias'\]\)"),
    (_other_symbols, r"edited.pt was trained with other dictionaries than .*ckpt/checkpoint2.pt; average "
                     "checkpoints of one run only"),
])
def test_incompatible_checkpoints_refused(run_dir, tmp_path, edit, message):
    edited = _edited_copy(run_dir, tmp_path, edit)
    out = tmp_path / "avg.pt"
    with pytest.raises(averaging.AveragingError, match=message):
        _average("--inputs", run_dir / "checkpoint2.pt", edited, "--output", out)
    assert not out.exists()


def test_non_float_tensors_must_agree(run_dir, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    same_a = _edited_copy(run_dir, tmp_path / "a", _int_buffer(7))
    same_b = _edited_copy(run_dir, tmp_path / "b", _int_buffer(7))
    _average("--inputs", same_a, same_b, "--output", tmp_path / "ok.pt")
    assert torch.equal(_model(tmp_path / "ok.pt")["encoder.counter"], torch.tensor([7]))
    different = _edited_copy(run_dir, tmp_path / "b", _int_buffer(8))
    with pytest.raises(averaging.AveragingError, match="encoder.counter is a non-float tensor that differs"):
        _average("--inputs", same_a, different, "--output", tmp_path / "bad.pt")


def test_cli_errors_leave_no_output(run_dir, tmp_path):
    out = tmp_path / "avg.pt"
    cases = [
        (["--inputs", tmp_path / "missing.pt"], "missing.pt: no such checkpoint file"),
        (["--inputs", tmp_path, "--num-epoch-checkpoints", "2"], "found 0 epoch"),
        (["--inputs", tmp_path], "is a directory; pass checkpoint files, or add --num-epoch-checkpoints"),
        (["--inputs", run_dir / "checkpoint1.pt", "--checkpoint-upper-bound", "2"],
         "--checkpoint-upper-bound needs"),
    ]
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    cases.append((["--inputs", tmp_path / "garbage.pt"], r"garbage.pt: not a PyTorch checkpoint \(it starts with bytes 6e 6f 74"))
    for argv, message in cases:
        with pytest.raises(averaging.AveragingError, match=message):
            _average(*argv, "--output", out)
    proc = run_tool("multipath-average", "--inputs",
                    tmp_path / "missing.pt", "--output", out, check=False)
    assert proc.returncode == 1 and "missing.pt: no such checkpoint file" in proc.stderr
    assert not out.exists()
