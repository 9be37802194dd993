"""The GPU check's set-up (see :mod:`multipath_nmt.benchmark.gpu_check`): its sizes and
precisions, the systems it trains, and the fairseq-train command each trains through
(``recipe.train_command``, as ``scripts/train.sh`` runs it, at the check's model size).
"""
from multipath_nmt import recipe
from multipath_nmt.benchmark.systems import System, systems_for

# "gpu" is the size the check is made for; "tiny" runs the same code on the CPU in seconds (the
# tests). ``steps`` updates per system in the per-family table (each of UPDATE_FREQ micro-batches
# of up to ``max_tokens``): the first ``warmup_steps`` neither timed nor counted (allocator,
# cuBLAS heuristics, lazily loaded kernels), the next ``sync_steps`` counted for syncs, the rest
# timed. ``lr_warmup_updates`` replaces the recipe's --warmup-updates; ``ddp_updates`` is the
# length of the fairseq-train run on 2 GPUs. ``recipe_*``: the recipe leg (gpu_check_recipe):
# ``recipe_updates`` (K) per run, then resumed to 2K, a save and a validation every
# ``recipe_interval`` updates, micro-batches of ``recipe_max_tokens`` (train.sh's update-freq
# kept), ``recipe_valid_sentences`` in the valid split, each process killed after
# ``recipe_timeout`` seconds (on the GPU a few times the longest process of the committed recipe
# leg, docs/bench/gpu-check-recipe-h200.json: a hung process must not eat the device time). The
# check's times on one H200 are in docs/gpu.md.
CHECK_SIZES = {
    "tiny": dict(dim=64, ffn=256, heads=4, vocab=1000, base_layers=2, decoder_layers=1,
                 max_tokens=256, mean_length=12, steps=6, warmup_steps=2, sync_steps=2,
                 lr_warmup_updates=2, beam_sentences=8, gemm_repeats=2, ddp_updates=4,
                 recipe_updates=4, recipe_interval=2, recipe_max_tokens=256,
                 recipe_lr_warmup_updates=2, recipe_valid_sentences=24, recipe_timeout=300),
    "gpu": dict(dim=512, ffn=2048, heads=8, vocab=32000, base_layers=6, decoder_layers=6,
                max_tokens=4096, mean_length=28, steps=20, warmup_steps=4, sync_steps=2,
                lr_warmup_updates=5, beam_sentences=32, gemm_repeats=20, ddp_updates=20,
                recipe_updates=4, recipe_interval=2, recipe_max_tokens=1024,
                recipe_lr_warmup_updates=3, recipe_valid_sentences=80, recipe_timeout=240),
}
# train.sh's micro-batches per update: its default batch is max-tokens x GPUs x 2 for the deep
# recipe (the check asks for that batch with --batch-tokens, for every arch)
UPDATE_FREQ = 2
# --precision: train.sh's (``auto`` as train.sh picks it), and memory-efficient-fp16, fairseq's
# fp16 optimizer and loss scaler added to the recipe's fp32 command: not what train.sh runs, but
# the one loss scaler that runs on the CPU, for the tests.
PRECISIONS = ("auto", *recipe.PRECISIONS, "memory-efficient-fp16")
CPU_STAND_INS = {"memory-efficient-fp16": ("fp32", ["--memory-efficient-fp16"])}
DDP_GPUS = 2
STOCK = "stock prenorm L"


def check_systems(size):
    """One system per architecture family, built like ``multipath-bench``'s."""
    by_name = {s.name: s for s in systems_for(size)}
    moe = System(
        "MoE (E4 k2, every 2nd layer)", "moe_transformer_wmt_en_de",
        [f"--encoder-layers={size['base_layers']}"],
        criterion="label_smoothed_cross_entropy_with_moe", compare_to=STOCK, group="MoE")
    names = [STOCK, "multi-path L x 4 (full)", "WideNet (shared attn + MoE E4 k2)", None,
             "EWA (E4, every-2)", "ParameterNet (routed, both)", "ParameterNet (dynamic, both)"]
    return [moe if name is None else by_name[name] for name in names]


def model_flags(size, system):
    """fairseq-train's flags for the model size of the check (the recipe sets none of them)."""
    return [
        f"--encoder-embed-dim={size['dim']}", f"--decoder-embed-dim={size['dim']}",
        f"--encoder-ffn-embed-dim={size['ffn']}", f"--decoder-ffn-embed-dim={size['ffn']}",
        f"--encoder-attention-heads={size['heads']}",
        f"--decoder-attention-heads={size['heads']}",
        f"--decoder-layers={size['decoder_layers']}", "--dropout=0.1", *system.flags,
    ]


def train_sh_arguments(size, system, precision, languages=("src", "tgt"), workers=1,
                       updates=None):
    """train.sh's arguments for one system: its arch and precision, a batch of UPDATE_FREQ
    micro-batches of ``max_tokens`` per worker, the check's model size, its length (``updates``,
    default: the check's ``steps``; EWA's schedule runs over it), a short learning-rate warm-up
    and a fixed seed (fairseq flags after the recipe's override them)."""
    recipe_precision, extra = CPU_STAND_INS.get(precision, (precision, []))
    return ["--arch", system.arch, "--precision", recipe_precision,
            "--max-tokens", str(size["max_tokens"]),
            "--batch-tokens", str(UPDATE_FREQ * size["max_tokens"] * workers),
            "-s", languages[0], "-t", languages[1], *model_flags(size, system),
            "--max-update", str(updates or size["steps"]),
            "--warmup-updates", str(size["lr_warmup_updates"]), "--seed", "1",
            "--no-progress-bar", *extra]


def check_command(data_dir, save_dir, size, system, precision, gpus, languages=("src", "tgt"),
                  extra=(), bf16=None, updates=None):
    """``recipe.train_command`` for one system: the fairseq-train command train.sh would run on
    ``gpus`` GPUs (0: the CPU), at the check's size. ``extra``: more fairseq-train flags."""
    return recipe.train_command(
        data_dir, save_dir, [*train_sh_arguments(size, system, precision, languages,
                                                 max(gpus, 1), updates), *extra],
        gpus=gpus, bf16=bf16)


def precision_flags(precision):
    """fairseq-train's flags for one of :data:`PRECISIONS` (after ``auto`` is resolved)."""
    base, extra = CPU_STAND_INS.get(precision, (precision, []))
    return [*recipe.PRECISIONS[base], *extra]


def resolve_precision(precision, device, bf16=None):
    """The precision the check trains in: ``auto`` as train.sh picks it (bf16 on GPUs that have
    it, else fp16; fp32 on the CPU); a request this device cannot run raises RecipeError."""
    if precision in CPU_STAND_INS:
        return precision
    return recipe.choose_precision(precision, int(device == "cuda"), bf16)
