"""jit, vmap, grad, jax.checkpoint, and higher-order derivatives.

Runs per backend (tests/test_base.py): the Pallas kernels, whose passes are
not differentiable again (higher-order derivatives and forward mode raise),
and the XLA path, plain JAX (they work, as jax.nn's).
"""

import re

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp

from tests import test_base
from tests import test_util
from tests import tolerances


class TransformsTest(test_base.BackendTestCase):

  def _loss(self, fn, dout):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * dout)

  def _assert_same(self, ours, expected):
    """Two programs of the same calls (vmapped and looped): float32 results
    within 1e-5; in a 16-bit target's dtype within tolerances.DIRECT
    (compiled on a GPU, XLA's autotuner may pick another implementation of
    the ops around the kernels per process and shape: one bf16 ulp of a
    gradient apart, RECORD.md 2026-11-25, "Q prefetch")."""
    dtype = min((leaf.dtype for leaf in jax.tree.leaves(ours)),
                key=lambda d: d.itemsize)
    tolerance = tolerances.direct(dtype, float32=1e-5)
    chex.assert_trees_all_close(ours, expected, rtol=tolerance,
                                atol=tolerance)

  def test_vmap_over_extra_leading_axis_matches_loop(self):
    q, k, v, dout = test_util.random_inputs(
        20, batch=3, q_len=33, kv_len=40, num_heads=4, num_kv_heads=2)
    # Treat the batch axis as a vmapped axis over unbatched [T, N, H] inputs.
    fn = self.flash(is_causal=True)
    loss = self._loss(fn, dout[0])
    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    vmapped = jax.jit(jax.vmap(value_and_grad))(q, k, v)
    # Jitted once for the loop: run eagerly, each operation compiles apart.
    single = jax.jit(value_and_grad)
    looped = [single(q[i], k[i], v[i]) for i in range(3)]
    looped = jax.tree.map(lambda *xs: jnp.stack(xs), *looped)
    self._assert_same(vmapped, looped)

  def test_nested_vmap_and_unbatched_operands(self):
    q, k, v, dout = test_util.random_inputs(21, batch=2, q_len=20, kv_len=24)
    q2 = jnp.stack([q, 2.0 * q])  # [2, B, T, N, H]: two vmapped axes.
    fn = self.flash()
    # Outer vmap over q only (k, v shared), inner vmap over the batch axis.
    inner = jax.vmap(fn)
    outer = jax.jit(jax.vmap(inner, in_axes=(0, None, None)))
    out = outer(q2, k, v)
    expected = jnp.stack([test_util.CALL(fn, q, k, v),
                          test_util.CALL(fn, 2.0 * q, k, v)])
    self._assert_same(out, expected)

  def test_vmap_of_lengths(self):
    q, k, v, _ = test_util.random_inputs(22, batch=1, q_len=30, kv_len=30)
    kv_lens = jnp.array([[7], [30], [0]], jnp.int32)
    # Jitted (the loop below reuses it): run eagerly, the XLA path compiles
    # each of its operations apart.
    fn = jax.jit(
        lambda lengths: self.flash(key_value_seq_lengths=lengths)(q, k, v))
    vmapped = jax.vmap(fn)(kv_lens)
    for i in range(3):
      chex.assert_trees_all_close(vmapped[i], fn(kv_lens[i]), rtol=1e-6,
                                  atol=1e-6)

  def test_checkpoint_gives_same_gradients(self):
    q, k, v, dout = test_util.random_inputs(23, q_len=40, kv_len=40)
    loss = self._loss(self.flash(is_causal=True), dout)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    remat_grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(
        q, k, v)
    chex.assert_trees_all_close(grads, remat_grads, rtol=1e-6, atol=1e-6)

  def test_jit_matches_eager(self):
    # The call and shapes of test_nested_vmap_and_unbatched_operands: its
    # loop's jitted program is this one (compiled once for both tests).
    q, k, v, _ = test_util.random_inputs(24, q_len=20, kv_len=24)
    fn = self.flash()
    chex.assert_trees_all_close(test_util.CALL(fn, q, k, v), fn(q, k, v),
                                rtol=1e-6, atol=1e-6)

  def test_higher_order_derivatives(self):
    q, k, v, dout = test_util.random_inputs(25, q_len=16, kv_len=16)
    grad_norm = lambda fn: lambda q: jnp.sum(
        jax.grad(self._loss(fn, dout))(q, k, v) ** 2)
    if not self.backend.differentiable:
      with self.assertRaisesRegex(NotImplementedError, "higher-order"):
        jax.grad(grad_norm(self.flash()))(q)
      return
    # Plain JAX: grad of grad works, as jax.nn's. HIGHEST: on a GPU the
    # default precision of a float32 einsum is TF32.
    with jax.default_matmul_precision("highest"):
      ours = jax.jit(jax.grad(grad_norm(self.flash())))(q)
      expected = jax.jit(
          jax.grad(grad_norm(jax.nn.dot_product_attention)))(q)
    chex.assert_tree_all_finite(ours)
    chex.assert_trees_all_close(ours, expected, rtol=1e-4, atol=1e-4)

  def test_equal_calls_share_their_passes(self):
    # Two equal calls in one program (the layers of an unrolled model):
    # each pass is traced once and lowered once (binding._shared_pass), so
    # its kernels are compiled once per program; a different call (not
    # causal) gets its own. Mosaic stamps each lowering with a new name, so
    # kernels lowered twice were compiled twice (RECORD 2026-11-26,
    # "kernels compiled once per program": 8 layers 56 s -> 8 s).
    if not self.runs_kernels:
      self.skipTest(f"{self.implementation} runs as plain JAX, not "
                    "through kernel passes")
    q, k, v, dout = test_util.random_inputs(27, q_len=16, kv_len=16)
    causal, plain = self.flash(is_causal=True), self.flash()

    def loss(q, k, v):
      out = causal(causal(q, k, v), k, v)
      return jnp.sum(plain(out, k, v).astype(jnp.float32) * dout)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        q, k, v).as_text()
    defined = re.findall(r"func\.func private @(_shared_pass\w*)\(", text)
    called = re.findall(r"call @(_shared_pass\w*)\(", text)
    # Forward and backward, causal and not: four passes, six calls.
    self.assertLen(defined, 4, defined)
    self.assertLen(called, 6, called)
    self.assertCountEqual(set(called), defined)
    self.assertEqual(max(called.count(name) for name in defined), 2)

  def test_forward_mode(self):
    q, k, v, _ = test_util.random_inputs(26, q_len=16, kv_len=16)
    if not self.backend.differentiable:
      # jax: no jvp of a custom_vjp function.
      with self.assertRaises(TypeError):
        jax.jvp(self.flash(), (q, k, v), (q, k, v))
      return
    # Plain JAX: forward mode works, as jax.nn's (HIGHEST: as above).
    jvp = jax.jit(lambda fn, *args: jax.jvp(fn, args, args),
                  static_argnums=0)
    with jax.default_matmul_precision("highest"):
      ours = jvp(self.flash(), q, k, v)
      expected = jvp(jax.nn.dot_product_attention, q, k, v)
    chex.assert_tree_all_finite(ours)
    chex.assert_trees_all_close(ours, expected, rtol=1e-5, atol=1e-5)


test_base.for_each_backend(globals(), TransformsTest)

if __name__ == "__main__":
  absltest.main()
