"""The Mosaic GPU backend: warp-specialized kernels for Hopper (sm90).

It runs where it is fastest: on a GPU of compute capability 9.0 (H100,
H200) `implementation=None` chooses it first for every pass it supports
(forward.py, backward.py; the registry chooses per pass), and the Triton
backend serves the rest. Its kernels need Hopper instructions (wgmma, TMA,
setmaxnreg): no interpreter runs them, so CPU tests lower them for CUDA
(tests/mosaic_lowering_test.py) and the GPU suite runs them. Its tiles
(config.py): the user's, else the autotuned ones, else by head dim; what
`jflash.autotune` searches: tuning.py.
"""

from __future__ import annotations

from jflash._src import modifiers
from jflash._src import paged
from jflash._src import platform
from jflash._src import registry
from jflash._src.backends.mosaic import backward as backward_kernels
from jflash._src.backends.mosaic import delta as delta_kernels
from jflash._src.backends.mosaic import forward as forward_kernels
from jflash._src.backends.mosaic import tuning
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.backends.mosaic.config import MosaicConfig
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands

CAPABILITIES = registry.Capabilities(
    passes=frozenset(registry.PASSES),
    # float8_e4m3fn: the forward only (FP8 calls have no backward pass,
    # registry.unsupported_reason), forward.py's FP8 kernel.
    dtypes=("bfloat16", "float16", "float8_e4m3fn"),
    max_head_dim=256,
    mask_features=frozenset({"causal", "bottom_right", "window", "lengths",
                             "segments", "paged"}),
    options=frozenset({"soft_cap", "sinks", "return_lse"}),
    platforms=frozenset({"cuda"}),
)
HEAD_DIMS = (64, 128, 256)
# The output dtypes of the FP8 forward (its output tile is 16-bit).
FP8_OUT_DTYPES = ("bfloat16", "float16")
COMPUTE_CAPABILITY = "9.0"  # Hopper: wgmma, TMA, setmaxnreg.


def unavailable() -> str | None:
  """Why the kernels cannot run on this GPU (they need Hopper), or None."""
  capability = platform.cuda_compute_capability()
  if capability != COMPUTE_CAPABILITY:
    return (f"mosaic needs a GPU of compute capability {COMPUTE_CAPABILITY}"
            f"; this one is {capability}.")
  return None


def check(spec: CallSpec, pass_: str) -> str | None:
  """The kernels' exact head dims; bottom-right positions only with the
  causal mask (a bottom-right window or ALiBi without it is Triton's)."""
  del pass_
  if spec.head_dim not in HEAD_DIMS:
    return (f"mosaic supports head_dim in {{{', '.join(map(str, HEAD_DIMS))}"
            f"}}; got head_dim={spec.head_dim}.")
  if spec.mask.bottom_right and not spec.mask.is_causal:
    return ("mosaic supports causal_alignment='bottom_right' only with "
            "is_causal=True.")
  if spec.is_fp8 and spec.output_dtype not in FP8_OUT_DTYPES:
    return (f"mosaic's FP8 forward writes out_dtype in "
            f"{{{', '.join(FP8_OUT_DTYPES)}}}; got {spec.output_dtype}.")
  return None


def forward(spec: CallSpec, config: MosaicConfig, operands: Operands):
  """(out, lse2): the warp-specialized forward kernel (FP8 inputs: its FP8
  variant, with the operands' descales). Its TMA loads read dense tiles: a
  paged cache is gathered into a dense one first (paged.py)."""
  return forward_kernels.forward_call(paged.dense_operands(operands),
                                      spec=spec,
                                      block_sizes=config.block_sizes)


def backward(spec: CallSpec, config: MosaicConfig, operands: Operands, out,
             lse2, dout, dlse=None) -> Operands:
  """Cotangents of q, k, v (and sinks) from the dQ and dK/dV kernels.

  `dlse`: the natural lse's cotangent, [B, N, T] (zero on rows without
  keys), or None.
  """
  # delta = rowsum(dO * O) in float32, by a kernel of fixed summation order
  # (see delta.py: an XLA reduction's bits changed between processes).
  delta = delta_kernels.delta_call(out, dout)
  if dlse is not None:
    # d lse / d s_c = p_c: the lse's cotangent shifts delta (see the Triton
    # backend).
    delta = delta - dlse
  dq, dk, dv = backward_kernels.backward_call(
      operands, dout, lse2, delta, spec=spec,
      block_sizes=config.block_sizes)
  dsinks = None
  if operands.sinks is not None:
    dsinks = modifiers.sinks_gradient(operands.sinks, lse2, delta)
  return Operands(query=dq, key=dk, value=dv, sinks=dsinks)


BACKEND = registry.Backend(
    name="mosaic",
    capabilities=CAPABILITIES,
    block_sizes_type=MosaicBlockSizes,
    configure=MosaicConfig.for_call,
    forward=forward,
    backward=backward,
    check=check,
    limits=(f"head dims {', '.join(map(str, HEAD_DIMS))}; compute "
            f"capability {COMPUTE_CAPABILITY} (Hopper); bottom_right only "
            "when causal; paged caches gathered, in the forward pass only; "
            "float8_e4m3fn in the forward pass only, out_dtype bfloat16 or "
            "float16"),
    unavailable=unavailable,
    tuning=tuning.SPACE,
)
