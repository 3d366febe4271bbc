"""exp2 of a wgmma tile, part of it on the FMA pipe instead of MUFU.

The softmax's exp2 runs on the SM's multi-function unit (MUFU,
`ex2.approx`), 16 results per clock per SM on Hopper. Where the tile's
matrix products are short (head dim 64, and FP8 operands, whose wgmma is
twice as fast), the exponentials take as long as the products: the tensor
cores wait for MUFU. The FP32 pipe has 128 lanes per clock per SM: a share
of the tile's elements can take their exp2 from a polynomial there
(FlashAttention-4's trick on Blackwell), so that MUFU and the FMA pipe
work side by side.

The polynomial (`POLYNOMIAL_PTX`), for x <= 0 as the softmax's arguments
are (x - max, FP8 adds at most 8): x clamped to >= -125 (2^-125 is
2.4e-38: a probability that rounds to 0 in FP8 and adds nothing
measurable in 16 bits), n = round(x) by adding and subtracting 1.5 * 2^23
(round to nearest, no conversion instruction), f = x - n in [-0.5, 0.5],
2^f by a degree-3 polynomial (relative error 7.5e-5, against bf16's
rounding of P at 2^-9 = 2e-3), and 2^n put into the exponent by an
integer add of n << 23 (the low bits of x + 1.5 * 2^23 are n's two's
complement, so one shift takes them there). NaN stays NaN only through
the clamp: the add can turn its bits finite, but a NaN argument means a
NaN row max, which makes the row's MUFU elements, its sum and its
correction NaN, so the row's output is NaN either way.
"""

from __future__ import annotations

import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax._src.lib.mlir.dialects import vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

# 2^f ~ ((C3 f + C2) f + C1) f + C0 on [-0.5, 0.5], fitted for relative
# error (Lawson's iteration on 4001 Chebyshev points, coefficients rounded
# to float32: max relative error 7.48e-5): C3..C0 = 0.05517167,
# 0.24261114, 0.69326097, 0.99992806.
POLYNOMIAL_PTX = """{
.reg .f32 x, t, n, f, p;
.reg .b32 pb, tb, rb;
max.NaN.f32 x, $1, 0fC2FA0000;
add.rn.f32 t, x, 0f4B400000;
sub.rn.f32 n, t, 0f4B400000;
sub.rn.f32 f, x, n;
fma.rn.f32 p, f, 0f3D61FBB0, 0f3E786F0E;
fma.rn.f32 p, p, f, 0f3F31798D;
fma.rn.f32 p, p, f, 0f3F7FFB49;
mov.b32 pb, p;
mov.b32 tb, t;
shl.b32 tb, tb, 23;
add.s32 rb, pb, tb;
mov.b32 $0, rb;
}"""
MUFU_PTX = "ex2.approx.ftz.f32 $0, $1;"


def _per_element(register, ptx: str):
  """The scalar PTX `ptx` ($0 = f($1), float32) on each element of a
  register (a float32 or a vector of them)."""
  f32 = ir.F32Type.get()
  if register.type == f32:
    return llvm.inline_asm(f32, [register], ptx, "=f,f")
  result = llvm.mlir_undef(register.type)
  [length] = ir.VectorType(register.type).shape
  for i in range(length):
    position = ir.DenseI64ArrayAttr.get([i])
    element = vector.extract(register, dynamic_position=[],
                             static_position=position)
    result = vector.insert(llvm.inline_asm(f32, [element], ptx, "=f,f"),
                           result, dynamic_position=[],
                           static_position=position)
  return result


def exp2(x, emulated: tuple[int, int] | None):
  """exp2 of a float32 array in the wgmma accumulator layout, as
  `jnp.exp2` with approximate math (MUFU) but for `emulated` = (share,
  period): of each `period` consecutive registers (two elements each, in
  the layout's register order), the first `share` take the polynomial.
  None or a share of 0: `jnp.exp2` itself."""
  if emulated is None or emulated[0] == 0:
    return jnp.exp2(x)
  share, period = emulated
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(
      arg_types=(layout,),
      return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout))
  def mixed(ctx, array):
    del ctx
    registers = np.empty(array.registers.shape, dtype=object)
    for n, index in enumerate(np.ndindex(registers.shape)):
      ptx = POLYNOMIAL_PTX if n % period < share else MUFU_PTX
      registers[index] = _per_element(array.registers[index], ptx)
    return mgpu.FragmentedArray(_registers=registers, _layout=array.layout,
                                _is_signed=None)

  return mixed(x)
