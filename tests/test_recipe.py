"""multipath_nmt.recipe: the paper's global batch (4,096 / 8,192 tokens per GPU on 8 GPUs) split
over any GPU count, the CPU batch, the overrides, the refusals, the embedding sharing, and the
translation files of translate.sh (the command lines are tested through train.sh and translate.sh
--dry-run)."""
import pytest

from multipath_nmt.arch_table import ARCHS, Shape
from multipath_nmt.recipe import (ARCH_RECIPES, BASE, DEEP, PRECISIONS, RecipeError, batch_plan,
                                  choose_precision, criterion_for_arch, dictionary_files,
                                  embedding_sharing, finish_translation, recipe_for_arch)
from conftest import dictionaries_only_data_bin


def test_recipes_are_the_papers():
    assert (BASE.lr, BASE.warmup_updates, BASE.tokens_per_gpu, BASE.global_batch) == (
        "0.001", 8000, 4096, 32768)
    assert (DEEP.lr, DEEP.warmup_updates, DEEP.tokens_per_gpu, DEEP.global_batch) == (
        "0.002", 16000, 8192, 65536)


@pytest.mark.parametrize("arch,recipe,criterion", [
    ("transformer_prenorm_wmt_en_de", BASE, "label_smoothed_cross_entropy"),
    # the paper's Limitations: other depths and widths take the deep models' hyperparameters
    ("transformer_wide_wmt_en_de", DEEP, "label_smoothed_cross_entropy"),
    ("transformer_deep24_wmt_en_de", DEEP, "label_smoothed_cross_entropy"),
    ("multipath_l6_p4_wmt_en_de", DEEP, "label_smoothed_cross_entropy"),
    ("widenet_transformer_wmt_en_de", DEEP, "label_smoothed_cross_entropy_with_moe"),
    ("ewa_transformer_wmt_en_de", DEEP, "label_smoothed_cross_entropy_with_moe"),
    ("parameternet_transformer_wmt_en_de", DEEP, "label_smoothed_cross_entropy_with_moe"),
    ("moe_transformer_wmt_en_de", DEEP, "label_smoothed_cross_entropy_with_moe"),
])
def test_recipe_and_criterion_per_arch(arch, recipe, criterion):
    assert recipe_for_arch(arch) is recipe and criterion_for_arch(arch) == criterion


@pytest.mark.parametrize("choice,gpus,bf16,precision", [
    ("auto", 8, True, "bf16"),    # Ampere and later
    ("auto", 8, False, "fp16"),   # Volta, Turing
    ("auto", 0, None, "fp32"),    # the CPU
    ("bf16", 0, None, "bf16"),    # bfloat16 autocast runs on the CPU too
    ("fp32", 8, True, "fp32"),
    ("fp16", 1, True, "fp16"),
])
def test_one_precision_for_every_arch(choice, gpus, bf16, precision):
    assert choose_precision(choice, gpus, bf16) == precision
    assert PRECISIONS[precision] == {"bf16": ["--amp", "--bf16"], "fp16": ["--amp"],
                                     "fp32": []}[precision]


@pytest.mark.parametrize("choice,gpus,bf16,message", [
    ("fp16", 0, None, "--precision fp16 needs a CUDA GPU (its loss scaler and float16 autocast "
                      "are CUDA's); on the CPU use --precision bf16 or fp32"),
    ("bf16", 2, False, "--precision bf16: this GPU has no native bfloat16 (it needs compute "
                       "capability 8.0 or later); use --precision fp16"),
    ("half", 0, None, "--precision must be auto, bf16, fp16 or fp32, got 'half'"),
])
def test_precisions_that_cannot_run_are_refused(choice, gpus, bf16, message):
    with pytest.raises(RecipeError) as error:
        choose_precision(choice, gpus, bf16)
    assert str(error.value) == message


