"""The Mosaic GPU backend: warp-specialized kernels for Hopper (sm90).

It runs where it is fastest: on a GPU of compute capability 9.0 (H100,
H200) `implementation=None` chooses it first for every pass it supports
(forward.py, per the registry's per-pass choice), and the Triton backend
serves the rest. Its kernels need Hopper instructions (wgmma, TMA,
setmaxnreg): no interpreter runs them, so CPU tests lower them for CUDA
(tests/mosaic_lowering_test.py) and the GPU suite runs them.
"""

from __future__ import annotations

from typing import Any

from jflash._src import registry
from jflash._src.backends.mosaic import forward as forward_kernels
from jflash._src.backends.mosaic.config import MosaicConfig
from jflash._src.backends.mosaic.config import default_block_sizes
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands

CAPABILITIES = registry.Capabilities(
    passes=frozenset({registry.FORWARD}),
    dtypes=("bfloat16", "float16"),
    max_head_dim=256,
    head_dims=frozenset({64, 128, 256}),
    mask_features=frozenset({"causal", "bottom_right", "window", "lengths"}),
    options=frozenset({"soft_cap", "sinks", "return_lse"}),
    platforms=frozenset({"cuda"}),
    compute_capabilities=frozenset({"9.0"}),
)


def configure(spec: CallSpec, options: dict[str, Any]) -> MosaicConfig:
  """The call's tiles (heuristic by head dim)."""
  del options  # It takes none yet.
  itemsize = 2  # bfloat16 and float16.
  return MosaicConfig(block_sizes=default_block_sizes(spec.head_dim,
                                                      itemsize))


def forward(spec: CallSpec, config: MosaicConfig, operands: Operands):
  """(out, lse2): the warp-specialized forward kernel."""
  q_lengths = kv_lengths = None
  if spec.mask.has_lengths:
    q_lengths, kv_lengths = operands.lengths()
  return forward_kernels.forward_call(
      operands.query, operands.key, operands.value, q_lengths, kv_lengths,
      operands.sinks, spec=spec, block_sizes=config.block_sizes)


BACKEND = registry.Backend(
    name="mosaic",
    capabilities=CAPABILITIES,
    option_names=frozenset(),
    configure=configure,
    forward=forward,
    backward=None,
)
