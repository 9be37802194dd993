"""Models built in the test process exactly as ``fairseq-train`` builds them."""
from conftest import USER_DIR


def build_like_fairseq_train(data, arch, *flags, with_cfg=False):
    """``arch`` for the data-bin ``data`` from the omegaconf config fairseq-train later saves;
    with ``with_cfg``, (model, cfg)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data), "--user-dir", str(USER_DIR),
                                                "--arch", arch, "--max-update", "10",
                                                *map(str, flags)])
    cfg = convert_namespace_to_omegaconf(args)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    return (model, cfg) if with_cfg else model