# (GPUs, max-tokens, update-freq), computed by hand from max-tokens x GPUs x update-freq = global.
@pytest.mark.parametrize("recipe,gpus,max_tokens,update_freq", [
    (BASE, 1, 4096, 8),    # 4096 x 1 x 8  = 32768
    (BASE, 2, 4096, 4),    # 4096 x 2 x 4  = 32768
    (BASE, 8, 4096, 1),    # 4096 x 8 x 1  = 32768: the paper's set-up
    (BASE, 16, 2048, 1),   # 2048 x 16 x 1 = 32768: max-tokens lowered to the GPU's share
    (DEEP, 1, 4096, 16),   # 4096 x 1 x 16 = 65536
    (DEEP, 2, 4096, 8),    # 4096 x 2 x 8  = 65536
    (DEEP, 8, 4096, 2),    # 4096 x 8 x 2  = 65536: the authors' "4096 x 2 per GPU"
    (DEEP, 16, 4096, 1),   # 4096 x 16 x 1 = 65536
])
def test_the_papers_global_batch_on_any_gpu_count(recipe, gpus, max_tokens, update_freq):
    plan = batch_plan(recipe, gpus)
    assert (plan.max_tokens, plan.workers, plan.update_freq) == (max_tokens, gpus, update_freq)
    assert plan.global_batch == recipe.global_batch
    assert plan.arithmetic().startswith(
        f"{max_tokens:,} max-tokens x {gpus} GPU(s) x {update_freq} update-freq = "
        f"{recipe.global_batch:,} tokens per update")


@pytest.mark.parametrize("recipe,total,suggestion", [
    # 32768 / 3 and 65536 / 3 are not integers (powers of two); the suggestion is the largest
    # batch below with update-freq ceil(total / (3 x 4096)) and max-tokens total // (3 x uf):
    (BASE, "32,768", "--batch-tokens 32760 (3640 max-tokens x 3 workers x 3 update-freq)"),
    (DEEP, "65,536", "--batch-tokens 65520 (3640 max-tokens x 3 workers x 6 update-freq)"),
])
def test_three_gpus_are_refused_with_a_batch_they_can_split(recipe, total, suggestion):
    with pytest.raises(RecipeError) as error:
        batch_plan(recipe, 3)
    assert str(error.value) == (
        f"{total} tokens per update (the paper's {recipe.tokens_per_gpu:,}, read as per GPU, x 8 GPUs) "
        f"cannot be split evenly over 3 GPUs; use a GPU count that divides it "
        f"(CUDA_VISIBLE_DEVICES selects them) or pass {suggestion}")
    # The suggestion works.
    plan = batch_plan(recipe, 3, batch_tokens=int(suggestion.split()[1]))
    assert (plan.max_tokens, plan.update_freq) == (3640, int(suggestion.split()[-2]))


def test_cpu_batch_is_one_gpus_share():
    plan = batch_plan(BASE, 0)
    assert (plan.max_tokens, plan.workers, plan.update_freq, plan.global_batch) == (4096, 1, 1, 4096)
    plan = batch_plan(DEEP, 0)
    assert (plan.max_tokens, plan.workers, plan.update_freq, plan.global_batch) == (4096, 1, 2, 8192)
    assert plan.arithmetic() == ("4,096 max-tokens x 1 CPU process x 2 update-freq = 8,192 tokens "
                                 "per update (one GPU's share of the paper's batch on the CPU)")


@pytest.mark.parametrize("gpus,max_tokens,batch_tokens,expected", [
    (8, None, 30000, (3750, 1)),     # 30000 / 8 = 3750 <= 4096
    (1, None, 30000, (3750, 8)),     # 30000 = 8 x 3750; ceil(30000 / 4096) = 8 divides it
    (2, None, 98304, (4096, 12)),    # 98304 / 2 = 49152 = 12 x 4096
    (0, None, 65536, (4096, 16)),    # the paper's deep batch on the CPU
    (1, 3000, None, (2048, 32)),     # DEEP on 1 GPU, cap 3000: largest divisor of 65536 <= 3000
    (4, 5000, None, (4096, 4)),      # 65536 / 4 = 16384 = 4 x 4096 (a cap of 5000 gives 4096)
])
def test_max_tokens_cap_and_batch_tokens_override(gpus, max_tokens, batch_tokens, expected):
    plan = batch_plan(DEEP, gpus, max_tokens=max_tokens, batch_tokens=batch_tokens)
    assert (plan.max_tokens, plan.update_freq) == expected
    assert plan.global_batch == (batch_tokens or 65536)
    if batch_tokens:
        assert plan.arithmetic().endswith("(--batch-tokens)")


