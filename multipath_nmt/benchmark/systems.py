"""The systems under test: the line-up of ``multipath-bench``, their fairseq-train flags, and how
each is built (fairseq's own parser, task, model, criterion and ``Trainer``)."""
from dataclasses import dataclass, field

# Shared by every system of one size: the decoder is the same everywhere, so differences come
# from the encoders the papers compare. A training measurement runs at least ``steps`` steps and
# at least ``measure_seconds`` of the benchmark clock, so fast systems are not timed over shorter
# windows than slow ones (a few steps of a small model spread more, min to max, than those of a
# large one).
SIZES = {
    "tiny": dict(dim=64, ffn=256, heads=4, vocab=1000, batch=8, length=12, base_layers=2,
                 repeats=2, steps=1, measure_seconds=0.0, beam_sentences=4),
    "default": dict(dim=256, ffn=1024, heads=4, vocab=8000, batch=32, length=32, base_layers=6,
                    repeats=6, steps=3, measure_seconds=6.0, beam_sentences=16),
}


@dataclass
class System:
    name: str
    arch: str
    flags: list = field(default_factory=list)  # fairseq-train flags on top of the shared size
    criterion: str = "label_smoothed_cross_entropy"
    compare_to: str = ""  # the system whose throughput this one is judged against
    group: str = ""
    # the multi-path encoder layers swapped for the loop-over-modules reference (same weights):
    # an implementation to compare with, not an architecture
    loop_reference: bool = False


def systems_for(size):
    """The side-by-side line-up; layer counts are relative to the base depth L of the size."""
    L = size["base_layers"]
    ffn = size["ffn"]
    mp = "multipath_transformer"
    moe_criterion = "label_smoothed_cross_entropy_with_moe"
    return [
        System("stock prenorm L", "transformer_prenorm_wmt_en_de", [f"--encoder-layers={L}"],
               group="baselines"),
        System("stock deep 4L", "transformer_prenorm_wmt_en_de", [f"--encoder-layers={4 * L}"],
               group="baselines"),
        System("multi-path L x 4 (full)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4"], compare_to="stock deep 4L",
               group="multi-path"),
        System("multi-path L x 4 (+cheap features)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4", "--cheap-features"],
               compare_to="multi-path L x 4 (plain)", group="multi-path"),
        System("multi-path L x 4 (loop reference)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4"],
               compare_to="multi-path L x 4 (full)", group="multi-path", loop_reference=True),
        System("multi-path L x 4 (plain)", mp,
               [f"--encoder-layers={L}", "--encoder-paths=4", "--no-path-norm",
                "--path-weights=fixed"], compare_to="stock deep 4L", group="multi-path"),
        System("multi-path 2L x 2 (full)", mp,
               [f"--encoder-layers={2 * L}", "--encoder-paths=2"], compare_to="stock deep 4L",
               group="multi-path"),
        System("WideNet (shared attn + MoE E4 k2)", "widenet_transformer_wmt_en_de",
               [f"--encoder-layers={L}"], criterion=moe_criterion,
               compare_to="dense, FFN x2 (WideNet's active FLOPs)", group="MoE"),
        System("dense, FFN x2 (WideNet's active FLOPs)", "transformer_prenorm_wmt_en_de",
               [f"--encoder-layers={L}", f"--encoder-ffn-embed-dim={2 * ffn}"], group="MoE"),
        System("EWA (E4, every-2)", "ewa_transformer_wmt_en_de", [f"--encoder-layers={L}"],
               criterion=moe_criterion, compare_to="stock prenorm L", group="MoE"),
        System("ParameterNet (routed, both)", "parameternet_transformer_wmt_en_de",
               [f"--encoder-layers={L}", "--parameternet-proj=both",
                "--parameternet-mode=routed"], criterion=moe_criterion,
               compare_to="stock prenorm L", group="MoE"),
        System("ParameterNet (dynamic, both)", "parameternet_transformer_wmt_en_de",
               [f"--encoder-layers={L}", "--parameternet-proj=both",
                "--parameternet-mode=dynamic"], compare_to="stock prenorm L", group="MoE"),
    ]


def fairseq_flags(size, system):
    return [
        "--arch", system.arch, "--share-all-embeddings",
        f"--encoder-embed-dim={size['dim']}", f"--decoder-embed-dim={size['dim']}",
        f"--encoder-ffn-embed-dim={size['ffn']}", f"--decoder-ffn-embed-dim={size['ffn']}",
        f"--encoder-attention-heads={size['heads']}", f"--decoder-attention-heads={size['heads']}",
        "--decoder-layers=1", "--dropout=0.1",
        "--optimizer=adam", "--adam-betas=(0.9, 0.997)", "--lr=0.001",
        "--lr-scheduler=inverse_sqrt", "--warmup-updates=100",
        f"--criterion={system.criterion}", "--label-smoothing=0.1",
        "--max-tokens=100000", "--max-update=100000", "--seed=1", "--no-progress-bar",
        *system.flags,
    ]


def use_loop_reference(model, args):
    """Swap the model's batched multi-path encoder layers for the loop-over-modules reference
    layers (``multipath_nmt.testing.multipath_reference``) holding the same weights."""
    from multipath_nmt.models.multipath_transformer import _path_options
    from multipath_nmt.testing.multipath_reference import ReferenceMultiPathEncoderLayer

    for index, layer in enumerate(model.encoder.layers):
        reference = ReferenceMultiPathEncoderLayer(
            args.encoder_embed_dim, args.encoder_ffn_embed_dim, args.encoder_attention_heads,
            args.encoder_paths, **_path_options(args))
        model.encoder.layers[index] = reference.load_batched_state_dict(layer.state_dict())


def build_trainer(data_dir, flags, device, fp16, loop_reference=False):
    """fairseq's own parser, task, model, criterion and Trainer, as fairseq-train builds them
    (the archs are registered: importing this package imports ``multipath_nmt`` first)."""
    extra = ["--cpu"] if device == "cpu" else []
    if fp16:
        extra.append("--fp16")
    return _build([data_dir, "-s", "src", "-t", "tgt", *flags, *extra], loop_reference)


def build_trainer_from_argv(argv, loop_reference=False):
    """The Trainer and task of a whole fairseq-train command line: ``argv`` is what fairseq's
    parser takes (``recipe.train_command(...).argv[3:]``: the data-bin, then the flags, device
    and precision ones included), and the weights are seeded from its ``--seed`` before the model
    is built, as fairseq-train seeds them, so two builds of one seed start from the same
    weights."""
    return _build(list(argv), loop_reference, seed=True)


def _build(argv, loop_reference, seed=False):
    import numpy as np
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, argv)
    cfg = convert_namespace_to_omegaconf(args)
    if seed:
        np.random.seed(cfg.common.seed)
        utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    if loop_reference:
        use_loop_reference(model, args)
    criterion = task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion), task
