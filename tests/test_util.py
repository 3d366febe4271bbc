"""Shared helpers: inputs, references, the comparison the table defines, and
the runner of a test file's cases on fake CPU devices."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import subprocess
import sys
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash._src import binding
from jflash._src import registry
from tests import tolerances

# The kernel tests run compiled on a GPU when JFLASH_TEST_ON_GPU=1 and through
# the Pallas interpreter (the very same kernels) everywhere else.
ON_GPU = os.environ.get("JFLASH_TEST_ON_GPU", "") == "1"
INTERPRET = not ON_GPU

# Small tiles, different for every kernel, so that short test sequences still
# cross several tiles (and partial last tiles) in every loop.
SMALL_BLOCKS = jflash.BlockSizes(
    block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16, block_q_dq=16,
    block_k_dq=32)


def sweep(cases, cpu_cases):
  """`cases` on a GPU, `cpu_cases` (a subset of them) elsewhere.

  Compiled on a GPU, every head dim or sequence length of a sweep gives
  different Triton / Mosaic code, so the GPU suite runs all of them. In the
  Pallas interpreter the kernels run the same Python lines for, e.g., head
  dims 64 and 128, and each case costs seconds of XLA compilation: the CPU
  suite runs the subset that still reaches every distinct edge (padded and
  unpadded head dims, partial last tiles, one tile and several, q shorter and
  longer than kv, ...). Each call site says why its subset covers the rest.
  """
  cases, cpu_cases = tuple(cases), tuple(cpu_cases)
  missing = [c for c in cpu_cases if c not in cases]
  if missing:
    raise ValueError(f"CPU cases {missing} are not in the sweep {cases}")
  return cases if ON_GPU else cpu_cases


@contextlib.contextmanager
def spy(module, name: str):
  """A spy (mock wrapping the original) on `module.name`, a function that
  jflash's kernel passes call while tracing. The passes' traces are kept
  per call (`binding._shared_pass`, a jax.jit): they are dropped first, so
  the spy sees this test's calls even where an equal call was traced
  before."""
  binding.clear_traced_passes()
  with mock.patch.object(module, name, wraps=getattr(module, name)) as calls:
    yield calls


def decode_kernel_spy():
  """A spy on the "decode" backend's kernel (implementation=None chooses
  the backend for every call it supports)."""
  # pylint: disable-next=g-import-not-at-top
  from jflash._src.backends.triton import decode_backend
  return spy(decode_backend, "kernel_attention")


def skip_unless_mosaic_gpu(test, what: str = "the Mosaic kernels run"):
  """Skips `test` unless the Mosaic GPU kernels can run here compiled (a
  Hopper GPU, JFLASH_TEST_ON_GPU=1), with the registry's reason."""
  reason = registry.unavailable_reason(registry.get("mosaic"), False)
  if reason is not None or not ON_GPU:
    test.skipTest(f"{what} on Hopper GPUs only (the GPU suite on an "
                  f"H100/H200 runs this test): {reason}")


def run_file_on_cpu_devices(test, test_file: str, num_devices: int,
                            select: str):
  """Runs the cases of `test_file` selected by `select` (pytest's -k) in a
  subprocess with `num_devices` CPU devices, and fails `test` with the
  subprocess's output unless they all pass.

  The device count must be set before JAX starts its backends, so it goes
  through JFLASH_TEST_CPU_DEVICES (conftest.py); the subprocess runs on the
  CPU, its kernels interpreted, whatever JFLASH_TEST_ON_GPU says here.
  """
  env = dict(os.environ, JFLASH_TEST_CPU_DEVICES=str(num_devices),
             JAX_PLATFORMS="cpu")
  env.pop("JFLASH_TEST_ON_GPU", None)  # Kernels interpreted on the CPU.
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-n", "0", "-k", select, test_file],
      env=env, capture_output=True, text=True, check=False,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  test.assertEqual(result.returncode, 0,
                   msg=result.stdout[-20000:] + result.stderr[-5000:])
  test.assertIn(" passed", result.stdout.splitlines()[-1])


def random_inputs(seed: int, *, batch=2, q_len=64, kv_len=64, num_heads=2,
                  num_kv_heads=None, head_dim=32, dtype="float32"):
  """Fresh random q, k, v and an output cotangent (never zeros).

  Drawn on the host with NumPy and rounded there to `dtype`: jax.random
  compiles a sampler for every new shape and dtype (~0.3 s of CPU each, 5%
  of the CPU suite's compile time), NumPy compiles nothing.
  """
  num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype)
  normal = lambda *shape: jnp.asarray(
      rng.standard_normal(shape, np.float32).astype(dtype))
  q = normal(batch, q_len, num_heads, head_dim)
  k = normal(batch, kv_len, num_kv_heads, head_dim)
  v = normal(batch, kv_len, num_kv_heads, head_dim)
  dout = normal(*q.shape)
  return q, k, v, dout