def test_batch_without_an_even_micro_batch_is_refused():
    with pytest.raises(RecipeError) as error:
        batch_plan(BASE, 1, batch_tokens=100003)  # a prime: only 1 x 100003 or 100003 x 1
    assert str(error.value) == (
        "100,003 tokens per worker (100,003 / 1) cannot be cut into equal micro-batches of 2,048 "
        "to 4,096 tokens (max-tokens 4,096); pass --batch-tokens 100000 (4000 max-tokens x 1 "
        "workers x 25 update-freq) or another max-tokens")


def test_explicit_update_freq_replaces_the_arithmetic():
    plan = batch_plan(DEEP, 0, max_tokens=2048, update_freq=1)  # the study's and quickstart's
    assert (plan.max_tokens, plan.update_freq, plan.global_batch) == (2048, 1, 2048)
    assert "--update-freq given: not the recipe's batch" in plan.arithmetic()
    assert batch_plan(BASE, 4, update_freq=3).global_batch == 4096 * 4 * 3
    with pytest.raises(RecipeError, match="give --batch-tokens or --update-freq, not both"):
        batch_plan(BASE, 1, batch_tokens=4096, update_freq=2)


def test_non_positive_values_are_refused():
    with pytest.raises(RecipeError, match="max-tokens must be a positive integer, got 0"):
        batch_plan(BASE, 1, max_tokens=0)
    with pytest.raises(RecipeError, match="--batch-tokens must be a positive integer, got -5"):
        batch_plan(BASE, 1, batch_tokens=-5)


@pytest.mark.parametrize("src,tgt,joined,flags", [
    ("en", "de", True, ["--share-all-embeddings"]),   # Table 2: one joined, shared embedding
    ("de", "en", True, ["--share-all-embeddings"]),
    ("en", "fr", True, []),                           # Table 3's sizes: nothing shared
    ("fr", "en", False, []),
    ("en", "ru", False, []),                          # differing dictionaries cannot be shared
])
def test_embedding_sharing_auto(tmp_path, src, tgt, joined, flags):
    files = dictionary_files(dictionaries_only_data_bin(tmp_path / "bin", src, tgt, joined))
    assert [f.name for f in files] == [f"dict.{src}.txt", f"dict.{tgt}.txt"]
    assert embedding_sharing(files) == flags


def test_embedding_sharing_choices_and_errors(tmp_path):
    joined = dictionary_files(dictionaries_only_data_bin(tmp_path / "joined", "en", "fr", True))
    separate = dictionary_files(dictionaries_only_data_bin(tmp_path / "separate", "en", "de", False))
    assert embedding_sharing(joined, "shared") == ["--share-all-embeddings"]
    assert embedding_sharing(separate, "separate") == []
    with pytest.raises(RecipeError, match="--embeddings shared needs a joined dictionary, but "
                                          ".*dict.en.txt and .*dict.de.txt differ"):
        embedding_sharing(separate, "shared")
    with pytest.raises(RecipeError, match="--embeddings must be auto, shared or separate"):
        embedding_sharing(joined, "tied")
    with pytest.raises(RecipeError, match="has no dict.*.txt"):
        dictionary_files(tmp_path / "missing")
    three = dictionaries_only_data_bin(tmp_path / "three", "en", "de", True)
    (three / "dict.fr.txt").write_text("a 1\n")
    (three / "train.en-de.en.idx").unlink()
    with pytest.raises(RecipeError, match="dictionaries for de, en, fr: pass --source-lang and "
                                          "--target-lang"):
        dictionary_files(three)
    assert [f.name for f in dictionary_files(three, "fr", "en")] == ["dict.fr.txt", "dict.en.txt"]


