"""The Triton backend's configuration: what a call does not describe."""

from __future__ import annotations

import dataclasses

from jflash._src.backends.triton.block_sizes import BlockSizes


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """How the Triton kernels run one call (hashable: a `custom_vjp` static).

  Attributes:
    block_sizes: tiles and launch parameters of every kernel.
    interpret: run the kernels through the Pallas interpreter (any device).
  """

  block_sizes: BlockSizes
  interpret: bool = False
