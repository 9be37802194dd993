"""Plain PyTorch modules, one paper each (its module docstring names the paper and equations);
none of them imports fairseq.

Conventions shared by every module here:

- ``activation_fn``: the activation function, a callable (fairseq's name for the FFN activation,
  ``--activation-fn`` in its options and ``activation_fn`` on its layers). The fairseq adapters in
  :mod:`multipath_nmt.models` turn the option's name into the function.
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
