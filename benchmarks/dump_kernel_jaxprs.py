"""Writes the kernels' jaxprs (every pallas_call of forward + backward).

A development check, not a benchmark: when a change must leave the
GPU-verified kernels untouched (a refactor, or new options behind static
flags), dump the kernels before and after the change and compare the two
files byte for byte. Runs on CPU (the kernels are traced with
interpret=True, nothing is lowered or run).

For each configuration the file holds, per pallas_call in trace order: its
name, grid mapping (grid, BlockSpecs and their index-map jaxprs), compiler
parameters, input and output avals, and the kernel's jaxpr. Everything
outside the pallas_calls (the custom_vjp binding, sharding wrappers, host
XLA) is left out, so the comparison is about what runs on the GPU; `--full`
writes the whole jaxpr instead.

  PYTHONPATH=. python3 benchmarks/dump_kernel_jaxprs.py /tmp/before.txt
  ... change ...
  PYTHONPATH=. python3 benchmarks/dump_kernel_jaxprs.py /tmp/after.txt
  cmp /tmp/before.txt /tmp/after.txt
"""

import argparse
import itertools

import jax
import jax.numpy as jnp

import jflash

# (q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype)
SHAPES = ((100, 257, 4, 1, 80, "bfloat16"), (64, 64, 2, 2, 128, "float32"))
GQA = (96, 96, 4, 2, 64, "bfloat16")


def _options():
  """(label, shape, is_causal, keyword arguments) of every configuration."""
  configs = []
  for is_causal, lengths, shape in itertools.product(
      (False, True), (False, True), SHAPES):
    kwargs = {}
    if lengths:
      kwargs.update(query_seq_lengths=jnp.array([shape[0], 5]),
                    key_value_seq_lengths=jnp.array([3, shape[1]]))
    configs.append((f"lengths={lengths}", shape, is_causal, kwargs))
  q_len, kv_len, num_heads = GQA[:3]
  ids = lambda n: jnp.repeat(jnp.arange(4), n // 4 + 1)[None, :n].repeat(
      2, 0)
  extra = {
      "soft_cap": dict(logits_soft_cap=20.0),
      "window": dict(local_window_size=(17, 5)),
      "bottom_right": dict(causal_alignment="bottom_right"),
      "residuals": dict(return_residual=True),
      "segments": dict(q_segment_ids=ids(q_len), kv_segment_ids=ids(kv_len)),
      "bias_per_head": dict(
          bias=jnp.ones((2, num_heads, q_len, kv_len), jnp.float32)),
      "bias_broadcast": dict(bias=jnp.ones((1, 1, q_len, kv_len))),
      "mask": dict(mask=jnp.ones((2, 1, q_len, kv_len), bool)),
      "sinks": dict(sinks=jnp.ones((num_heads,))),
      "alibi": dict(alibi_slopes=jnp.ones((num_heads,))),
      "dropout": dict(dropout_rate=0.25, dropout_rng=jax.random.key(0)),
      "everything": dict(
          logits_soft_cap=20.0, local_window_size=(17, 5),
          q_segment_ids=ids(q_len), kv_segment_ids=ids(kv_len),
          sinks=jnp.ones((num_heads,)), alibi_slopes=jnp.ones((num_heads,)),
          dropout_rate=0.25, dropout_rng=jax.random.key(0),
          mask=jnp.ones((1, num_heads, q_len, kv_len), bool),
          query_seq_lengths=jnp.array([90, 5]),
          key_value_seq_lengths=jnp.array([3, 96])),
  }
  for (label, kwargs), is_causal in itertools.product(
      extra.items(), (False, True)):
    configs.append((label, GQA, is_causal, kwargs))
  return configs


def _pallas_calls(jaxpr, found):
  """Appends every pallas_call equation under `jaxpr`, in trace order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(eqn)
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _pallas_calls(inner, found)
  return found


def _describe(eqn) -> str:
  params = eqn.params
  return "\n".join([
      f"pallas_call {params['name']}",
      f"inputs: {[str(v.aval) for v in eqn.invars]}",
      f"outputs: {[str(a) for a in params['out_avals']]}",
      f"compiler_params: {params['compiler_params']}",
      f"grid_mapping: {params['grid_mapping']}",
      *(f"index_map {i} {m.block_shape} of {m.array_aval}: "
        f"{m.index_map_jaxpr}"
        for i, m in enumerate(params["grid_mapping"].block_mappings)),
      f"kernel:\n{params['jaxpr']}",
  ])


def main(path: str, full: bool) -> None:
  texts = []
  for label, shape, is_causal, kwargs in _options():
    q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype = shape
    q = jnp.ones((2, q_len, num_heads, head_dim), dtype)
    k = jnp.ones((2, kv_len, num_kv_heads, head_dim), dtype)
    kwargs = dict(kwargs, is_causal=is_causal, interpret=True)

    def value_and_grads(q, k, v, kwargs=kwargs):
      out, vjp = jax.vjp(
          lambda q, k, v: jflash.flash_attention(q, k, v, **kwargs), q, k, v)
      return out, vjp(out)

    jaxpr = jax.make_jaxpr(value_and_grads)(q, k, k)
    body = (str(jaxpr) if full else "\n\n".join(
        _describe(e) for e in _pallas_calls(jaxpr.jaxpr, [])))
    texts.append(f"== {label} causal={is_causal} {shape}\n{body}")
  with open(path, "w") as f:
    f.write("\n\n".join(texts))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path")
  parser.add_argument("--full", action="store_true",
                      help="the whole jaxpr, not only the kernels")
  args = parser.parse_args()
  main(args.path, args.full)
