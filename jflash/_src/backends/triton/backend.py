"""The Triton backend: capabilities, configuration, and its two passes.

The forward pass launches `forward.forward_call`; the backward pass
`backward.delta_call`, `dkv_call`, `dq_call` (and `dbias_call` with a
bias), recomputing probabilities from the forward's base-2 lse. The binding
folds `vmap` into the batch axis before either runs (Triton grids have no
room for a `vmap` axis). Its configuration (config.py): tiles from the
user, else from the autotune cache, else from the heuristic; what
`jflash.autotune` searches: tuning.py.
"""

from __future__ import annotations

import jax.numpy as jnp

from jflash._src import modifiers
from jflash._src import registry
from jflash._src.backends.triton import backward as backward_kernels
from jflash._src.backends.triton import forward as forward_kernels
from jflash._src.backends.triton import tuning
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.backends.triton.config import TritonConfig
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands

CAPABILITIES = registry.Capabilities(
    passes=frozenset(registry.PASSES),
    dtypes=("float32", "bfloat16", "float16"),
    max_head_dim=256,
    mask_features=frozenset(registry.MASK_FEATURES),
    options=frozenset(registry.OPTIONS),
    platforms=frozenset({"cuda"}),
    interpretable=True,
)


def _kernel_operands(operands: Operands) -> Operands:
  """Lengths filled in (the kernels always take them), the mask as int8
  (the kernels read and compare bytes)."""
  q_lens, kv_lens = operands.lengths()
  mask = operands.mask
  return operands.replace(
      q_lengths=q_lens, kv_lengths=kv_lens,
      mask=None if mask is None else mask.astype(jnp.int8))


def forward(spec: CallSpec, config: TritonConfig, operands: Operands):
  """(out, lse2): the forward kernel."""
  return forward_kernels.forward_call(_kernel_operands(operands), spec=spec,
                                      config=config)


def backward(spec: CallSpec, config: TritonConfig, operands: Operands, out,
             lse2, dout, dlse=None) -> Operands:
  """Cotangents of q, k, v (and bias, sinks) from the backward kernels.

  `dlse`: the natural lse's cotangent, [B, N, T] (zero on rows without
  keys), or None.
  """
  delta = backward_kernels.delta_call(out, dout, config=config)
  if dlse is not None:
    # d lse / d s_c = p_c, so lse's cotangent enters as a shift of delta:
    # dS = p * (dP - delta) + p * dlse = p * (dP - (delta - dlse)).
    delta = delta - dlse
  kernel_operands = _kernel_operands(operands)
  launch = lambda call: call(kernel_operands, dout, lse2, delta, spec=spec,
                             config=config)
  dk, dv = launch(backward_kernels.dkv_call)
  dq = launch(backward_kernels.dq_call)
  dbias = launch(backward_kernels.dbias_call) if spec.has_bias else None
  dsinks = None
  if operands.sinks is not None:
    dsinks = modifiers.sinks_gradient(operands.sinks, lse2, delta)
  # ALiBi slopes take no gradient (api.py makes differentiating them an
  # error); lengths, segment ids, the mask and the seeds are integers.
  return Operands(query=dq, key=dk, value=dv, bias=dbias, sinks=dsinks)


BACKEND = registry.Backend(
    name="triton",
    capabilities=CAPABILITIES,
    block_sizes_type=BlockSizes,
    configure=TritonConfig.for_call,
    forward=forward,
    backward=backward,
    limits="paged caches in the forward pass only",
    tuning=tuning.SPACE,
)
