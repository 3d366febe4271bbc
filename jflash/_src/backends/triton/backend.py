"""The Triton backend: capabilities, configuration, and its two passes.

The forward pass launches `forward.forward_call`; the backward pass
`backward.delta_call`, `dkv_call`, `dq_call` (and `dbias_call` with a
bias), recomputing probabilities from the forward's base-2 lse. The binding
folds `vmap` into the batch axis before either runs (Triton grids have no
room for a `vmap` axis). Tiles come from the user, else from the autotune
cache (tuning/cache.py), else from `block_sizes.default_block_sizes`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jflash._src import modifiers
from jflash._src import platform
from jflash._src import registry
from jflash._src.backends.triton import backward as backward_kernels
from jflash._src.backends.triton import forward as forward_kernels
from jflash._src.backends.triton import block_sizes as block_sizes_lib
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.backends.triton.block_sizes import default_block_sizes
from jflash._src.backends.triton.config import TritonConfig
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands
from jflash._src.tuning import cache

CAPABILITIES = registry.Capabilities(
    passes=frozenset(registry.PASSES),
    dtypes=("float32", "bfloat16", "float16"),
    max_head_dim=256,
    mask_features=frozenset(registry.MASK_FEATURES) - {"paged"},
    options=frozenset(registry.OPTIONS),
    platforms=frozenset({"cuda"}),
    interpretable=True,
)


def tuned_block_sizes(path: str | None = None, **shape: Any
                      ) -> BlockSizes | None:
  """The autotuned tiles for a shape (arguments as `cache.shape_key`)."""
  entry = cache.lookup(path, **shape)
  return None if entry is None else BlockSizes(**entry["block_sizes"])


def _check_fits(tiles: BlockSizes, spec: CallSpec) -> None:
  """ValueError when the user's tiles need more shared memory than this
  device's blocks have (the launch would fail on the GPU at run time)."""
  device = platform.device_kind()
  limit = block_sizes_lib.shared_memory_limit(device)
  itemsize = jnp.dtype(spec.dtype).itemsize
  dense = 4 * spec.has_bias + 1 * spec.mask.has_dense_mask
  needs = {
      "forward": block_sizes_lib.forward_shared_memory(
          tiles.block_q, tiles.block_k, tiles.num_stages,
          head_dim=spec.head_dim, itemsize=itemsize, dense_itemsize=dense),
      "backward": block_sizes_lib.backward_shared_memory(
          tiles.block_q_dkv, tiles.block_k_dkv, tiles.block_q_dq,
          tiles.block_k_dq, tiles.num_stages_bwd, head_dim=spec.head_dim,
          itemsize=itemsize, dense_itemsize=dense)}
  for pass_, need in needs.items():
    if need > limit:
      raise ValueError(
          f"block_sizes={tiles} need about {need} bytes of shared memory in "
          f"the {pass_} kernels at head_dim={spec.head_dim} and dtype="
          f"{spec.dtype}; a block of this GPU ({device!r}) has {limit}. Use "
          "smaller tiles or fewer stages.")


def configure(spec: CallSpec, options: dict[str, Any]) -> TritonConfig:
  """The call's tiles (user's, tuned, or default) and interpret flag.

  Calls with a dense bias or mask never take autotuned tiles (the tuning
  runs without them, and their tiles need shared memory of their own): the
  heuristic counts their tiles (a bias as float32, the worst case).
  """
  block_sizes = options.get("block_sizes")
  if block_sizes is not None:
    _check_fits(block_sizes, spec)
  else:
    shape = dict(q_len=spec.q_len, kv_len=spec.kv_len,
                 head_dim=spec.head_dim, dtype=spec.dtype,
                 is_causal=spec.mask.is_causal,
                 device_kind=platform.device_kind())
    dense_itemsize = 4 * spec.has_bias + 1 * spec.mask.has_dense_mask
    if not dense_itemsize:
      block_sizes = tuned_block_sizes(num_heads=spec.num_heads,
                                      num_kv_heads=spec.num_kv_heads,
                                      **shape)
    block_sizes = block_sizes or default_block_sizes(
        **shape, dense_itemsize=dense_itemsize)
  return TritonConfig(block_sizes=block_sizes,
                      interpret=bool(options.get("interpret", False)))


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
    option_names=frozenset({"block_sizes", "interpret"}),
    option_types={"block_sizes": BlockSizes},
    configure=configure,
    forward=forward,
    backward=backward,
)
