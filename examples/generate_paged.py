"""Example 4: batched generation with a paged KV cache.

A small decoder-only model (random weights: this example is about serving
mechanics and speed, not text) generates for a batch of sequences of
different prompt and output lengths. Its KV cache is paged: each layer's
keys and values live in a pool of pages [num_pages, page_size, kv_heads,
head_dim], a block table maps each sequence's positions to pages, pages are
taken from a free stack (JAX arrays) when a sequence grows into a new page
and returned when it finishes, so finished sequences free memory for the
rest. Attention is `jflash.decode_attention(..., block_table=...)`.

The same model also runs on a dense cache [batch, max_len, ...] with jflash,
and on the dense cache with `jax.nn.dot_product_attention` (cuDNN on a GPU,
XLA elsewhere). The script checks that the three give the same logits and
prints tokens/s for each.

Run:
  python examples/generate_paged.py          # GPU sizes; small on CPU
  python examples/generate_paged.py --tiny   # seconds on CPU
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jflash

GPU_SETTINGS = dict(batch=32, layers=4, dim=1024, heads=16, kv_heads=4,
                    page_size=64, max_prompt=512, max_new=256)
CPU_SETTINGS = dict(batch=4, layers=2, dim=128, heads=4, kv_heads=2,
                    page_size=16, max_prompt=48, max_new=32)
TINY_SETTINGS = dict(batch=3, layers=1, dim=64, heads=4, kv_heads=2,
                     page_size=16, max_prompt=20, max_new=12)
VOCAB = 256


def init_params(key, *, layers, dim, heads, kv_heads, max_len):
  head_dim = dim // heads
  keys = iter(jax.random.split(key, 2 + 6 * layers))
  normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
  return dict(
      embed=normal((VOCAB, dim), 1.0),
      positions=normal((max_len, dim), 0.1),
      layers=[dict(wq=normal((dim, heads * head_dim), dim ** -0.5),
                   wk=normal((dim, kv_heads * head_dim), dim ** -0.5),
                   wv=normal((dim, kv_heads * head_dim), dim ** -0.5),
                   wo=normal((heads * head_dim, dim), dim ** -0.5),
                   w1=normal((dim, 4 * dim), dim ** -0.5),
                   w2=normal((4 * dim, dim), (4 * dim) ** -0.5))
              for _ in range(layers)])


def rms_norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def model_step(params, tokens, positions, attend, *, heads, kv_heads):
  """Logits [B, VOCAB] of one new token per sequence.

  `attend(layer, q [B, 1, N, hd], k [B, K, hd], v [B, K, hd])` stores the
  new key/value in its cache and returns the attention output.
  """
  batch = tokens.shape[0]
  x = params["embed"][tokens] + params["positions"][positions]
  for layer, p in enumerate(params["layers"]):
    h = rms_norm(x)
    q = (h @ p["wq"]).reshape(batch, 1, heads, -1)
    k = (h @ p["wk"]).reshape(batch, kv_heads, -1)
    v = (h @ p["wv"]).reshape(batch, kv_heads, -1)
    x = x + attend(layer, q, k, v).reshape(batch, -1) @ p["wo"]
    x = x + jax.nn.gelu(rms_norm(x) @ p["w1"]) @ p["w2"]
  return rms_norm(x) @ params["embed"].T


# The paged cache and its page allocator, all JAX arrays (jit-friendly).
def init_paged(*, layers, batch, num_pages, page_size, max_pages, kv_heads,
               head_dim, dtype):
  """Page num_pages - 1 is a trash page: writes of idle sequences go there,
  and it is never handed out."""
  shape = (layers, num_pages, page_size, kv_heads, head_dim)
  return dict(
      k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
      table=jnp.full((batch, max_pages), num_pages - 1, jnp.int32),
      free=jnp.arange(num_pages - 1, dtype=jnp.int32),  # A stack.
      num_free=jnp.asarray(num_pages - 1, jnp.int32))


def allocate(cache, positions, active, page_size):
  """Gives each active sequence whose next position opens a page a page."""
  needs = jnp.logical_and(active, positions % page_size == 0)
  rank = jnp.cumsum(needs) - 1  # Among the sequences that need one.
  page = cache["free"][jnp.maximum(cache["num_free"] - 1 - rank, 0)]
  rows = jnp.arange(positions.shape[0])
  slot = positions // page_size
  table = cache["table"].at[rows, slot].set(
      jnp.where(needs, page, cache["table"][rows, slot]))
  return dict(cache, table=table, num_free=cache["num_free"] - needs.sum())


def release(cache, lengths, finished, page_size):
  """Pushes the pages of the sequences that just finished back on the
  stack, in batch order, with one scatter (entries past a sequence's pages,
  or of sequences still running, are dropped)."""
  free, num_free = cache["free"], cache["num_free"]
  max_pages = cache["table"].shape[1]
  counts = jnp.where(finished, -(-lengths // page_size), 0)
  # Where each sequence's pages go: after those of the sequences before it.
  starts = num_free + jnp.cumsum(counts) - counts
  j = jnp.arange(max_pages)[None, :]
  index = jnp.where(j < counts[:, None], starts[:, None] + j, free.shape[0])
  free = free.at[index.reshape(-1)].set(cache["table"].reshape(-1),
                                        mode="drop")
  return dict(cache, free=free, num_free=num_free + jnp.sum(counts))


def paged_step(params, cache, tokens, positions, active, *, config):
  page_size = config["page_size"]
  cache = allocate(cache, positions, active, page_size)
  trash = cache["k"].shape[1] - 1
  rows = jnp.arange(tokens.shape[0])
  page = jnp.where(active, cache["table"][rows, positions // page_size],
                   trash)
  offset = positions % page_size
  lengths = positions + 1
  new = {"k": cache["k"], "v": cache["v"]}

  def attend(layer, q, k, v):
    for name, x in (("k", k), ("v", v)):
      new[name] = new[name].at[layer, page, offset].set(x.astype(
          new[name].dtype))
    return jflash.decode_attention(
        q, new["k"][layer], new["v"][layer], lengths,
        block_table=cache["table"], interpret=config["interpret"])

  logits = model_step(params, tokens, positions, attend,
                      heads=config["heads"], kv_heads=config["kv_heads"])
  return logits, dict(cache, **new)


def dense_step(params, cache, tokens, positions, active, *, config,
               use_jax_nn: bool):
  del active  # Idle sequences rewrite their last entry: ignored.
  rows = jnp.arange(tokens.shape[0])
  lengths = positions + 1
  new = dict(cache)

  def attend(layer, q, k, v):
    for name, x in (("k", k), ("v", v)):
      new[name] = new[name].at[layer, rows, positions].set(
          x.astype(new[name].dtype))
    if use_jax_nn:
      # One query row that sees the whole valid cache.
      implementation = "cudnn" if jax.default_backend() == "gpu" else None
      return jax.nn.dot_product_attention(
          q, new["k"][layer], new["v"][layer],
          key_value_seq_lengths=lengths, implementation=implementation)
    return jflash.decode_attention(q, new["k"][layer], new["v"][layer],
                                   lengths, interpret=config["interpret"])

  logits = model_step(params, tokens, positions, attend,
                      heads=config["heads"], kv_heads=config["kv_heads"])
  return logits, new


def generate(step, cache, params, prompts, prompt_lens, total_lens,
             on_finish=None):
  """Runs every sequence to its length (prompt, then greedy tokens).

  Returns (all logits [steps, B, VOCAB], which rows were active [steps, B],
  the final cache, generated tokens/s timed from the second step on: the
  first compiles the step and the page release).
  """
  batch = prompts.shape[0]
  positions = jnp.zeros((batch,), jnp.int32)
  tokens = prompts[:, 0]
  all_logits, all_active = [], []
  # Tokens generated from the second step on (known ahead: no host syncs).
  generated = int(np.sum(np.asarray(total_lens) - np.maximum(
      np.asarray(prompt_lens), 2)))
  start = None
  for t in range(int(total_lens.max())):
    active = t < total_lens
    logits, cache = step(params, cache, tokens, positions, active)
    all_logits.append(logits)
    all_active.append(active)
    next_prompt = prompts[:, min(t + 1, prompts.shape[1] - 1)]
    tokens = jnp.where(t + 1 < prompt_lens, next_prompt,
                       jnp.argmax(logits, -1).astype(jnp.int32))
    finished = jnp.logical_and(active, t + 1 == total_lens)
    if on_finish is not None:
      cache = on_finish(cache, positions + 1, finished)
    positions = jnp.where(active & ~finished, positions + 1, positions)
    if t == 0:
      jax.block_until_ready((logits, cache))
      start = time.perf_counter()
  jax.block_until_ready(all_logits[-1])
  seconds = time.perf_counter() - start
  return (jnp.stack(all_logits), jnp.stack(all_active), cache,
          generated / max(seconds, 1e-9))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog="Sizes: GPU ones on a GPU, small ones elsewhere, --tiny for "
      "tests.")
  parser.add_argument("--tiny", action="store_true",
                      help="tiny sizes (seconds on CPU)")
  parser.add_argument("--interpret", action="store_true",
                      help="jflash's kernels through the Pallas interpreter "
                      "(CPU; keep --tiny)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the weights, prompts and lengths")
  return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  config = dict(TINY_SETTINGS if args.tiny
                else GPU_SETTINGS if on_gpu else CPU_SETTINGS,
                interpret=args.interpret)
  if not on_gpu and not args.tiny:
    print("No GPU: small sizes (jflash runs its XLA path on CPU).")
  batch, page_size = config["batch"], config["page_size"]
  max_len = config["max_prompt"] + config["max_new"]
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  rng = np.random.default_rng(args.seed)
  prompt_lens = jnp.asarray(rng.integers(1, config["max_prompt"] + 1, batch),
                            jnp.int32)
  total_lens = prompt_lens + jnp.asarray(
      rng.integers(1, config["max_new"] + 1, batch), jnp.int32)
  prompts = jnp.asarray(rng.integers(0, VOCAB, (batch, config["max_prompt"])),
                        jnp.int32)
  params = init_params(jax.random.key(args.seed), layers=config["layers"],
                       dim=config["dim"], heads=config["heads"],
                       kv_heads=config["kv_heads"], max_len=max_len)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  head_dim = config["dim"] // config["heads"]
  max_pages = -(-max_len // page_size)
  # Pages for 3/4 of the worst case, plus the trash page: sequences that
  # finish return theirs.
  num_pages = max(max_pages, (3 * batch * max_pages) // 4) + 1
  paged = init_paged(layers=config["layers"], batch=batch,
                     num_pages=num_pages, page_size=page_size,
                     max_pages=max_pages, kv_heads=config["kv_heads"],
                     head_dim=head_dim, dtype=dtype)
  dense_shape = (config["layers"], batch, max_len, config["kv_heads"],
                 head_dim)
  dense = {"k": jnp.zeros(dense_shape, dtype),
           "v": jnp.zeros(dense_shape, dtype)}

  results = {}
  release_pages = jax.jit(functools.partial(release, page_size=page_size))
  for name, step, cache, on_finish in (
      ("paged jflash", functools.partial(paged_step, config=config), paged,
       release_pages),
      ("dense jflash", functools.partial(dense_step, config=config,
                                         use_jax_nn=False), dense, None),
      ("dense jax.nn", functools.partial(dense_step, config=config,
                                         use_jax_nn=True), dense, None)):
    logits, active, cache, rate = generate(
        jax.jit(step), cache, params, prompts, prompt_lens, total_lens,
        on_finish)
    results[name] = dict(logits=logits, cache=cache, tokens_per_s=rate)
    print(f"{name}: {rate:,.0f} generated tokens/s")

  # Rows of finished sequences are not compared: the paged cache has given
  # their pages to others.
  active = active[..., None]
  reference = jnp.where(active, results["dense jax.nn"]["logits"], 0.0)
  reference = reference.astype(jnp.float32)
  scale = float(jnp.max(jnp.abs(reference)))
  for name in ("paged jflash", "dense jflash"):
    ours = jnp.where(active, results[name]["logits"], 0.0)
    error = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - reference))
                  ) / scale
    results[name]["relative_error"] = error
    print(f"{name}: max |logits - jax.nn's| / max |logits| = {error:.2e}")
  final = results["paged jflash"]["cache"]
  print(f"pages free at the end: {int(final['num_free'])} of "
        f"{num_pages - 1}")
  results["pages"] = (int(final["num_free"]), num_pages - 1)
  return results


if __name__ == "__main__":
  main()
