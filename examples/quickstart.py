"""jflash in one page: the function, its gradient, under jit.

Run: python examples/quickstart.py   (CPU or GPU; on CPU it runs the same
Pallas kernels through the interpreter, so keep the sizes small there).
"""

import jax
import jax.numpy as jnp

import jflash


def main():
  on_gpu = jax.default_backend() == "gpu"
  # [batch, seq_len, num_heads, head_dim]; GQA: 8 query heads, 2 kv heads.
  batch, seq_len, heads, kv_heads, head_dim = (4, 4096, 8, 2, 128) if on_gpu \
      else (2, 128, 8, 2, 64)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (batch, seq_len, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim), dtype)
  # Off a GPU, interpret=True runs the real kernels through Pallas's
  # interpreter; on a GPU the kernels are compiled by Triton.
  options = dict(is_causal=True, interpret=not on_gpu)

  attention = jax.jit(lambda q, k, v: jflash.flash_attention(q, k, v,
                                                             **options))
  out = attention(q, k, v)
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  print(f"device: {jax.devices()[0].device_kind}, q {q.shape} {q.dtype}, "
        f"k/v {k.shape}")
  print(f"output {out.shape}, max |jflash - jax.nn| = "
        f"{float(jnp.max(jnp.abs(out - expected))):.2e}")

  def loss(q, k, v):
    return jnp.mean(jflash.flash_attention(q, k, v, **options)
                    .astype(jnp.float32) ** 2)

  def expected_loss(q, k, v):
    return jnp.mean(jax.nn.dot_product_attention(q, k, v, is_causal=True)
                    .astype(jnp.float32) ** 2)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  expected_grads = jax.grad(expected_loss, argnums=(0, 1, 2))(q, k, v)
  for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads):
    error = float(jnp.max(jnp.abs(g.astype(jnp.float32) -
                                  e.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(e.astype(jnp.float32))))
    print(f"{name} {g.shape}: max |jflash - jax.nn| = {error:.2e} "
          f"(max |grad| = {scale:.2e})")


if __name__ == "__main__":
  main()
