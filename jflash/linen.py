"""jflash for Flax Linen.

    layer = jflash.linen.FlashMultiHeadDotProductAttention(num_heads=8)
    # or, in a stock module:
    layer = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=jflash.linen.attention_fn())
"""

from jflash._src.flax_adapter import make_attention_fn as attention_fn
from jflash._src.linen_attention import FlashMultiHeadDotProductAttention

__all__ = ["FlashMultiHeadDotProductAttention", "attention_fn"]
