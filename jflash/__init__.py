"""jflash: FlashAttention for JAX, as Pallas GPU kernels.

    import jflash
    out = jflash.flash_attention(q, k, v, is_causal=True)
"""

from jflash._src import deprecation as _deprecation
from jflash._src.api import flash_attention
from jflash._src.decode import decode_attention
from jflash._src.api import implementations
from jflash._src.fp8 import dequantize_fp8
from jflash._src.fp8 import hadamard
from jflash._src.fp8 import quantize_fp8
from jflash._src.fp8 import quantize_qkv
from jflash._src.backends.mosaic.config import MosaicBlockSizes
from jflash._src.backends.triton.block_sizes import BlockSizes
from jflash._src.backends.triton.block_sizes import default_block_sizes
from jflash._src.ring import load_balance
from jflash._src.ring import load_unbalance
from jflash._src.ring import ring_attention
from jflash._src.ring import ring_attention_local
from jflash._src.ring import ring_compiler_options
from jflash._src.autotune import autotune

_deprecation.silence_triton_deprecation()

__version__ = "0.1.0"
__all__ = [
    "BlockSizes", "MosaicBlockSizes", "autotune", "decode_attention",
    "default_block_sizes", "dequantize_fp8", "flash_attention", "hadamard",
    "implementations", "load_balance", "load_unbalance", "quantize_fp8",
    "quantize_qkv", "ring_attention", "ring_attention_local",
    "ring_compiler_options"]
