"""tests/jaxpr_numpy.py's rules against XLA, on the operands they take.

The Mosaic model's decisions and segment tables are evaluated by these
rules instead of XLA:CPU (tests/mosaic_model.py): each rule must give what
jax.jit gives, bit for bit, dtypes and shapes included, on the edge cases
index arithmetic meets (negative operands, division by zero, int32
overflow, indices past an array, empty reductions).
"""

import functools

from absl.testing import absltest
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from tests import jaxpr_numpy

_INT32_MIN = np.iinfo(np.int32).min


def _integers(x, y):
  """Element-wise integer arithmetic (x, y int32 [8])."""
  return dict(
      div=lax.div(x, y), rem=lax.rem(x, y), add=x + y, sub=x - y,
      # Wraps around int32.
      overflow=x * 1_000_000_000 + jnp.int32(2**31 - 1),
      max=jnp.maximum(x, y), min=jnp.minimum(x, y),
      bitwise=(x & y) | ~x,
      compare=jnp.stack([x == y, x != y, x < y, x <= y, x > y, x >= y]),
      logical=jnp.logical_or(jnp.logical_and(x < y, x > 0), ~(y > 0)),
      where=jnp.where(x < y, x, 7),
      select3=lax.select_n(jnp.clip(x, 0, 2), x, y, x * y),
      as_int=(x > 0).astype(jnp.int32))


def _shapes(x, y):
  """Array construction, layout and reductions (x, y int32 [8])."""
  grid = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  none = jnp.zeros((0,), jnp.int32)
  return dict(
      outer=x[:, None] + y[None, :],
      transposed=grid.T,
      squeezed=jnp.squeeze(grid.reshape(1, 6, 1)),
      joined=jnp.concatenate([x, y, grid.reshape(-1)]),
      padded=jnp.pad(x, (2, 1), constant_values=-1),
      cut=lax.pad(x, jnp.int32(5), [(-1, 2, 0)]),
      cummax=lax.cummax(x), cummin=lax.cummin(y, reverse=True),
      reduced=jnp.stack([jnp.max(x), jnp.min(y), jnp.sum(x)]),
      empty=jnp.stack([lax.reduce_max(none, axes=(0,)),
                       lax.reduce_min(none, axes=(0,))]))


def _indexing(x, y, table):
  """Indexing and searches as the model's helpers and the segment tables
  do them: a table read at computed indices (clamped past its ends), per
  element of a named axis; x searched in y (sorted)."""
  read = jax.vmap(
      lambda i, j: table[i, lax.rem(lax.axis_index("a"), 2), j],
      axis_name="a")
  return dict(
      read=read(x, y),
      left=jnp.searchsorted(y, x, side="left", method="compare_all"),
      right=jnp.searchsorted(y, x, side="right", method="compare_all"),
      # Per row of a batch (SearchSorted's batch dims on JAX >= 0.12).
      batched=jax.vmap(functools.partial(
          jnp.searchsorted, side="right", method="compare_all"))(
          jnp.stack([y, y - 1]), jnp.stack([x, x + 1])))


def _floats(lse, rows, q_len):
  """valid_lse-like selection on float32 (lse float64: converted)."""
  return jnp.where(rows < q_len, lse, jnp.inf)


class JaxprNumpyTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.x = np.array([7, -7, 7, -7, 0, _INT32_MIN, 5, 3], np.int32)
    self.y = np.array([2, 2, -2, -2, 3, -1, 0, 0], np.int32)

  def assert_same_as_xla(self, fn, *args, **kwargs):
    ours = jaxpr_numpy.jit(fn, **kwargs)(*args)
    expected = jax.device_get(jax.jit(fn, **kwargs)(*args))
    chex.assert_trees_all_equal_dtypes(ours, expected)
    chex.assert_trees_all_equal_shapes(ours, expected)
    chex.assert_trees_all_equal(ours, expected)

  def test_integers(self):
    self.assert_same_as_xla(_integers, self.x, self.y)

  def test_shapes(self):
    self.assert_same_as_xla(_shapes, self.x, self.y)

  def test_indexing(self):
    table = np.arange(2 * 2 * 5, dtype=np.int32).reshape(2, 2, 5)
    self.assert_same_as_xla(_indexing, self.x, np.sort(self.y), table)

  def test_floats_and_python_scalars(self):
    lse = np.linspace(-3.0, 3.0, 8)
    self.assert_same_as_xla(_floats, lse, np.arange(8), 5)

  def test_traced_once_per_signature(self):
    traces = []

    def fn(x, n):
      traces.append(n)
      return x + n

    ours = jaxpr_numpy.jit(fn, static_argnums=(1,))
    for x, n in ((self.x, 1), (self.y, 1), (self.x, 2), (self.x[:3], 2)):
      np.testing.assert_array_equal(ours(x, n), x + np.int32(n))
    self.assertEqual(traces, [1, 2, 2])

  def test_no_rule_raises(self):
    with self.assertRaisesRegex(NotImplementedError, "sin"):
      jaxpr_numpy.jit(jnp.sin)(np.zeros(3, np.float32))
    with self.assertRaisesRegex(NotImplementedError, "float32 to int32"):
      jaxpr_numpy.jit(lambda x: x.astype(jnp.int32))(
          np.zeros(3, np.float32))


if __name__ == "__main__":
  absltest.main()
