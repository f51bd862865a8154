"""KV layouts as data: KVFormat, dtype names and KVSpec (shape and size of one KV object). No torch import."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

__all__ = ["DTYPE_CODES", "DTYPE_SIZES", "KVFormat", "KVSpec", "dtype_name"]


class KVFormat(enum.IntEnum):
    """Logical layout of a KV object in L1 and in frames.

    KV_2LTD: [2, L, T, H*D] (K and V planes, layers, tokens, heads x head_dim).
    KV_MLA:  [L, T, D] (one latent per token, identical on every rank).
    """

    KV_2LTD = 1
    KV_MLA = 2


# dtype name -> element size in bytes. Names follow torch's (without the "torch." prefix).
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
# Stable one-byte codes used in the frame header. Never renumber; only append.
DTYPE_CODES: dict[str, int] = {
    "bfloat16": 1,
    "float16": 2,
    "float32": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "uint8": 6,
    "int8": 7,
}


def dtype_name(dtype: object) -> str:
    """Normalise a torch/numpy dtype or a string ("torch.bfloat16", "bf16") to a DTYPE_SIZES name."""
    name = str(dtype).removeprefix("torch.")
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
        "fp8": "float8_e4m3fn",
        "fp8_e4m3": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2",
    }
    name = aliases.get(name, name)
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    return name


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape, dtype and format of one KV object holding ``tokens`` tokens of layers [layer_start, layer_end).

    ``num_layers`` is the model's layer count; a layerwise object covers a sub-range of it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    format: KVFormat = KVFormat.KV_2LTD
    tokens: int = 0
    layer_start: int = 0
    layer_end: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "format", KVFormat(self.format))
        if self.layer_end is None:
            object.__setattr__(self, "layer_end", self.num_layers)
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"num_layers, num_kv_heads and head_dim must be positive: {self}")
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0: {self.tokens}")
        if self.format is KVFormat.KV_MLA and self.num_kv_heads != 1:
            raise ValueError("KV_MLA has exactly one (latent) head")
        end = self.layer_end
        assert end is not None
        if not 0 <= self.layer_start < end <= self.num_layers:
            raise ValueError(f"bad layer range [{self.layer_start}, {end}) for {self.num_layers} layers")

    @property
    def layers(self) -> int:
        """Number of layers this object holds."""
        end = self.layer_end
        assert end is not None
        return end - self.layer_start

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the object for ``tokens`` tokens."""
        if self.format is KVFormat.KV_MLA:
            return (self.layers, self.tokens, self.head_dim)
        return (2, self.layers, self.tokens, self.num_kv_heads * self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers this object holds (K and V)."""
        planes = 1 if self.format is KVFormat.KV_MLA else 2
        return planes * self.layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def nbytes(self) -> int:
        """Size of the whole object in bytes."""
        return self.bytes_per_token * self.tokens

    def with_tokens(self, tokens: int) -> KVSpec:
        """The same layout holding ``tokens`` tokens."""
        return replace(self, tokens=tokens)

    def with_layers(self, start: int, end: int) -> KVSpec:
        """The same layout restricted to layers [start, end) (layerwise objects)."""
        return replace(self, layer_start=start, layer_end=end)

    def with_dtype(self, dtype: str) -> KVSpec:
        """The same layout with another element type."""
        return replace(self, dtype=dtype)
