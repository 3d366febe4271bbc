"""cuDNN's fused attention, through jax.nn: the "cudnn" backend.

It is `jax.nn.dot_product_attention(..., implementation="cudnn")` on the
call's operands, so code written for jax.nn that names
`implementation="cudnn"` runs unchanged through jflash. It runs only when
named, never chosen by `implementation=None`: where a row sees no key its
output is not jflash's 0, and its lse has a zero gradient (jax.nn's). It
takes what jax.nn's cuDNN path takes (causal, lengths, a left window, bias,
mask); jflash's own options (segment ids, soft cap, sinks, ALiBi, dropout,
bottom-right alignment) raise NotImplementedError. Everything else — cuDNN
missing on this machine, a dtype or head dim cuDNN lacks — raises what
jax.nn raises, since jax.nn decides it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash._src import registry
from jflash._src.spec import CallSpec
from jflash._src.spec import Operands


def direct(spec: CallSpec, config, operands: Operands):
  """The call through jax.nn's cuDNN path: out, or (out, natural lse f32)."""
  del config
  result = jax.nn.dot_product_attention(
      operands.query, operands.key, operands.value, operands.bias,
      operands.mask, scale=spec.scale, is_causal=spec.mask.is_causal,
      query_seq_lengths=operands.q_lengths,
      key_value_seq_lengths=operands.kv_lengths,
      local_window_size=spec.mask.window, implementation="cudnn",
      return_residual=spec.return_lse)
  if not spec.return_lse:
    return result
  out, lse = result
  return out, lse.astype(jnp.float32)


BACKEND = registry.Backend(
    name="cudnn",
    capabilities=registry.Capabilities(
        passes=frozenset(registry.PASSES),
        # jax.nn decides the dtypes and head dims cuDNN takes, and raises.
        dtypes=("float32", "bfloat16", "float16", "float64"),
        max_head_dim=None,
        mask_features=frozenset({"causal", "lengths", "window",
                                 "dense_mask"}),
        options=frozenset({"bias", "return_lse"}),
        platforms=frozenset({"cuda"}),
    ),
    role=lambda where: registry.NAMED_ONLY,
    limits="jax.nn's cuDNN path: its dtypes and head dims (jax.nn raises)",
    configure=lambda spec: None,
    forward=None,
    backward=None,
    differentiable=True,
    direct=direct,
)