def test_finish_translation_sorts_by_sentence_id_and_refuses_an_unfinished_output(tmp_path):
    # fairseq-generate's lines in batch order; ids 2 and 10 sort numerically, not as text; with
    # --nbest 2 both hypotheses of sentence 10 are kept in their order; tabs and spaces kept
    output = ("S-10\tz\nT-10\tZ\nH-10\t-0.3\tz\nH-10\t-0.9\tz z\nD-10\t-0.3\tz\n"
              "S-2\tb c\nT-2\tB  C\nH-2\t-0.2\tb\tc\nP-2\t-0.1 -0.1\n"
              "S-0\ta\nT-0\tA\nH-0\t-0.1\ta\n"
              "Generate test with beam=4: BLEU4 = 12.0\n")
    out = tmp_path / "test"
    (tmp_path / "test.generate.tmp").write_text(output)
    assert finish_translation(out) == 4
    assert (tmp_path / "test.generate").read_text() == output
    assert (tmp_path / "test.hyp").read_text() == "a\nb\tc\nz\nz z\n"
    assert (tmp_path / "test.ref").read_text() == "A\nB  C\nZ\n"
    assert not (tmp_path / "test.generate.tmp").exists()
    # killed before its last line: nothing replaces an earlier output, the partial one stays
    partial = tmp_path / "valid.generate.tmp"
    partial.write_text(output.rsplit("Generate", 1)[0])
    with pytest.raises(RecipeError, match=f"^fairseq-generate did not finish; partial output "
                                          f"left in {partial}$"):
        finish_translation(tmp_path / "valid")
    assert partial.exists() and not (tmp_path / "valid.generate").exists()


def test_every_architecture_the_plug_in_registers_has_a_row_in_the_arch_table():
    """A new arch without a row in the arch table fails here (train.sh would refuse it, and the
    memory model would have no shape for it), and every row names an arch that fairseq knows once
    the plug-in is loaded, of the model the row names; the recipes are the table's."""
    import multipath_nmt  # noqa: F401  (registers the plug-in's architectures)
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY

    ours = {arch for arch, function in ARCH_CONFIG_REGISTRY.items()
            if function.__module__.startswith("multipath_nmt.")}
    assert len(ours) >= 23 and "multipath_l6_p4_wmt_en_de" in ours
    assert sorted(ours - set(ARCHS)) == []
    assert sorted(set(ARCHS) - set(ARCH_CONFIG_REGISTRY)) == []
    assert {arch: ARCH_MODEL_NAME_REGISTRY[arch] for arch in ARCHS} == {
        arch: row.model for arch, row in ARCHS.items()}
    assert list(ARCH_RECIPES) == list(ARCHS) and set(ARCH_RECIPES.values()) == {BASE, DEEP}
    assert all(ARCH_RECIPES[arch] is {"base": BASE, "deep": DEEP}[row.recipe]
               for arch, row in ARCHS.items())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_each_rows_shape_is_the_registered_archs_defaults_and_has_a_memory_model(tmp_path, arch):
    """The row's shape is the encoder layers, paths, decoder layers, width and FFN width (the
    decoder's the same) that the registered arch gives a command line without them; a routed row
    (and only the routed models' rows) names a family the memory model has a measured peak of;
    the memory model plans a micro-batch for every row."""
    from argparse import Namespace

    import multipath_nmt  # noqa: F401  (registers the plug-in's architectures)
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from multipath_nmt.recipe import memory_model

    row, args = ARCHS[arch], Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    assert Shape(args.encoder_layers, getattr(args, "encoder_paths", 1), args.decoder_layers,
                 args.encoder_embed_dim, args.encoder_ffn_embed_dim) == row.shape
    assert (args.decoder_embed_dim, args.decoder_ffn_embed_dim) == (row.shape.dim, row.shape.ffn)
    assert (row.routed is not None) == (row.model in ("widenet_transformer", "moe_transformer"))
    assert row.routed is None or row.routed in memory_model._ROUTED_PEAKS
    (tmp_path / "dict.en.txt").write_text("".join(f"w{i} 1\n" for i in range(31996)))
    assert memory_model.estimate(arch, [tmp_path / "dict.en.txt"], True).max_tokens(143771) > 0


@pytest.mark.parametrize("arch", ["transformer_vaswani_wmt_en_de_big", "my_multipath_variant",
                                  "moe_my_variant", ""])
