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

`--decode` writes the split-K decode kernel's (decode_attention, dense and
paged, and flash_attention's "decode" backend) instead; `--decode-fp8` its
FP8 (e4m3 query and cache) launches, dense and paged, with and without
splits and sinks (a separate file, so the 16-bit one stays comparable).

`--mosaic` writes the Mosaic GPU kernels' instead: the jaxprs of the
backend's forward and backward functions (the kernel bodies included;
traced on CPU, nothing lowered), for head dims 64/128/256 under six
configurations that together cover the persistent forward (causal and
not), lengths, segments (with and without lengths), windows (one- and
two-sided), soft cap, sinks and the atomic_dq backward (head dims <= 128;
float32 adds, then a deterministic call's int32 fixed point, its sections
after the others of the configuration).
"""

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp

import jflash
from tests import test_util

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


def _mosaic_texts():
  """The Mosaic backend's forward and backward jaxprs, per configuration."""
  # pylint: disable=g-import-not-at-top
  from jflash._src.backends.mosaic import backend as mosaic
  from jflash._src.spec import CallSpec, MaskSpec, ModifierSpec, Operands
  texts = []
  batch, q_len, kv_len, heads, kv_heads = 2, 520, 392, 8, 4
  # (mask, soft cap, sinks, atomic_dq). Without window, lengths or
  # segments the forward is persistent (causal: in tile pairs).
  cases = (
      (MaskSpec(is_causal=False, has_lengths=False), None, False, False),
      (MaskSpec(is_causal=True, has_lengths=True), 20.0, False, False),
      (MaskSpec(is_causal=True, has_lengths=False, bottom_right=True,
                window=(50, 0)), None, True, False),
      (MaskSpec(is_causal=True, has_lengths=False), None, True, True),
      (MaskSpec(is_causal=False, has_lengths=True, has_segments=True),
       10.0, True, False),
      (MaskSpec(is_causal=True, has_lengths=False, window=(70, 30),
                has_segments=True), None, False, True))
  for head_dim, (mask, soft_cap, sinks, atomic_dq) in itertools.product(
      (64, 128, 256), cases):
    # atomic_dq supports head dims <= 128.
    atomic_dq = atomic_dq and head_dim <= 128
    spec = CallSpec(batch=batch, q_len=q_len, kv_len=kv_len,
                    num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype="bfloat16",
                    scale=head_dim ** -0.5, mask=mask,
                    logits_soft_cap=soft_cap,
                    modifiers=ModifierSpec(has_sinks=sinks))
    config = mosaic.BACKEND.configure(spec)
    if atomic_dq:
      spec = dataclasses.replace(spec, deterministic_grads=False)
      config = mosaic.BACKEND.configure(spec, block_sizes=dataclasses.replace(
          config.block_sizes, atomic_dq=True))
    q = jnp.ones((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jnp.ones((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    lengths = jnp.array([500, 7], jnp.int32)
    extra = jnp.zeros((batch, heads), jnp.float32)
    # Segments: runs of 37 positions (queries) and 29 (keys).
    q_ids = jnp.broadcast_to(jnp.arange(q_len) // 37, (batch, q_len))
    kv_ids = jnp.broadcast_to(jnp.arange(kv_len) // 29, (batch, kv_len))

    def operands(q, k, v, lengths, sinks_value, mask=mask, sinks=sinks,
                 q_ids=q_ids, kv_ids=kv_ids):
      ops = Operands(q, k, v, sinks=sinks_value if sinks else None)
      if mask.has_lengths:
        ops = ops.replace(q_lengths=lengths, kv_lengths=lengths)
      if mask.has_segments:
        ops = ops.replace(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
      return ops

    forward = lambda *a, spec=spec, config=config: mosaic.forward(
        spec, config, operands(*a))
    out, lse2 = jax.eval_shape(forward, q, k, k, lengths, extra)
    backward = lambda *a, spec=spec, config=config: mosaic.backward(
        spec, config, operands(*a[:5]), *a[5:], None)
    label = (f"== mosaic D={head_dim} {mask} soft_cap={soft_cap} "
             f"sinks={sinks}" + (" atomic_dq" if atomic_dq else ""))
    texts.append(f"{label} forward\n"
                 f"{jax.make_jaxpr(forward)(q, k, k, lengths, extra)}")
    texts.append(f"{label} backward\n" + str(jax.make_jaxpr(backward)(
        q, k, k, lengths, extra, jnp.ones(out.shape, out.dtype),
        jnp.ones(lse2.shape), q)))
    if atomic_dq:
      # The atomic dQ of a deterministic call: int32 fixed point.
      fixed_spec = dataclasses.replace(spec, deterministic_grads=True)
      backward = lambda *a, spec=fixed_spec, config=config: mosaic.backward(
          spec, config, operands(*a[:5]), *a[5:], None)
      texts.append(f"{label} fixed_point backward\n" + str(
          jax.make_jaxpr(backward)(
              q, k, k, lengths, extra, jnp.ones(out.shape, out.dtype),
              jnp.ones(lse2.shape), q)))
  return texts


def _decode_texts():
  """The decode kernel's pallas_calls, per configuration (interpreted)."""
  texts = []
  # (batch, tokens, heads, kv_heads, head_dim, dtype, page_size)
  shapes = ((2, 1, 8, 2, 128, "bfloat16", None),
            (2, 4, 4, 4, 80, "float32", None),
            (2, 3, 8, 1, 256, "bfloat16", 64),
            (2, 2, 4, 2, 64, "float16", 16))
  options = {
      "plain": dict(),
      "not_causal": dict(is_causal=False),
      "window": dict(local_window_size=(40, 3)),
      "soft_cap_sinks_alibi": dict(logits_soft_cap=20.0,
                                   sinks=jnp.ones((8,)),
                                   alibi_slopes=jnp.ones((8,))),
      "splits": dict(num_splits=3),
  }
  kv_seq = 256
  for shape, (label, kwargs) in itertools.product(shapes, options.items()):
    batch, tokens, heads, kv_heads, head_dim, dtype, page_size = shape
    q, k, lengths, kwargs = _decode_inputs(
        batch, tokens, heads, kv_heads, head_dim, dtype, page_size, kv_seq,
        kwargs)
    run = lambda q, k, v, kwargs=kwargs: jflash.decode_attention(
        q, k, v, lengths, interpret=True, implementation="decode", **kwargs)
    body = _pallas_calls(run, q, k, k)
    texts.append(f"== decode_attention {label} {shape}\n{body}")
    if page_size is None and label in ("plain", "window"):
      # flash_attention's decode backend (flash_attention's positions).
      fa_kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ != "num_splits"}
      fa_kwargs.pop("is_causal", None)
      run = lambda q, k, v, kwargs=fa_kwargs: jflash.flash_attention(
          q, k, v, is_causal=True, causal_alignment="bottom_right",
          key_value_seq_lengths=lengths, implementation="decode",
          interpret=True, **kwargs)
      body = _pallas_calls(run, q, k, k)
      texts.append(f"== flash_attention decode {label} {shape}\n{body}")
  return texts


def _decode_inputs(batch, tokens, heads, kv_heads, head_dim, dtype,
                   page_size, kv_seq, kwargs):
  """(q, k, lengths, kwargs) of a decode case: ones, the cache dense or in
  pages (a block table then in kwargs), per-head options cut to `heads`."""
  kwargs = dict(kwargs)
  for name in ("sinks", "alibi_slopes"):
    if name in kwargs:
      kwargs[name] = kwargs[name][:heads]
  q = jnp.ones((batch, tokens, heads, head_dim), dtype)
  k = jnp.ones((batch, kv_seq, kv_heads, head_dim), dtype)
  lengths = jnp.array([kv_seq, 77], jnp.int32)
  if page_size is not None:
    pages = kv_seq // page_size
    k = jnp.ones((batch * pages, page_size, kv_heads, head_dim), dtype)
    kwargs["block_table"] = jnp.arange(batch * pages).reshape(batch, pages)
  return q, k, lengths, kwargs


def _pallas_calls(run, *args) -> str:
  """The pallas_call equations of run(*args)'s jaxpr, described."""
  jaxpr = jax.make_jaxpr(run)(*args)
  return "\n\n".join(_describe(e) for e in test_util.equations(
      jaxpr.jaxpr, "pallas_call"))


def _decode_fp8_texts():
  """The decode kernel's FP8 pallas_calls, per configuration."""
  texts = []
  kv_seq = 256
  # (batch, tokens, heads, kv_heads, head_dim, page_size)
  shapes = ((2, 1, 8, 2, 128, None), (2, 4, 8, 2, 256, 64),
            (2, 2, 4, 4, 80, 16))
  options = {
      "plain": dict(),
      "splits_sinks": dict(num_splits=3, sinks=jnp.ones((8,))),
      "window_soft_cap_alibi_float32": dict(
          local_window_size=(40, 3), logits_soft_cap=20.0,
          alibi_slopes=jnp.ones((8,)), out_dtype=jnp.float32),
  }
  fp8 = jnp.float8_e4m3fn
  for shape, (label, kwargs) in itertools.product(shapes, options.items()):
    batch, tokens, heads, kv_heads, head_dim, page_size = shape
    q, k, lengths, kwargs = _decode_inputs(
        batch, tokens, heads, kv_heads, head_dim, fp8, page_size, kv_seq,
        kwargs)
    descales = jnp.full((batch, kv_heads), 0.5, jnp.float32)
    run = lambda q, k, v, d, kwargs=kwargs: jflash.decode_attention(
        q, k, v, lengths, interpret=True, implementation="decode",
        q_descale=d, k_descale=d, v_descale=d, **kwargs)
    body = _pallas_calls(run, q, k, k, descales)
    texts.append(f"== decode_attention fp8 {label} {shape}\n{body}")
  return texts


def main(path: str, full: bool, mosaic: bool = False,
         decode: bool = False, decode_fp8: bool = False) -> None:
  if mosaic or decode or decode_fp8:
    texts = (_mosaic_texts() if mosaic else _decode_texts() if decode
             else _decode_fp8_texts())
    with open(path, "w") as f:
      f.write("\n\n".join(texts))
    return
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
        _describe(e) for e in test_util.equations(jaxpr.jaxpr,
                                                   "pallas_call")))
    texts.append(f"== {label} causal={is_causal} {shape}\n{body}")
  with open(path, "w") as f:
    f.write("\n\n".join(texts))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path")
  parser.add_argument("--full", action="store_true",
                      help="the whole jaxpr, not only the kernels")
  parser.add_argument("--mosaic", action="store_true",
                      help="the Mosaic GPU kernels' jaxprs instead")
  parser.add_argument("--decode", action="store_true",
                      help="the split-K decode kernel's jaxprs instead")
  parser.add_argument("--decode-fp8", action="store_true",
                      help="the decode kernel's FP8 jaxprs instead")
  args = parser.parse_args()
  main(args.path, args.full, args.mosaic, args.decode, args.decode_fp8)
