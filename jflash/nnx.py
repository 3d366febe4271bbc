"""jflash for Flax NNX.

    layer = jflash.nnx.FlashMultiHeadAttention(num_heads=8, in_features=512,
                                               rngs=nnx.Rngs(0))
    # or, in a stock module:
    layer = nnx.MultiHeadAttention(..., attention_fn=jflash.nnx.attention_fn())
"""

from jflash._src.flax_adapter import make_attention_fn as attention_fn
from jflash._src.nnx_attention import FlashMultiHeadAttention

__all__ = ["FlashMultiHeadAttention", "attention_fn"]
