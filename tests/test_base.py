"""One test base for every backend: tests are written once, against the
contract, and run per backend.

A test file writes its tests in a `BackendTestCase` subclass and ends with
`for_each_backend(globals(), TheTest)`: that replaces the class by one
subclass per backend target (`TheTest_triton`, `TheTest_xla`, ...), each
with its implementation, interpret mode and test configuration. Tests call
`self.flash(...)` (flash_attention bound to the target): a call the target
cannot run skips the test with the registry's one-sentence reason, never
silently. With JFLASH_TEST_ON_GPU=1 the same classes run the kernels
compiled on the GPU instead of through the Pallas interpreter.
"""

from __future__ import annotations

import dataclasses
from typing import Any
import unittest
from unittest import mock

from absl.testing import parameterized

import jflash
from jflash._src import api
from jflash._src import registry
from tests import test_util


@dataclasses.dataclass(frozen=True)
class Target:
  """A backend under test and how the suite runs it.

  Attributes:
    implementation: the registry name.
    options: backend keyword arguments of flash_attention for the tests
      (interpret mode, small tiles).
    input_dtype: for a backend without float32 kernels, the dtype that
      replaces the default float32 of the tests' random inputs (the
      tolerance tables follow the inputs' dtype), so their cases run on it.
    head_dims: for a backend of a few exact head dims, the ones it takes:
      the tests' random inputs get the smallest one >= theirs.
    tile_rows: a multiple of every tile (and block of tiles) of the
      target's kernels along either sequence axis: tests that need mask
      edges on whole tiles (so that a skipped tile is never read) put them
      on multiples of it.
  """

  implementation: str
  options: tuple[tuple[str, Any], ...] = ()
  input_dtype: str | None = None
  head_dims: tuple[int, ...] | None = None
  tile_rows: int = 32


# Small tiles for the kernels, so short test sequences cross several tiles
# (and partial last tiles) in every loop.
TARGETS = (
    Target("triton", (("interpret", test_util.INTERPRET),
                      ("block_sizes", test_util.SMALL_BLOCKS))),
    Target("xla"),
)
# Mosaic GPU kernels have no interpreter: they run in the GPU suite (on a
# GPU other than Hopper each test skips with the registry's reason), and on
# CPU tests/mosaic_lowering_test.py lowers them for CUDA.
if test_util.ON_GPU:
  # Its blocks span 128 rows (two warpgroups of 64) and its key tiles up
  # to 128.
  TARGETS += (Target("mosaic", input_dtype="bfloat16",
                     head_dims=(64, 128, 256), tile_rows=128),)


@dataclasses.dataclass(frozen=True)
class BoundFlash:
  """`jflash.flash_attention` with keyword arguments bound, compared by value.

  Two tests that build the same program (same target, options and input
  shapes) share one trace and one compilation through jit's in-memory cache
  when their functions are equal. Tracing the same program twice gives
  lowered modules whose private function names differ (`@_where_6` vs
  `@_where`), which JAX's persistent compilation cache does not recognize:
  each retrace compiled in full.

  Attributes:
    bound: the keyword arguments, as (name, value) pairs.
    key: their hash, computed once.
  """

  bound: tuple[tuple[str, Any], ...]
  key: int = dataclasses.field(init=False, compare=False)

  def __post_init__(self):
    # Raises TypeError for an unhashable value (the caller's fallback).
    object.__setattr__(self, "key", hash(self._typed()))

  def _typed(self):
    # Values compare with their types: 1 and 1.0 (or True) stay apart.
    return tuple((name, type(value), value) for name, value in self.bound)

  def __hash__(self):
    return self.key

  def __eq__(self, other):
    return (isinstance(other, BoundFlash) and self.key == other.key
            and self._typed() == other._typed())

  def __call__(self, *args, **more):
    bound = dict(self.bound)
    reason = api.unsupported_reason(*args, **bound, **more)
    if reason is not None:
      # unittest.SkipTest is what TestCase.skipTest raises; the function
      # holds no test, since equal functions are shared between tests.
      raise unittest.SkipTest(f"{bound['implementation']}: {reason}")
    return jflash.flash_attention(*args, **bound, **more)


