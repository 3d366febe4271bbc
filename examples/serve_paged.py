"""Example 5: a serving loop with chunked prefill and decode on one paged
KV cache.

Requests with different prompt lengths arrive over time. A fixed number of
slots serve them: each engine step admits the requests that have arrived
into free slots, runs one chunk of prefill (up to --chunk prompt tokens per
prefilling slot, `flash_attention` on the paged cache with per-sequence
query and cache lengths: paged prefill), then one decode step for the slots
that are generating (one new token each: the split-K decode kernel). Pages
come from a host-side allocator: a request takes pages as its sequence
grows and returns them when it finishes, so a finished request's memory
serves the next ones.

The model is a small decoder-only transformer with random weights (this
example is about serving mechanics and speed, not text); greedy sampling.
The same request stream runs again on a dense cache [slots, max_len] with
the same engine, and every generated token's logits are compared.

Prints generated tokens/s, time to first token (from a request's arrival)
and time per output token, per cache.

Run:
  python examples/serve_paged.py          # GPU sizes; small on CPU
  python examples/serve_paged.py --tiny   # seconds on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jflash

GPU_SETTINGS = dict(slots=16, layers=4, dim=1024, heads=16, kv_heads=4,
                    page_size=64, chunk=512, requests=48, max_prompt=2048,
                    max_new=128, arrivals_per_step=0.5)
CPU_SETTINGS = dict(slots=4, layers=2, dim=128, heads=4, kv_heads=2,
                    page_size=16, chunk=32, requests=8, max_prompt=96,
                    max_new=16, arrivals_per_step=0.5)
TINY_SETTINGS = dict(slots=3, layers=1, dim=64, heads=4, kv_heads=2,
                     page_size=16, chunk=16, requests=5, max_prompt=40,
                     max_new=6, arrivals_per_step=1.0)
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


def forward(params, cache, tokens, starts, counts, *, heads, kv_heads,
            write, attend):
  """Logits [B, T, VOCAB] of T new tokens per slot; slot b's tokens sit at
  positions starts[b] .. starts[b] + counts[b] - 1 (counts[b] <= T; the
  rest is padding, its logits garbage).

  `write(cache, layer, k, v)` stores the new keys/values [B, T, K, hd];
  `attend(cache, layer, q)` attends q [B, T, N, hd] to the cache.
  """
  batch, num_tokens = tokens.shape
  positions = starts[:, None] + jnp.arange(num_tokens)[None, :]
  max_len = params["positions"].shape[0]
  x = (params["embed"][tokens]
       + params["positions"][jnp.minimum(positions, max_len - 1)])
  for layer, p in enumerate(params["layers"]):
    h = rms_norm(x)
    q = (h @ p["wq"]).reshape(batch, num_tokens, heads, -1)
    k = (h @ p["wk"]).reshape(batch, num_tokens, kv_heads, -1)
    v = (h @ p["wv"]).reshape(batch, num_tokens, kv_heads, -1)
    cache = write(cache, layer, k, v)
    x = x + attend(cache, layer, q).reshape(batch, num_tokens, -1) @ p["wo"]
    x = x + jax.nn.gelu(rms_norm(x) @ p["w1"]) @ p["w2"]
  return rms_norm(x) @ params["embed"].T, cache


def paged_engine_step(params, cache, tokens, starts, counts, table, *,
                      config):
  """One call on the paged cache: cache["k"], cache["v"] [layers,
  num_pages, page_size, K, hd]; `table` [B, max_pages] (host-allocated;
  entries past a slot's pages name the trash page, the last one)."""
  page_size = config["page_size"]
  trash = cache["k"].shape[1] - 1
  positions = starts[:, None] + jnp.arange(tokens.shape[1])[None, :]
  valid = jnp.arange(tokens.shape[1])[None, :] < counts[:, None]
  slot = jnp.minimum(positions // page_size, table.shape[1] - 1)
  page = jnp.where(valid, jnp.take_along_axis(table, slot, axis=1), trash)
  offset = positions % page_size

  def write(cache, layer, k, v):
    return {name: cache[name].at[layer, page, offset].set(
        x.astype(cache[name].dtype)) for name, x in (("k", k), ("v", v))}

  def attend(cache, layer, q):
    return jflash.flash_attention(
        q, cache["k"][layer], cache["v"][layer], block_table=table,
        query_seq_lengths=counts, key_value_seq_lengths=starts + counts,
        is_causal=True, causal_alignment="bottom_right",
        interpret=config["interpret"])

  return forward(params, cache, tokens, starts, counts, heads=config["heads"],
                 kv_heads=config["kv_heads"], write=write, attend=attend)


def dense_engine_step(params, cache, tokens, starts, counts, table, *,
                      config):
  """The same call on a dense cache [layers, B, max_len, K, hd]."""
  del table
  batch, num_tokens = tokens.shape
  max_len = cache["k"].shape[2]
  positions = starts[:, None] + jnp.arange(num_tokens)[None, :]
  valid = jnp.arange(num_tokens)[None, :] < counts[:, None]
  # Padding tokens write past the end (dropped).
  positions = jnp.where(valid, positions, max_len)
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], positions.shape)

  def write(cache, layer, k, v):
    return {name: cache[name].at[layer, rows, positions].set(
        x.astype(cache[name].dtype), mode="drop")
            for name, x in (("k", k), ("v", v))}

  def attend(cache, layer, q):
    return jflash.flash_attention(
        q, cache["k"][layer], cache["v"][layer], query_seq_lengths=counts,
        key_value_seq_lengths=starts + counts, is_causal=True,
        causal_alignment="bottom_right", interpret=config["interpret"])

  return forward(params, cache, tokens, starts, counts, heads=config["heads"],
                 kv_heads=config["kv_heads"], write=write, attend=attend)


