"""SavedForBackward: the bytes autograd keeps for backward, each storage once, parameters excluded."""
import torch
from torch import nn

from multipath_nmt.saved_tensors import SavedForBackward


def test_counts_each_saved_storage_once_and_excludes_parameters():
    linear = nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedForBackward(exclude=linear.parameters()) as saved:
        hidden = linear(x)      # saves x (4 x 8) and the weight (excluded)
        out = hidden.relu()     # saves its output (4 x 16)
        out.sum().backward()
    assert saved.nbytes == (4 * 8 + 4 * 16) * 4
    assert sorted(tuple(t.shape) for t in saved.tensors) == [(4, 8), (4, 16)]


def test_views_of_one_storage_count_once():
    x = torch.randn(6, 5, requires_grad=True)
    with SavedForBackward() as saved:
        y = x * 2
        (y[:3] * y[3:]).sum()   # both factors are views of y's storage
    assert saved.nbytes == 6 * 5 * 4 and len(saved.tensors) == 1


def test_nothing_saved_outside_the_context():
    x = torch.randn(3, requires_grad=True)
    with SavedForBackward() as saved:
        pass
    (x * x).sum()
    assert saved.nbytes == 0 and saved.tensors == []
