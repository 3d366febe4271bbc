"""The Mosaic backward at head dim 256: the two ways its warpgroups split a
shared row tile (`config.BWD_SHARED_ROW_SPLIT`), side by side.

Per shape and causality, in interleaved rounds (a call of each step per
round, after a warm-up, each right after each other one equally often over
the rounds, `run.round_orders`, so that clock drift and the clock a call
leaves fall on all alike),
the median time of:

- cuDNN's forward+backward (`jax.nn.dot_product_attention`, as run.py);
- jflash's Mosaic forward+backward with each split;
- the backward kernels alone with each split: both, the dQ kernel alone and
  the dK/dV kernel alone (the other kernel's launch replaced by zeros), on
  the forward's out and lse.

  PYTHONPATH=. python3 benchmarks/mosaic_backward_split.py \\
      --shapes 1,8192,16,256 2,4096,16,256 [--json F]

TFLOP/s count 4·B·H·N²·D per forward, x0.5 causal, x3.5 forward+backward,
x2.5 the backward (run.py's convention); the dQ kernel alone is counted as
the backward's share of its products (3 of 7), the dK/dV kernel as 4 of 7.
"""

import argparse
import functools
import json
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks import run
import jflash
from jflash._src import api
from jflash._src import binding
from jflash._src.backends.mosaic import backward as mosaic_backward
from jflash._src.backends.mosaic import config as mosaic_config
from jflash._src.backends.mosaic import forward as mosaic_forward
from jflash._src.backends.mosaic import pipeline
from jflash._src.spec import Operands

SPLITS = ("columns", "products")


def _only_kernel(name: str):
  """`pipeline.launch` that runs only the kernel function `name` and
  returns zeros for any other launch's outputs."""
  launch = pipeline.launch

  def only(kernel, scratch, inputs, *, out_type, **kwargs):
    if kernel.func.__name__ != name:
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_type)
    return launch(kernel, scratch, inputs, out_type=out_type, **kwargs)

  return only


def _inputs(shape):
  batch, seq, heads, head_dim = shape
  return tuple(jax.random.normal(key, (batch, seq, heads, head_dim),
                                 jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 4))


def _loss(attention, q, k, v, ct):
  out = attention(q, k, v)
  return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))


def _fwd_bwd(attention):
  return jax.jit(jax.grad(functools.partial(_loss, attention),
                          argnums=(0, 1, 2)))


def _steps(shape, is_causal: bool):
  """{name: (jitted step, args)}: cuDNN's forward+backward, and per split
  jflash's forward+backward and its backward kernels (each traced and run
  once under its split)."""
  q, k, v, dout = _inputs(shape)
  head_dim = shape[3]
  steps = {"cudnn fwd+bwd": (_fwd_bwd(functools.partial(
      jax.nn.dot_product_attention, is_causal=is_causal,
      implementation="cudnn")), (q, k, v, dout))}
  spec = api.describe(q, k, v, is_causal=is_causal).spec
  sizes = mosaic_config.default_block_sizes(head_dim, 2)
  out, lse2 = jax.jit(functools.partial(
      mosaic_forward.forward_call, spec=spec, block_sizes=sizes))(
          Operands(q, k, v))
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32),
                     dout.astype(jnp.float32))
  for split in SPLITS:
    with mock.patch.object(mosaic_config, "BWD_SHARED_ROW_SPLIT", split):
      # jflash keeps each call's traced pass: drop them for this split.
      binding.clear_traced_passes()
      name = f"{split} fwd+bwd"
      steps[name] = (_fwd_bwd(functools.partial(
          jflash.flash_attention, is_causal=is_causal,
          implementation="mosaic")), (q, k, v, dout))
      jax.block_until_ready(steps[name][0](*steps[name][1]))
      for label, kernel in (("bwd", None), ("dq", "dq_kernel"),
                            ("dkv", "dkv_kernel")):

        def backward(q, k, v, dout, lse2, delta):
          return mosaic_backward.backward_call(
              Operands(q, k, v), dout, lse2, delta, spec=spec,
              block_sizes=sizes)

        step, args = jax.jit(backward), (q, k, v, dout, lse2, delta)
        launch = (pipeline.launch if kernel is None
                  else _only_kernel(kernel))
        with mock.patch.object(pipeline, "launch", launch):
          jax.block_until_ready(step(*args))
        steps[f"{split} {label}"] = (step, args)
  return steps


def _flops(shape, is_causal: bool, name: str) -> float:
  batch, seq, heads, head_dim = shape
  forward = 4.0 * batch * heads * seq**2 * head_dim * (0.5 if is_causal
                                                       else 1.0)
  factor = {"fwd+bwd": 3.5, "bwd": 2.5, "dq": 2.5 * 3 / 7,
            "dkv": 2.5 * 4 / 7}[name.split()[-1]]
  return forward * factor


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+",
                      default=["1,8192,16,256", "2,4096,16,256"])
  parser.add_argument("--causal", choices=("both", "yes", "no"),
                      default="both")
  # Nine calls per case: a balanced cycle of 18 rounds (`run.round_orders`).
  parser.add_argument("--rounds", type=int, default=18)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--json")
  args = parser.parse_args()
  causalities = {"both": (False, True), "yes": (True,),
                 "no": (False,)}[args.causal]
  rows = []
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  for text in args.shapes:
    shape = tuple(int(x) for x in text.split(","))
    for is_causal in causalities:
      steps = _steps(shape, is_causal)
      times = {name: [] for name in steps}
      for _ in range(2):  # Warm-up.
        for step, step_args in steps.values():
          jax.block_until_ready(step(*step_args))
      for order in run.round_orders(list(steps), args.rounds):
        for name in order:
          step, step_args = steps[name]
          start = time.perf_counter()
          for _ in range(args.iters):
            result = step(*step_args)
          jax.block_until_ready(result)
          times[name].append((time.perf_counter() - start) / args.iters)
      print(f"\n{text} causal={is_causal}")
      cudnn = statistics.median(times["cudnn fwd+bwd"])
      for name, samples in times.items():
        median = statistics.median(samples)
        tflops = _flops(shape, is_causal, name) / median / 1e12
        spread = (max(samples) - min(samples)) / median
        ratio = (f"  {cudnn / median:.3f}x cuDNN" if name.endswith("fwd+bwd")
                 else "")
        print(f"  {name:18s} {median * 1e3:8.3f} ms  {tflops:6.1f} TFLOP/s"
              f"  spread {spread:.1%}{ratio}")
        rows.append(dict(shape=text, causal=is_causal, step=name,
                         ms=median * 1e3, tflops=tflops, samples=samples))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