@dataclasses.dataclass
class Request:
  """One request and what serving it recorded."""

  arrival_step: int
  prompt: np.ndarray  # int32 [prompt_len]
  max_new: int
  slot: int | None = None
  prefilled: int = 0  # Prompt tokens whose keys/values are in the cache.
  generated: list[int] = dataclasses.field(default_factory=list)
  logits: list[np.ndarray] = dataclasses.field(default_factory=list)
  pages: list[int] = dataclasses.field(default_factory=list)
  arrival_time: float | None = None
  token_times: list[float] = dataclasses.field(default_factory=list)

  @property
  def length(self) -> int:
    """Tokens in the cache once the last generated one is written."""
    return self.prefilled + max(len(self.generated) - 1, 0)

  @property
  def done(self) -> bool:
    return len(self.generated) == self.max_new


class PageAllocator:
  """A free list of page ids (host side, as a serving engine's block
  manager); the last page of the pool is the trash page, never handed out."""

  def __init__(self, num_pages: int):
    self.free = list(range(num_pages - 1))[::-1]
    self.trash = num_pages - 1

  def ensure(self, request: Request, length: int, page_size: int) -> None:
    """Gives `request` pages for `length` cache entries."""
    while len(request.pages) * page_size < length:
      if not self.free:
        raise RuntimeError("out of pages: raise the pool size")
      request.pages.append(self.free.pop())

  def release(self, request: Request) -> None:
    self.free.extend(reversed(request.pages))
    request.pages = []


