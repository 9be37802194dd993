"""Plain PyTorch modules, one paper each (its module docstring names the paper and equations);
none of them imports fairseq.

Conventions shared by every module here:

- ``activation_fn``: the activation function, a callable (fairseq's name for the FFN activation,
  ``--activation-fn`` in its options and ``activation_fn`` on its layers). Every fairseq adapter in
  :mod:`multipath_nmt.models` turns the option's name into the function with
  :func:`get_activation_fn` (:data:`ACTIVATIONS`), so one name means one function in every model.
- Stacked per-expert or per-path weights are ``[experts, in, out]``: expert i computes
  ``x @ W[i] + b[i]``, so ``torch.baddbmm`` runs all experts without a transposed operand and
  their gradients come out in the weights' own layout (MoE, WideNet, routed ParameterNet, the
  multi-path FFN and attention output projections). Two layouts differ, because what they hold
  is used that way: EWA's experts are ``[experts, out, in]``, ``nn.Linear``'s, since the folded
  FFN (their mean) is a fairseq dense FFN's ``fc1.weight``/``fc2.weight`` as it is; dynamic
  ParameterNet's are ``[in, experts, out]``, so one product gives every x W_i. Changing either
  would change the shapes in existing checkpoints.
- Routed FFNs take time-major x [T, B, d] with fairseq's padding mask [B, T] (True = padding),
  or [S, d] with [S], and flatten it with :class:`multipath_nmt.modules.moe.FlatTokens`.
"""
import math
from typing import Callable

import torch
import torch.nn.functional as F


# fairseq's functions for its --activation-fn names (fairseq.utils.get_activation_fn), written
# here because this package does not import fairseq; tests/test_activations.py checks each against
# fairseq's. fairseq's and not PyTorch's own: these are fairseq models, compared with fairseq's
# transformer, whose layers (the decoders here included) call fairseq's functions.
def gelu(x: torch.Tensor) -> torch.Tensor:
    """fairseq's gelu: computed in fp32 whatever the input's dtype (stable in fp16), cast back."""
    return F.gelu(x.float()).type_as(x)


def gelu_accurate(x: torch.Tensor) -> torch.Tensor:
    """fairseq's gelu_accurate: the tanh approximation, term by term as fairseq writes it
    (``F.gelu(x, approximate="tanh")`` rounds differently)."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).pow(2)


def linear(x: torch.Tensor) -> torch.Tensor:
    # a named function, not a lambda: layers holding it can be scripted and pickled
    return x


ACTIVATIONS = {
    "relu": F.relu,
    "relu_squared": relu_squared,
    "gelu": gelu,
    "gelu_fast": gelu_accurate,  # fairseq's deprecated name of gelu_accurate
    "gelu_accurate": gelu_accurate,
    "tanh": torch.tanh,
    "linear": linear,
    # fairseq 0.12 returns the class torch.nn.SiLU here, which cannot be applied to a tensor (and
    # its --activation-fn choices leave swish out); this is the function the class computes.
    "swish": F.silu,
}


def get_activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function that fairseq's ``--activation-fn name`` means."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown --activation-fn {name!r}; choose one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