def value_and_grads(fn, q, k, v, dout):
  """(out, dq, dk, dv) of fn through jax.vjp with the cotangent dout."""
  return value_and_all_grads(fn, dout, q, k, v)


def value_and_all_grads(fn, dout, *args):
  """(out, d arg for each arg) of fn through jax.vjp with the cotangent dout.

  The cotangent is cast to the output's dtype. For fn returning a tuple
  (e.g. (out, lse) with return_residual=True), dout is a tuple like it and
  the result is flat: (out, lse, d arg for each arg). Bound as
  `functools.partial(value_and_all_grads, fn, dout)`, it is one function of
  the args to jit, with the cotangent (and its sharding) closed over.
  """
  out, vjp = jax.vjp(fn, *args)
  grads = vjp(jax.tree.map(lambda d, o: d.astype(o.dtype), dout, out))
  return (*(out if isinstance(out, tuple) else (out,)), *grads)


# The jitted steps of the kernel tests, one per process: `fn` is static, and
# equal functions (test_base.BoundFlash) reuse one trace and compilation.
STEP = jax.jit(value_and_grads, static_argnums=0)
ALL_GRADS_STEP = jax.jit(value_and_all_grads, static_argnums=0)
# The same for a call alone, fn(*args, **kwargs) (where two `jax.jit(fn)`
# of equal functions would trace and compile twice); a dropout rate is a
# Python float the call checks, so it stays static.
CALL = jax.jit(lambda fn, *args, **kwargs: fn(*args, **kwargs),
               static_argnums=0, static_argnames="dropout_rate")


def _fingerprint(*trees) -> str:
  """A digest of arrays and plain values (the key of `_memoized`)."""
  digest = hashlib.sha256()
  leaves, treedef = jax.tree.flatten(trees)
  digest.update(str(treedef).encode())
  for leaf in leaves:
    if isinstance(leaf, (jax.Array, np.ndarray)):
      if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
      leaf = np.asarray(leaf)
      digest.update(f"{leaf.dtype}{leaf.shape}".encode())
      digest.update(leaf.tobytes())
    else:
      digest.update(repr(leaf).encode())
  return digest.hexdigest()


_REFERENCES: dict[str, object] = {}


def _memoized(compute):
  """Caches a reference computation by the digest of its arguments.

  Every kernel test runs once per backend (test_base.py) on the same inputs,
  so each reference is computed once per process, not once per backend.
  """

  def cached(*args, **kwargs):
    key = f"{compute.__name__}:{_fingerprint(args, kwargs)}"
    if key not in _REFERENCES:
      _REFERENCES[key] = compute(*args, **kwargs)
    return _REFERENCES[key]

  return cached


@_memoized
def jax_nn(q, k, v, dout, *, upcast: bool, **kwargs):
  """jax.nn.dot_product_attention results; upcast=True: fp32 at HIGHEST."""
  fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kwargs)
  if not upcast:
    try:
      return jax.jit(value_and_grads, static_argnums=0)(fn, q, k, v, dout)
    except ValueError as e:
      # jax.nn's float16 backward asks for an F16_F16_F32 dot, which XLA:CPU
      # rejects. There, the float16 baseline is jflash's own pure-JAX path
      # (same fp32 logits and softmax as jax.nn's XLA path).
      if "not supported by dot_general on CPU" not in str(e):
        raise
      fn = lambda q, k, v: jflash.flash_attention(
          q, k, v, implementation="xla", **kwargs)
      return jax.jit(value_and_grads, static_argnums=0)(fn, q, k, v, dout)
  with jax.default_matmul_precision("highest"):
    args = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    return jax.jit(value_and_grads, static_argnums=0)(fn, *args)


def assert_close_to_jax_nn(test, results, q, k, v, dout, **jax_nn_kwargs):
  """Checks (out, dq, dk, dv) against jax.nn under the tolerance table.

  Args:
    test: the test case (for its failure messages).
    results: (out, dq, dk, dv) from jflash.
    q, k, v, dout: the inputs the results came from.
    **jax_nn_kwargs: arguments of jax.nn.dot_product_attention.
  """
  reference = jax_nn(q, k, v, dout, upcast=True, **jax_nn_kwargs)
  low = jax_nn(q, k, v, dout, upcast=False, **jax_nn_kwargs)
  _assert_within_table(test, results, reference, low, q.dtype)


def assert_close_to_reference(test, results, q, k, v, dout, **kwargs):
  """As assert_close_to_jax_nn, against jflash's pure-JAX path.

  For options jax.nn does not have (soft-capping, bottom-right causal
  alignment): the reference is jflash's "xla" implementation on float32
  inputs at HIGHEST precision, the low-precision baseline the same path in
  the input dtype. On the xla backend itself (test_base) there is nothing
  to compare, and nothing is checked: tests that check nothing else skip
  there first (`require_independent_reference`).
  """
  if getattr(test, "implementation", None) == "xla":
    return
  reference, low = _xla_path_references(q, k, v, dout, **kwargs)
  _assert_within_table(test, results, reference, low, q.dtype)