def test_an_arch_without_a_row_is_refused_not_given_a_recipe(arch, tmp_path):
    """Nor a criterion or a memory model by its name (as a prefix of a routed family would)."""
    from multipath_nmt.recipe.memory_model import estimate

    for refused in (recipe_for_arch, criterion_for_arch):
        with pytest.raises(RecipeError) as error:
            refused(arch)
        assert str(error.value) == (
            f"unknown arch '{arch}': no recipe for it in multipath_nmt/arch_table.py's "
            f"ARCHS; add a row (recipe base or deep) for it there")
    (tmp_path / "dict.en.txt").write_text("w 1\n")
    with pytest.raises(RecipeError) as error:
        estimate(arch, [tmp_path / "dict.en.txt"], True)
    assert str(error.value) == (
        f"no memory model for arch '{arch}': it has no row in multipath_nmt/arch_table.py's "
        f"ARCHS; give --max-tokens N")


def test_the_memory_models_peaks_are_those_of_the_committed_gpu_run():
    """Every figure the GPU memory model is fitted to is a peak in docs/bench/gpu-check-h200.json
    (the GPU check's table of 2026-11-27, at the commit docs/history.md names for it), at that
    run's micro-batch and dictionary."""
    import json
    from pathlib import Path

    from multipath_nmt.recipe import memory_model

    run = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench" /
                      "gpu-check-h200.json").read_text())
    history = (Path(__file__).resolve().parents[1] / "docs" / "history.md").read_text()
    entry = history.split("\n## 2026-11-27: the GPU check's table on an H200")[1].split("\n## ")[0]
    assert f"at `{run['environment']['commit'][:7]}`" in entry and run["precision"] == "bf16"
    assert (run["shape"]["max_tokens"], run["shape"]["vocab"]) == (
        memory_model.MEASURED_MAX_TOKENS, memory_model.MEASURED_VOCAB)
    peaks = {(s["peak_memory_mib"], s["params"]) for s in run["systems"].values()}
    assert set(memory_model._ROUTED_PEAKS.values()) <= peaks
    assert {(3931.21142578125, 60524544), (5962.7158203125, 117279804)} <= peaks
    base = run["systems"]["stock prenorm L"]
    assert (base["peak_memory_mib"], base["params"]) == (3931.21142578125, 60524544)


def test_the_periodic_saves_speeds_are_those_of_the_committed_gpu_run():
    """The tokens per second that size the periodic save are medians of
    docs/bench/gpu-bench-h200.json: the base recipe's Transformer 6+6 row and, for the deep
    recipe, its slowest row (every row but the anchor and the base model's), rounded."""
    import json
    from pathlib import Path

    from multipath_nmt.recipe.commands import REFERENCE_TOKENS_PER_SECOND

    run = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench" /
                      "gpu-bench-h200.json").read_text())
    assert run["precision"] == "bf16"
    medians = {name: row["tokens_per_s"]["median"] for name, row in run["rows"].items()}
    deep = [m for name, m in medians.items()
            if not name.startswith(("anchor", "transformer 6+6"))]
    assert REFERENCE_TOKENS_PER_SECOND == {"base": round(medians["transformer 6+6"]),
                                           "deep/multi-path": round(min(deep))}
    assert set(REFERENCE_TOKENS_PER_SECOND) == {BASE.name, DEEP.name}


@pytest.mark.parametrize("arch", ["transformer_prenorm_wmt_en_de", "transformer_deep24_wmt_en_de",
                                  "transformer_wide_wmt_en_de", "multipath_l6_p4_wmt_en_de",
                                  "multipath_l12_p3_wmt_en_de"])
def test_the_memory_models_shapes_are_the_built_models(tmp_path, arch):
    """The static memory counts the parameters of the model fairseq builds for the arch, to 1%
    (the count leaves out biases and LayerNorms)."""
    from multipath_nmt.params import build_model
    from multipath_nmt.recipe.memory_model import STATIC_BYTES_PER_PARAM, estimate

    (tmp_path / "dict.en.txt").write_text("".join(f"w{i} 1\n" for i in range(31996)))
    built = sum(p.numel() for p in build_model(arch, 32000).parameters())
    counted = estimate(arch, [tmp_path / "dict.en.txt"], True).static_bytes / STATIC_BYTES_PER_PARAM
    assert abs(counted / built - 1) < 0.01



# --- planning for GPUs on a machine without one (a login node) ------------------------------

