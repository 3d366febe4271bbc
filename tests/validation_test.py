"""Bad input raises a clear error naming the argument, before any kernel."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

import jflash
from tests import test_util


def _arrays(q_shape=(2, 16, 4, 32), kv_shape=(2, 24, 2, 32),
            dtype=jnp.float32):
  return (jnp.ones(q_shape, dtype), jnp.ones(kv_shape, dtype),
          jnp.ones(kv_shape, dtype))


class ValidationTest(parameterized.TestCase):
  INTERPRET = test_util.INTERPRET

  def _call(self, q, k, v, **kwargs):
    kwargs.setdefault("implementation", "triton")
    if kwargs["implementation"] == "triton":
      kwargs.setdefault("interpret", self.INTERPRET)
    return jflash.flash_attention(q, k, v, **kwargs)

  @parameterized.named_parameters(
      ("rank_2", (16, 32), (24, 32), "must all be 4-D"),
      ("rank_5", (1, 2, 16, 4, 32), (1, 2, 24, 2, 32), "must all be 4-D"),
      ("mixed_rank", (16, 4, 32), (2, 24, 2, 32), "must all be 4-D"),
      ("batch", (3, 16, 4, 32), (2, 24, 2, 32), "same batch size"),
      ("head_dim", (2, 16, 4, 64), (2, 24, 2, 32), "same head_dim"),
      ("heads_not_multiple", (2, 16, 3, 32), (2, 24, 2, 32),
       r"multiple of the number of key/value heads"),
  )
  def test_bad_shapes(self, q_shape, kv_shape, message):
    q, k, v = _arrays(q_shape, kv_shape)
    with self.assertRaisesRegex(ValueError, message):
      self._call(q, k, v)

  def test_key_value_shape_mismatch(self):
    q, k, _ = _arrays()
    v = jnp.ones((2, 25, 2, 32))
    with self.assertRaisesRegex(ValueError, r"key and value.*value.shape="
                                r"\(2, 25, 2, 32\)"):
      self._call(q, k, v)

  def test_dtype_mismatch(self):
    q, k, v = _arrays()
    with self.assertRaisesRegex(ValueError, "same dtype.*bfloat16"):
      self._call(q, k, v.astype(jnp.bfloat16))

  def test_unsupported_dtype(self):
    q, k, v = _arrays(dtype=jnp.int32)
    with self.assertRaisesRegex(NotImplementedError, "int32"):
      self._call(q, k, v)

  def test_head_dim_too_large(self):
    q, k, v = _arrays((1, 8, 2, 320), (1, 8, 2, 320))
    with self.assertRaisesRegex(NotImplementedError, "head_dim=320"):
      self._call(q, k, v)

  @parameterized.named_parameters(
      ("query_wrong_shape", "query_seq_lengths", jnp.array([3], jnp.int32),
       r"query_seq_lengths must have shape \(batch,\) = \(2,\)"),
      ("kv_wrong_shape", "key_value_seq_lengths",
       jnp.ones((2, 1), jnp.int32), r"key_value_seq_lengths.shape=\(2, 1\)"),
      ("kv_float", "key_value_seq_lengths", jnp.ones((2,), jnp.float32),
       "key_value_seq_lengths must be an integer array"),
  )
  def test_bad_lengths(self, name, lengths, message):
    q, k, v = _arrays()
    with self.assertRaisesRegex(ValueError, message):
      self._call(q, k, v, **{name: lengths})

  @parameterized.named_parameters(
      ("nan", float("nan")), ("inf", float("inf")), ("string", "0.1"))
  def test_bad_scale(self, scale):
    q, k, v = _arrays()
    with self.assertRaisesRegex(ValueError, "scale"):
      self._call(q, k, v, scale=scale)

  def test_traced_scale(self):
    q, k, v = _arrays()
    with self.assertRaisesRegex(ValueError, "scale must be a Python float"):
      jax.jit(lambda s: self._call(q, k, v, scale=s))(0.5)

  def test_bad_options(self):
    q, k, v = _arrays()
    with self.assertRaisesRegex(ValueError, "implementation must be one of"):
      self._call(q, k, v, implementation="flash3")
    with self.assertRaisesRegex(ValueError, "block_sizes must be"):
      self._call(q, k, v, block_sizes={"block_q": 16})
    with self.assertRaisesRegex(ValueError, "is_causal must be a bool"):
      self._call(q, k, v, is_causal="yes")
    with self.assertRaisesRegex(ValueError,
                                "deterministic_grads must be a bool"):
      self._call(q, k, v, deterministic_grads="no")
    with self.assertRaisesRegex(ValueError, "implementation='xla'"):
      jflash.flash_attention(q, k, v, implementation="xla", interpret=True)
    with self.assertRaisesRegex(ValueError, "implementation='xla'"):
      jflash.flash_attention(q, k, v, implementation="xla",
                             block_sizes=jflash.BlockSizes())

  def test_padding_mask_error_suggests_the_fix(self):
    # A [B, S] padding mask is not broadcastable to [B, N, T, S]: the error
    # says how to pass it.
    q, k, v = _arrays()
    padding = jnp.arange(24)[None, :] < jnp.array([[20], [9]])
    with self.assertRaisesRegex(
        ValueError, r"mask.shape=\(2, 24\).*mask\[:, None, None, :\].*"
        "key_value_seq_lengths"):
      self._call(q, k, v, mask=padding)
    # The suggested mask passes validation (which runs at trace time).
    out = jax.eval_shape(
        lambda q, k, v: self._call(q, k, v, mask=padding[:, None, None, :]),
        q, k, v)
    self.assertEqual(out.shape, q.shape)

  @absltest.skipIf(test_util.ON_GPU, "checks the error raised without a GPU")
  def test_triton_without_gpu_needs_interpret(self):
    # A named backend that cannot run here: NotImplementedError, with the
    # registry's reason.
    q, k, v = _arrays()
    with self.assertRaisesRegex(NotImplementedError,
                                "needs a CUDA GPU.*interpret=True"):
      jflash.flash_attention(q, k, v, implementation="triton")

  def test_errors_come_before_any_kernel(self):
    # Validation runs at trace time: no kernel is lowered for bad input.
    q, k, v = _arrays((2, 16, 3, 32), (2, 24, 2, 32))
    with self.assertRaisesRegex(ValueError, "multiple"):
      jax.jit(self._call).lower(q, k, v)


if __name__ == "__main__":
  absltest.main()