def serve(requests: list[Request], step_fns, cache, params, *, config,
          paged: bool):
  """Runs the request stream to completion; fills in each request's tokens,
  logits and timings. Returns (engine steps, seconds from the first step
  to the last token, free pages at the end or None for a dense cache,
  {phase: seconds of each of its calls, results on the host})."""
  slots: list[Request | None] = [None] * config["slots"]
  page_size, chunk = config["page_size"], config["chunk"]
  max_pages = config["max_pages"]
  allocator = PageAllocator(config["num_pages"]) if paged else None
  waiting = sorted(requests, key=lambda r: r.arrival_step)
  phase_seconds = {"prefill": [], "decode": []}
  step, start = 0, time.perf_counter()
  while waiting or any(s is not None for s in slots):
    now = time.perf_counter()
    while waiting and waiting[0].arrival_step <= step and None in slots:
      request = waiting.pop(0)
      request.slot = slots.index(None)
      slots[request.slot] = request
    for request in requests:
      if request.arrival_step == step and request.arrival_time is None:
        request.arrival_time = now
    for phase, num_tokens in (("prefill", chunk), ("decode", 1)):
      tokens = np.zeros((len(slots), num_tokens), np.int32)
      starts = np.zeros(len(slots), np.int32)
      counts = np.zeros(len(slots), np.int32)
      table = np.full((len(slots), max_pages),
                      allocator.trash if paged else 0, np.int32)
      members = []
      for b, request in enumerate(slots):
        if request is None:
          continue
        prefilling = request.prefilled < len(request.prompt)
        if prefilling != (phase == "prefill"):
          continue
        if prefilling:
          new = request.prompt[request.prefilled:request.prefilled + chunk]
          starts[b] = request.prefilled
        else:
          new = np.array(request.generated[-1:], np.int32)
          starts[b] = request.length
        tokens[b, :len(new)] = new
        counts[b] = len(new)
        if paged:
          allocator.ensure(request, starts[b] + counts[b], page_size)
          table[b, :len(request.pages)] = request.pages
        members.append((b, request, prefilling))
      if not members:
        continue
      call_start = time.perf_counter()
      logits, cache = step_fns[phase](
          params, cache, jnp.asarray(tokens), jnp.asarray(starts),
          jnp.asarray(counts), jnp.asarray(table))
      # The last valid row of each member: its next token's logits.
      last = np.asarray(logits[np.arange(len(slots)), np.maximum(counts - 1,
                                                                 0)],
                        np.float32)
      now = time.perf_counter()
      phase_seconds[phase].append(now - call_start)
      for b, request, prefilling in members:
        if prefilling:
          request.prefilled += int(counts[b])
          if request.prefilled < len(request.prompt):
            continue  # More chunks to go: no token yet.
        request.logits.append(last[b])
        request.generated.append(int(np.argmax(last[b])))
        request.token_times.append(now)
        if request.done:
          slots[b] = None
          if paged:
            allocator.release(request)
    step += 1
  return (step, time.perf_counter() - start,
          len(allocator.free) if paged else None, phase_seconds)


def make_requests(rng, config) -> list[Request]:
  """Prompts of random lengths arriving at random engine steps."""
  arrivals = np.cumsum(rng.exponential(1.0 / config["arrivals_per_step"],
                                       config["requests"])).astype(int)
  return [Request(arrival_step=int(a),
                  prompt=rng.integers(0, VOCAB, rng.integers(
                      1, config["max_prompt"] + 1)).astype(np.int32),
                  max_new=int(rng.integers(1, config["max_new"] + 1)))
          for a in arrivals]


