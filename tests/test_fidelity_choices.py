"""The choices docs/fidelity.md records where a paper is silent, each pinned: alpha's start
without PathNorm, where dropout goes in a multi-path sublayer, and the wide baseline's sizes."""
import argparse
import math

import pytest
import torch

from multipath_nmt.modules.multipath import PathMixer


@pytest.mark.parametrize("num_paths", [2, 4])
def test_alpha_starts_at_one_over_sqrt_2n_without_path_norm_too(num_paths):
    # Table 4's "- PathNorm" ablation changes PathNorm alone: the weights start as with it
    mixer = PathMixer(num_paths, 8, path_norm=False)
    assert mixer.path_norm is None
    torch.testing.assert_close(mixer.path_weights,
                               torch.full((num_paths,), 1 / math.sqrt(2 * num_paths)))
    assert mixer.residual_weight.item() == 1.0


@pytest.mark.parametrize("path_norm", [False, True])
def test_dropout_drops_the_weighted_sum_once_not_each_path(path_norm):
    p, n, d = 0.5, 4, 64
    mixer = PathMixer(n, d, path_norm=path_norm, dropout=p).double()
    paths = torch.randn(n, 3, 5, d, dtype=torch.float64)
    residual = torch.randn(3, 5, d, dtype=torch.float64)
    mixer.eval()
    summed = mixer(paths, residual) - residual  # beta = 1: the weighted sum alone
    mixer.train()
    torch.manual_seed(0)
    dropped = mixer(paths, residual) - residual
    # one mask over the sum: every element is either dropped or the sum scaled by 1 / (1 - p);
    # a mask per path would leave partial sums
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7
    torch.testing.assert_close(dropped[kept], summed[kept] / (1 - p))


def test_wide_baseline_doubles_every_matrix_dimension_of_the_base_model():
    from fairseq.models import ARCH_CONFIG_REGISTRY

    import multipath_nmt  # noqa: F401  (registers the archs)

    wide, base = argparse.Namespace(), argparse.Namespace()
    ARCH_CONFIG_REGISTRY["transformer_wide_wmt_en_de"](wide)
    ARCH_CONFIG_REGISTRY["transformer_prenorm_wmt_en_de"](base)
    for side in ("encoder", "decoder"):
        assert getattr(wide, f"{side}_embed_dim") == 2 * getattr(base, f"{side}_embed_dim") == 1024
        assert getattr(wide, f"{side}_ffn_embed_dim") == \
            2 * getattr(base, f"{side}_ffn_embed_dim") == 4096
        assert getattr(wide, f"{side}_attention_heads") == 16
        assert getattr(wide, f"{side}_layers") == getattr(base, f"{side}_layers") == 6