def _plan_without_a_visible_gpu(tmp_path, monkeypatch, capsys, cuda_build, *args, **env):
    """train.sh's main (``recipe_scripts.main``) with ``MULTIPATH_NMT_NUM_GPUS=8`` where torch
    sees no CUDA device: a CPU-only build, or a CUDA build (``cuda_build``) on a machine without
    a GPU, whatever this machine has; ``env``: more variables. Returns (the exit status or
    message, None when it returned; stdout; stderr)."""
    import torch

    from multipath_nmt.cli import recipe_scripts

    data_bin = dictionaries_only_data_bin(tmp_path / "data-bin", "en", "de", joined=True)
    for name in ("MULTIPATH_NMT_GPU_MEMORY_MIB", "MULTIPATH_NMT_BF16", "MULTIPATH_NMT_DDP_ON_CPU",
                 "MAX_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"MULTIPATH_NMT_NUM_GPUS": "8", **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "12.8" if cuda_build else None)
    code = None
    try:
        recipe_scripts.main(["train.sh", str(data_bin), str(tmp_path / "save"), "--arch",
                             "transformer_prenorm_wmt_en_de", *args, "--dry-run"])
    except SystemExit as stopped:
        code = stopped.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.mark.parametrize("cuda_build", [False, True])
def test_a_dry_run_for_gpus_without_a_visible_gpu_names_the_memory_variable(
        tmp_path, monkeypatch, capsys, cuda_build):
    """MULTIPATH_NMT_NUM_GPUS=8 train.sh ... --dry-run on a login node: no GPU to size the
    micro-batch from. One line naming MULTIPATH_NMT_GPU_MEMORY_MIB and --max-tokens, not
    torch's "Torch not compiled with CUDA enabled" (or a CUDA build's RuntimeError)."""
    import torch

    code, out, err = _plan_without_a_visible_gpu(tmp_path, monkeypatch, capsys, cuda_build)
    build = ("built for CUDA 12.8, which finds no GPU on this machine" if cuda_build else
             "a CPU-only build")
    assert code == (
        f"train.sh: error: MULTIPATH_NMT_NUM_GPUS=8 counts GPUs that PyTorch {torch.__version__} "
        f"does not see here ({build}), so no GPU's memory can size the micro-batch: set "
        "MULTIPATH_NMT_GPU_MEMORY_MIB to one GPU's memory in MiB (nvidia-smi's memory.total on "
        "the GPU machine, e.g. 143771 for an H200) or give --max-tokens N")
    assert out == ""


@pytest.mark.parametrize("args,env,micro_batch", [
    ([], {"MULTIPATH_NMT_GPU_MEMORY_MIB": "143771"}, "(MULTIPATH_NMT_GPU_MEMORY_MIB)"),
    (["--max-tokens", "4096"], {}, "--max-tokens given (a cap)"),
])
def test_a_dry_run_for_gpus_without_a_visible_gpu_plans_with_the_memory_variable(
        tmp_path, monkeypatch, capsys, args, env, micro_batch):
    """With MULTIPATH_NMT_GPU_MEMORY_MIB or --max-tokens the plan is printed; the precision,
    which no GPU can be asked about, is said to be an assumption, with the variable that sets
    it."""
    code, out, err = _plan_without_a_visible_gpu(tmp_path, monkeypatch, capsys, False, *args,
                                                 **env)
    assert code is None and err == ""
    [line] = [line for line in out.splitlines() if line.startswith("train.sh: micro-batch: ")]
    assert micro_batch in line
    assert "train.sh: 8 GPU(s), precision fp16 (" in out
    assert ("train.sh: precision fp16 is assumed: no GPU is visible here to ask whether it has "
            "bfloat16; MULTIPATH_NMT_BF16=1 plans bf16 (GPUs of compute capability 8.0 or later), "
            "=0 fp16") in out


def test_a_dry_run_for_gpus_without_a_visible_gpu_keeps_a_chosen_bf16(tmp_path, monkeypatch,
                                                                       capsys):
    """--precision bf16 with no GPU to check it against is the user's choice, not refused as
    a GPU without bfloat16."""
    code, out, err = _plan_without_a_visible_gpu(tmp_path, monkeypatch, capsys, False,
                                                 "--max-tokens", "4096", "--precision", "bf16")
    assert code is None and err == ""
    assert "train.sh: 8 GPU(s), precision bf16 (" in out and "is assumed" not in out
