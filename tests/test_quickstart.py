"""scripts/quickstart.sh (the README's main job) end to end, at a toy size, and the README's
one-command export of its model to transformers (scripts/export-hf.sh)."""
import re

import pytest

from conftest import ROOT, run_cli, script_env


@pytest.mark.slow
@pytest.mark.process
def test_quickstart_end_to_end(tmp_path, monkeypatch):
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

    # the README's export of the quickstart's model: raw text in, the test.hyp of translate.sh
    # out (beam 4, lenpen 0.6), detokenized
    transformers = pytest.importorskip("transformers")
    from sacremoses import MosesDetokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and the remote code's module cache in tmp_path
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE",
                        str(tmp_path / "modules"))
    run_cli(["bash", ROOT / "scripts" / "export-hf.sh", work / "checkpoints" / "checkpoint_avg.pt",
             work / "hf", work / "data-bin", "--bpe-codes", work / "data-bin" / "bpecodes"],
            env=script_env())
    card = (work / "hf" / "README.md").read_text()
    assert "--arch multipath_transformer_wmt_en_de" in card and score[1] in card
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(work / "hf",
                                                               trust_remote_code=True)
    raw = (work / "raw" / "test.en").read_text().splitlines()[:20]
    batch = tokenizer(raw, return_tensors="pt", padding=True)
    got = tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True)
    detokenizer = MosesDetokenizer("de")
    expected = [detokenizer.detokenize(line.split())
                for line in (work / "test.hyp").read_text().splitlines()[:20]]
    assert sum(a == b for a, b in zip(got, expected)) >= 19, list(zip(got, expected))
