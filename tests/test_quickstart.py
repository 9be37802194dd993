"""scripts/quickstart.sh (the README's main job) end to end, at a toy size."""
import re

import pytest

from conftest import ROOT, run_cli, script_env


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    work = tmp_path / "qs"
    env = script_env(QUICKSTART_TRAIN_PAIRS="1500", QUICKSTART_TEST_PAIRS="60",
                     QUICKSTART_EPOCHS="2", QUICKSTART_AVERAGE="2")
    proc = run_cli(["bash", ROOT / "scripts" / "quickstart.sh", work], env=env, timeout=900)
    score = (work / "score.txt").read_text().splitlines()
    assert re.fullmatch(r"BLEU = \d+\.\d\d, [\d./]+ \(BP=\d\.\d{3}, ratio=\d\.\d{3}, "
                        r"hyp_len=\d+, ref_len=\d+\)", score[0])
    assert score[1].startswith("sacreBLEU = ") and "nrefs:1" in score[1]
    assert len((work / "test.hyp").read_text().splitlines()) == 60  # every test sentence
    assert sorted(p.name for p in (work / "checkpoints").glob("checkpoint?.pt")) == [
        "checkpoint1.pt", "checkpoint2.pt"]
    assert (work / "checkpoints" / "checkpoint_avg.pt").is_file()
    assert (work / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "== quickstart done" in proc.stdout