@_memoized
def _xla_path_references(q, k, v, dout, **kwargs):
  """(float32 at HIGHEST, input dtype) results of jflash's XLA path."""
  fn = lambda q, k, v: jflash.flash_attention(q, k, v, implementation="xla",
                                              **kwargs)
  step = jax.jit(value_and_grads, static_argnums=0)
  with jax.default_matmul_precision("highest"):
    reference = step(fn, *(x.astype(jnp.float32) for x in (q, k, v, dout)))
  return reference, step(fn, q, k, v, dout)


def assert_close_to_function(test, results, fn, args, dout, names):
  """As assert_close_to_jax_nn, against any pure-JAX function of `args`.

  Args:
    test: the test case.
    results: (out, gradient for each of args) from jflash.
    fn: the reference function of `args`; the results of a module-level
      function, or of a functools.partial of one, are computed once per
      process for all backends (see `_function_key`).
    args: its inputs; the first is the query (its dtype sets the floor).
    dout: the output cotangent.
    names: a name for each result, for failure messages.
  """
  key = _function_key(fn)
  if key is None:
    reference, low = _function_references(fn, args, dout)
  else:
    key = f"function:{key}:{_fingerprint(args, dout)}"
    if key not in _REFERENCES:
      _REFERENCES[key] = _function_references(fn, args, dout)
    reference, low = _REFERENCES[key]
  _assert_within_table(test, results, reference, low, args[0].dtype, names)


def _function_key(fn):
  """A key that names what `fn` computes, or None.

  A lambda or a local function may close over anything (and its id can be
  reused once it is freed): only a module-level function, or a
  functools.partial of one with fingerprintable arguments, has a key.
  """
  func, bound = fn, ((), {})
  if isinstance(fn, functools.partial):
    func, bound = fn.func, (fn.args, fn.keywords)
  qualname = getattr(func, "__qualname__", "<locals>")
  if "<locals>" in qualname or "<lambda>" in qualname:
    return None
  return f"{func.__module__}.{qualname}:{_fingerprint(*bound)}"


def _function_references(fn, args, dout):
  """(float32 at HIGHEST, input dtype) results of fn."""
  step = jax.jit(value_and_all_grads, static_argnums=0)
  upcast = lambda x: (x.astype(jnp.float32)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x)
  with jax.default_matmul_precision("highest"):
    reference = step(fn, upcast(dout), *(upcast(x) for x in args))
  return reference, step(fn, dout, *args)



def assert_within_table(test, results, reference, low, dtype, names):
  """Results (a tuple, named by `names`) against a float32 `reference`,
  with `low` (the same computation in `dtype`) as the baseline of the
  tolerance table: for forward-only calls (tests/fp8_test.py)."""
  _assert_within_table(test, results, reference, low, dtype, names)


def _assert_within_table(test, results, reference, low, dtype,
                         names=("out", "dq", "dk", "dv")):
  """results, reference and low: same-length tuples, named by `names`."""
  dtype = jnp.dtype(dtype)
  for name, ours, lo, ref in zip(names, results, low, reference, strict=True):
    chex.assert_shape(ours, ref.shape)
    test.assertEqual(ours.dtype, lo.dtype, msg=name)
    chex.assert_tree_all_finite(ours)
    ours, lo, ref = (np.asarray(x, np.float32) for x in (ours, lo, ref))
    error = np.max(np.abs(ours - ref), initial=0.0)
    low_error = np.max(np.abs(lo - ref), initial=0.0)
    scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    bound = (tolerances.FACTOR * low_error
             + tolerances.FLOOR[dtype.name] * scale)
    test.assertLessEqual(
        error, bound,
        msg=f"{name}: jflash error {error:.3g} > bound {bound:.3g} "
            f"(baseline {dtype.name} error {low_error:.3g})")


def equations(jaxpr, primitive: str) -> list:
  """The equations of `primitive` in a jaxpr and the jaxprs nested in it,
  in trace order (not looking inside the ones found)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == primitive:
        found.append(eqn)
        continue
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr)
  return found


def kernel_jaxprs(closed_jaxpr) -> list[str]:
  """The jaxprs of every pallas_call under a jaxpr (nested ones included),
  in trace order: what runs on the device, without the wrappers around.

  Whitespace is normalized and the context mesh that inner `jit`s record
  under a mesh (`ctx_mesh=...`, metadata only) is left out.
  """

  def normalized(text):
    text = re.sub(r"ctx_mesh=Mesh\((?:[^()]|\([^()]*\))*\)", "", text)
    text = re.sub(r"\s+", " ", text)
    return text.replace("[ ", "[").replace(" ]", "]")

  return [normalized(str(eqn.params["jaxpr"]))
          for eqn in equations(closed_jaxpr.jaxpr, "pallas_call")]