class BackendTestCase(parameterized.TestCase):
  """Base of the per-backend test classes (see `for_each_backend`)."""

  TARGET: Target | None = None

  def setUp(self):
    super().setUp()
    target = self.TARGET
    if target is not None and (target.input_dtype or target.head_dims):
      original = test_util.random_inputs

      def adapted(seed, *, head_dim=32, dtype=None, **kwargs):
        # Only the default dtype is replaced: a test that asks for float32
        # by name skips on the target, with the registry's reason.
        if dtype is None:
          dtype = target.input_dtype or "float32"
        if target.head_dims:
          head_dim = min((d for d in target.head_dims if d >= head_dim),
                         default=head_dim)
        return original(seed, head_dim=head_dim, dtype=dtype, **kwargs)

      patcher = mock.patch.object(test_util, "random_inputs", adapted)
      patcher.start()
      self.addCleanup(patcher.stop)

  @property
  def implementation(self) -> str:
    return self.TARGET.implementation

  @property
  def options(self) -> dict[str, Any]:
    """The target's backend keyword arguments (interpret, block_sizes)."""
    return dict(self.TARGET.options)

  @property
  def interpret(self) -> bool:
    return self.options.get("interpret", False)

  @property
  def backend(self) -> registry.Backend:
    return registry.get(self.implementation)

  @property
  def runs_kernels(self) -> bool:
    """Whether the target runs Pallas kernels (not plain JAX)."""
    return not self.backend.differentiable

  def flash(self, **kwargs):
    """`jflash.flash_attention` on this target, with `kwargs` bound.

    The returned function skips the test (with the registry's reason) when
    the target cannot run the call, checked on its arguments before it
    runs. `kwargs` may override the target's options (e.g. block_sizes).

    For hashable options it is a `BoundFlash`, equal (and hash-equal) to
    any other for the same target and options: passed as a static argument
    of a jitted step (`test_util.STEP`), the same program is traced and
    compiled once per process, not once per test (a retrace misses JAX's
    persistent compilation cache, see BoundFlash). An option that is an
    array (lengths, slopes, keys) gives a fresh closure instead.
    """
    bound = {"implementation": self.implementation, **self.options,
             **kwargs}
    try:
      return BoundFlash(tuple(bound.items()))
    except TypeError:  # An unhashable option (an array): a fresh closure.
      pass

    def call(*args, **more):
      reason = api.unsupported_reason(*args, **bound, **more)
      if reason is not None:
        self.skipTest(f"{self.implementation}: {reason}")
      return jflash.flash_attention(*args, **bound, **more)

    return call

  def flash_forward(self, **kwargs):
    """`self.flash` for a call that has a forward pass only (FP8 inputs, a
    paged cache): skips, with the registry's reason, only when the target
    cannot run its forward."""
    bound = {"implementation": self.implementation, **self.options,
             **kwargs}

    def call(*args, **more):
      reason = api.unsupported_reason(*args, **bound, **more,
                                      passes=(registry.FORWARD,))
      if reason is not None:
        self.skipTest(f"{self.implementation}: {reason}")
      return jflash.flash_attention(*args, **bound, **more)

    return call

  def require_independent_reference(self) -> None:
    """Skips on the xla backend a test whose only check compares with the
    xla backend (options jax.nn lacks): it would compare it with itself."""
    if self.implementation == "xla":
      self.skipTest("xla: this test's reference is the xla backend itself "
                    "(jax.nn lacks the option); checking it against itself "
                    "asserts nothing")

  def require_kernels(self, why: str) -> None:
    """Skips on targets that run no kernels, saying why the test is about
    kernels only."""
    if not self.runs_kernels:
      self.skipTest(f"{self.implementation} runs no kernels: {why}")


def for_each_backend(namespace: dict[str, Any], test_class: type,
                     targets=TARGETS) -> None:
  """Replaces `test_class` in `namespace` by one subclass per target.

  Call it at the end of a test file with `globals()`: the written class
  disappears from the module (so no runner collects it without a target)
  and `{Name}_{implementation}` classes take its place.
  """
  del namespace[test_class.__name__]
  for target in targets:
    name = f"{test_class.__name__}_{target.implementation}"
    namespace[name] = type(name, (test_class,), {
        "TARGET": target, "__module__": test_class.__module__,
        "__qualname__": name})