def summary(requests: list[Request], seconds: float) -> dict[str, float]:
  generated = sum(len(r.generated) for r in requests)
  ttft = [r.token_times[0] - r.arrival_time for r in requests]
  per_token = [(r.token_times[-1] - r.token_times[0]) / (len(r.generated)
                                                         - 1)
               for r in requests if len(r.generated) > 1]
  return dict(tokens_per_s=generated / seconds,
              ttft_ms=1e3 * statistics.median(ttft),
              tpot_ms=1e3 * statistics.median(per_token) if per_token
              else float("nan"))


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
  parser.add_argument("--chunk", type=int, default=None,
                      help="prompt tokens per slot per prefill step "
                      "(default: by size)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the weights, prompts and arrivals")
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = build_parser().parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  config = dict(TINY_SETTINGS if args.tiny
                else GPU_SETTINGS if on_gpu else CPU_SETTINGS,
                interpret=args.interpret)
  if args.chunk is not None:
    config["chunk"] = args.chunk
  if not on_gpu and not args.tiny:
    print("No GPU: small sizes (jflash runs its XLA path on CPU).")
  max_len = config["max_prompt"] + config["max_new"]
  page_size = config["page_size"]
  config["max_pages"] = -(-max_len // page_size)
  # Pages for every slot's worst case, plus the trash page.
  config["num_pages"] = config["slots"] * config["max_pages"] + 1
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  rng = np.random.default_rng(args.seed)
  params = init_params(jax.random.key(args.seed), layers=config["layers"],
                       dim=config["dim"], heads=config["heads"],
                       kv_heads=config["kv_heads"], max_len=max_len)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  head_dim = config["dim"] // config["heads"]
  kv = (config["kv_heads"], head_dim)
  caches = {
      "paged": {name: jnp.zeros((config["layers"], config["num_pages"],
                                 page_size, *kv), dtype) for name in "kv"},
      "dense": {name: jnp.zeros((config["layers"], config["slots"],
                                 max_len, *kv), dtype) for name in "kv"}}
  template = make_requests(rng, config)
  print(f"{len(template)} requests, prompts of "
        f"{min(len(r.prompt) for r in template)}-"
        f"{max(len(r.prompt) for r in template)} tokens, {config['slots']} "
        f"slots, chunks of {config['chunk']}, pages of {page_size}")
  results = {}
  for name, step in (("paged", paged_engine_step),
                     ("dense", dense_engine_step)):
    # The cache is donated: each step updates it in place, as an engine
    # must (a functional update would copy every layer's cache per step).
    step_fns = {phase: jax.jit(functools.partial(step, config=config),
                               donate_argnums=1)
                for phase in ("prefill", "decode")}
    # A warm-up pass compiles both phases; the timed pass starts afresh.
    for _ in ("warm-up", "timed"):
      requests = [dataclasses.replace(r, generated=[], logits=[], pages=[],
                                      token_times=[]) for r in template]
      steps, seconds, free_pages, phase_seconds = serve(
          requests, step_fns, jax.tree.map(jnp.zeros_like, caches[name]),
          params, config=config, paged=name == "paged")
    stats = summary(requests, seconds)
    for phase, times in phase_seconds.items():
      stats[f"{phase}_call_ms"] = 1e3 * statistics.median(times)
    results[name] = dict(requests=requests, steps=steps,
                         free_pages=free_pages, **stats)
    print(f"{name} cache: {stats['tokens_per_s']:,.1f} generated tokens/s, "
          f"time to first token {stats['ttft_ms']:.1f} ms, time per output "
          f"token {stats['tpot_ms']:.1f} ms (medians; {steps} engine "
          f"steps; a prefill call {stats['prefill_call_ms']:.1f} ms, a "
          f"decode call {stats['decode_call_ms']:.1f} ms)")
  # Every generated token's logits, paged against dense.
  paged_logits = np.concatenate([np.stack(r.logits)
                                 for r in results["paged"]["requests"]])
  dense_logits = np.concatenate([np.stack(r.logits)
                                 for r in results["dense"]["requests"]])
  error = float(np.max(np.abs(paged_logits - dense_logits))
                / np.max(np.abs(dense_logits)))
  same_tokens = all(
      p.generated == d.generated for p, d in zip(
          results["paged"]["requests"], results["dense"]["requests"]))
  results["relative_error"] = error
  results["same_tokens"] = same_tokens
  results["pages"] = (results["paged"]["free_pages"],
                      config["num_pages"] - 1)
  print(f"paged vs dense cache: max |logits difference| / max |logits| = "
        f"{error:.2e}; same tokens: {same_tokens}; pages free at the end: "
        f"{results['pages'][0]} of {results['pages'][1]}")
  return results


if __name__ == "__main__":
  main()
