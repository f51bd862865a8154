"""Paged-KV layout descriptors as data: how an engine's per-layer KV tensors look, and its L1 object spec.

Kinds (per-layer tensor shapes; H = kv heads, D = head size, BS = block size, NB = blocks):

- ``VLLM_FLASH``: vLLM's standardized view ``[NB, H, BS, 2*D]``; per token the last dim is ``K(D) | V(D)``.
  On the GPU (NHD physical layout) this is a strided view; any strides are accepted.
- ``VLLM_MLA``: ``[NB, 1, BS, C]``, one latent of size C per token (``head_dim = C``, ``num_kv_heads = 1``).
- ``VLLM_LEGACY``: the older flash-attn shape ``[2, NB, BS, H, D]`` (K plane, V plane).
- ``CPU_BLOCKS``: vLLM's CPU attention backend. Its tensor is also shaped ``[NB, H, BS, 2*D]``, but inside a
  (block, head) page K is stored transposed (``[D, BS]``) before V (``[BS, D]``), possibly ISA-dependent;
  so a block is an opaque page and is only ever copied whole. Objects of this kind hold the raw pages in
  order (layer-major, then block), padded up to whole blocks; their bytes are only meaningful to an engine
  with the same CPU layout, block size and model shape, which ``fingerprint`` encodes (own keyspace).
- ``VLLM_BLOCKS``: vLLM's block-outermost ``BLNHC`` allocation (``[NB, L, BS, H, 2*D]`` in memory, handed
  over as per-layer ``[NB, H, BS, 2*D]`` views): every layer's page of a block lies in one run of bytes.
  Moved as whole blocks of every layer (``tiercache.gpu.block_pages``: one copy per run of blocks, no
  kernel); its objects hold those runs in block order, padded up to whole blocks, and are only meaningful
  to an engine with the same allocation, block size and model shape (own keyspace, as ``CPU_BLOCKS``).

No torch import here: ``detect_layout`` only reads the tensors' shape, dtype, device, strides and addresses.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache import fp8_math
from tiercache.spec import KVFormat, KVSpec, dtype_name

if TYPE_CHECKING:
    import torch

    KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]  # per-layer KV, as vLLM registers it

__all__ = [
    "LayoutKind",
    "PagedLayout",
    "ReadPlan",
    "block_pages_problem",
    "check_spans",
    "detect_layout",
    "fp8_payload_nbytes",
    "layer_tensors",
    "object_spec",
    "plan_read",
    "skip_prefix_for",
    "span_skips",
]


class LayoutKind(enum.Enum):
    """Which engine layout a list of per-layer paged KV tensors follows (shapes in the module docstring)."""

    VLLM_FLASH = "vllm_flash"
    VLLM_MLA = "vllm_mla"
    VLLM_LEGACY = "vllm_legacy"
    CPU_BLOCKS = "cpu_blocks"
    VLLM_BLOCKS = "vllm_blocks"


@dataclass(frozen=True, slots=True)
class _KindInfo:
    """Static facts about one layout kind (the only place kinds differ as data)."""

    object_format: KVFormat
    ndim: int
    block_aligned: bool  # chunk/skip boundaries must be multiples of block_size (whole-page copies)


_KIND_INFO: dict[LayoutKind, _KindInfo] = {
    LayoutKind.VLLM_FLASH: _KindInfo(KVFormat.KV_2LTD, 4, block_aligned=False),
    LayoutKind.VLLM_MLA: _KindInfo(KVFormat.KV_MLA, 4, block_aligned=False),
    LayoutKind.VLLM_LEGACY: _KindInfo(KVFormat.KV_2LTD, 5, block_aligned=False),
    LayoutKind.CPU_BLOCKS: _KindInfo(KVFormat.KV_2LTD, 4, block_aligned=True),
    LayoutKind.VLLM_BLOCKS: _KindInfo(KVFormat.KV_2LTD, 4, block_aligned=True),
}


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """How one engine holds its paged KV: kind, model shape, block size, dtype name (no tensors)."""

    kind: LayoutKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayoutKind(self.kind))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError(f"num_layers, num_kv_heads, head_dim and block_size must be positive: {self}")
        if self.kind is LayoutKind.VLLM_MLA and self.num_kv_heads != 1:
            raise ValueError(f"VLLM_MLA has exactly one latent head, got num_kv_heads={self.num_kv_heads}")

    @property
    def object_format(self) -> KVFormat:
        """The L1 object format this layout gathers into (KV_MLA for MLA, else KV_2LTD)."""
        return _KIND_INFO[self.kind].object_format

    @property
    def block_aligned(self) -> bool:
        """True when spans and skips must be block-aligned because blocks are copied as opaque pages."""
        return _KIND_INFO[self.kind].block_aligned

    @property
    def planes(self) -> int:
        """Number of KV planes per token: 2 (K and V) or 1 (MLA latent)."""
        return 1 if self.object_format is KVFormat.KV_MLA else 2

    @property
    def page_elems(self) -> int:
        """Elements of one block of one layer (all heads, K and V)."""
        return self.planes * self.num_kv_heads * self.block_size * self.head_dim

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Expected shape of one layer's paged tensor holding ``num_blocks`` blocks."""
        h, bs, d = self.num_kv_heads, self.block_size, self.head_dim
        if self.kind is LayoutKind.VLLM_LEGACY:
            return (2, num_blocks, bs, h, d)
        if self.kind is LayoutKind.VLLM_MLA:
            return (num_blocks, 1, bs, d)
        return (num_blocks, h, bs, 2 * d)

    def num_blocks_of(self, layer: torch.Tensor) -> int:
        """Number of blocks in one layer tensor; ``ValueError`` if its shape does not fit this layout."""
        shape = tuple(layer.shape)
        nb = shape[1] if self.kind is LayoutKind.VLLM_LEGACY else (shape[0] if shape else 0)
        if shape != self.layer_shape(nb):
            raise ValueError(
                f"layer tensor shape {shape} does not match {self} (expected {self.layer_shape(nb)})"
            )
        if dtype_name(layer.dtype) != self.dtype:
            raise ValueError(f"layer tensor dtype {layer.dtype} does not match layout dtype {self.dtype}")
        return nb

    @property
    def fingerprint(self) -> str:
        """Compatibility string for the keyspace: equal fingerprints mean interchangeable L1 objects.

        K/V layouts (FLASH, LEGACY) share one fingerprint, since they gather into the same KV_2LTD objects;
        CPU_BLOCKS and VLLM_BLOCKS objects are page-ordered bytes, so kind and block size are part of theirs.
        """
        base = (
            f"{self.object_format.name}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}:{self.dtype}"
        )
        if self.block_aligned:
            return f"{self.kind.name}:BS{self.block_size}:{base}"
        return base

    def object_tokens(self, tokens: int) -> int:
        """Token capacity of an object for ``tokens`` tokens (CPU_BLOCKS rounds up to whole blocks)."""
        if self.block_aligned:
            return -(-tokens // self.block_size) * self.block_size
        return tokens


def object_spec(layout: PagedLayout, tokens: int) -> KVSpec:
    """The KVSpec of the L1 object holding ``tokens`` tokens of all layers gathered from ``layout``.

    For CPU_BLOCKS the spec is sized for whole blocks (``tokens`` rounded up to ``block_size``) and its
    content is raw pages, not KV_2LTD rows (see the module docstring).
    """
    return KVSpec(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        format=layout.object_format,
        tokens=layout.object_tokens(tokens),
    )


def fp8_payload_nbytes(layout: PagedLayout, tokens: int) -> int:
    """Bytes of one span's fused-fp8 payload: float32 channel scales then one e4m3 byte per element (of the
    object, whose token count is whole pages on CPU_BLOCKS: the ``tiercache.fp8_math`` payload of it)."""
    return fp8_math.payload_nbytes(object_spec(layout, tokens)) if tokens else 0


def layer_tensors(kv_caches: KVCaches) -> list[torch.Tensor]:
    """The per-layer tensors in layer order (a dict, as ``register_kv_caches`` gives, keeps its order)."""
    if isinstance(kv_caches, Mapping):
        return list(kv_caches.values())
    return list(kv_caches)


def detect_layout(
    kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    block_size: int,
    *,
    kind: LayoutKind | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    use_mla: bool | None = None,
) -> PagedLayout:
    """Pick the PagedLayout of ``kv_caches`` from their shapes; ``ValueError`` naming the shapes if ambiguous.

    A 4-D ``[NB, H, BS, C]`` tensor is VLLM_FLASH on CUDA or when strided, but a contiguous CPU one is
    ambiguous (VLLM_FLASH or the CPU attention backend's CPU_BLOCKS): pass ``kind`` there. ``[NB, 1, BS, C]``
    is MLA or single-head FLASH: pass ``use_mla`` or ``head_dim``/``num_kv_heads`` to decide. A ``kind``
    given explicitly is validated against the shapes.
    """
    layers = layer_tensors(kv_caches)
    if not layers:
        raise ValueError("no KV cache tensors to detect a layout from")
    shapes = [tuple(t.shape) for t in layers]
    first = layers[0]
    if len(set(shapes)) != 1:
        raise ValueError(f"layers have different shapes: {sorted(set(shapes))}")
    if len({str(t.dtype) for t in layers}) != 1 or len({str(t.device) for t in layers}) != 1:
        raise ValueError("layers differ in dtype or device")
    shape = shapes[0]
    dtype = dtype_name(first.dtype)
    candidates = _candidates(shape, block_size, num_kv_heads, head_dim, use_mla, _cpu_backend_possible(first))
    if kind is LayoutKind.VLLM_BLOCKS:
        candidates = [(kind, h, d) for k, h, d in candidates if k is LayoutKind.VLLM_FLASH]
        if len(candidates) == 1 and (problem := block_pages_problem(layers, *candidates[0][1:])):
            raise ValueError(f"KV cache tensors are not vLLM's BLNHC allocation: {problem}")
    if kind is not None:
        candidates = [c for c in candidates if c[0] is kind]
        if not candidates:
            raise ValueError(
                f"shape {shape} (block_size={block_size}, num_kv_heads={num_kv_heads}, head_dim={head_dim}) "
                f"does not fit layout {kind.name}"
            )
    if len(candidates) != 1:
        names = [c[0].name for c in candidates]
        raise ValueError(
            f"cannot tell the paged KV layout from shape {shape} on {first.device} "
            f"(block_size={block_size}): "
            + (f"it fits {names}; pass kind=, use_mla= or head_dim=" if names else "no known layout fits")
        )
    k, h, d = candidates[0]
    return PagedLayout(k, len(layers), h, d, block_size, dtype)


def block_pages_problem(layers: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int) -> str | None:
    """Why per-layer ``[NB, H, BS, 2*D]`` views are not one ``BLNHC`` allocation, or None when they are: each
    layer's page of a block dense in ``[BS, H, 2*D]`` order, the layers' pages of a block back to back (layer
    ``l`` ``l`` pages after layer 0), the blocks at least every layer's pages apart."""
    first = layers[0]
    nb, h, bs, c = first.shape
    if (h, c) != (num_kv_heads, 2 * head_dim):
        return f"shape {tuple(first.shape)} is not [NB, {num_kv_heads}, BS, {2 * head_dim}]"
    shapes = {(tuple(t.shape), t.dtype) for t in layers}
    if len(shapes) != 1:
        return f"the layers' shapes or dtypes differ: {sorted(map(str, shapes))}"
    strides = {tuple(t.stride()) for t in layers}
    if len(strides) != 1:
        return f"the layers' strides differ: {sorted(strides)}"
    s_blk, s_head, s_tok, s_c = strides.pop()
    if (s_c != 1 and c > 1) or (s_head != c and h > 1) or (s_tok != h * c and bs > 1):
        return f"a page is not dense in [BS, H, 2*D] order (strides {first.stride()})"
    page = h * bs * c * first.element_size()
    bases = [t.data_ptr() for t in layers]
    if any(b - bases[0] != i * page for i, b in enumerate(bases)):
        return f"the layers' pages of a block are not back to back ({page} bytes apart)"
    if nb > 1 and s_blk * first.element_size() < len(layers) * page:
        return f"blocks {s_blk * first.element_size()} bytes apart, less than every layer's pages"
    return None


def _cpu_backend_possible(layer: torch.Tensor) -> bool:
    """The CPU attention backend holds contiguous CPU tensors; CUDA or strided ones cannot be CPU_BLOCKS."""
    return layer.device.type == "cpu" and layer.is_contiguous()


def _candidates(
    shape: tuple[int, ...],
    block_size: int,
    num_kv_heads: int | None,
    head_dim: int | None,
    use_mla: bool | None,
    cpu_backend_possible: bool,
) -> list[tuple[LayoutKind, int, int]]:
    """Every (kind, num_kv_heads, head_dim) consistent with one layer's shape and the hints given."""
    out: list[tuple[LayoutKind, int, int]] = []

    def ok(h: int, d: int) -> bool:
        return (num_kv_heads is None or num_kv_heads == h) and (head_dim is None or head_dim == d)

    legacy = len(shape) == 5 and shape[0] == 2 and shape[2] == block_size and use_mla is not True
    if legacy and ok(shape[3], shape[4]):
        out.append((LayoutKind.VLLM_LEGACY, shape[3], shape[4]))
    if len(shape) == 4 and shape[2] == block_size:
        _, h, _, c = shape
        if use_mla is not False and h == 1 and ok(1, c):
            out.append((LayoutKind.VLLM_MLA, 1, c))
        if use_mla is not True and c % 2 == 0 and ok(h, c // 2):
            out.append((LayoutKind.VLLM_FLASH, h, c // 2))
            if cpu_backend_possible:
                out.append((LayoutKind.CPU_BLOCKS, h, c // 2))
    return out


def check_spans(spans: Sequence[tuple[int, int]], n_slots: int, count: int) -> list[tuple[int, int]]:
    """The spans as int pairs, checked against the slot mapping length and the number of objects."""
    if len(spans) != count:
        raise ValueError(f"{len(spans)} spans for {count} objects")
    out = [(int(s), int(e)) for s, e in spans]
    for s, e in out:
        if not 0 <= s <= e <= n_slots:
            raise ValueError(f"span ({s}, {e}) outside the slot mapping of {n_slots} tokens")
    return out


def span_skips(skip_prefix: int | Sequence[int], spans: list[tuple[int, int]]) -> list[int]:
    """Per-span skip counts (an int applies to the first span only), each within its span."""
    if isinstance(skip_prefix, int):
        skips = [skip_prefix if i == 0 else 0 for i in range(len(spans))]
    else:
        skips = [int(k) for k in skip_prefix]
        if len(skips) != len(spans):
            raise ValueError(f"{len(skips)} skip counts for {len(spans)} spans")
    for k, (s, e) in zip(skips, spans, strict=True):
        if not 0 <= k <= e - s:
            raise ValueError(f"skip_prefix {k} outside span ({s}, {e})")
    return skips


def skip_prefix_for(num_local_tokens: int, chunk_start: int) -> int:
    """Tokens at the head of the chunk starting at ``chunk_start`` already held by the engine (>= 0)."""
    return max(0, num_local_tokens - chunk_start)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What to read for a prefix hit: the chunks overlapping [num_local_tokens, hit_tokens) and the skip.

    ``spans`` are chunk spans (starts are multiples of ``chunk_size``, the last may end at an unaligned
    ``hit_tokens``); ``skip_prefix`` tokens of ``spans[0]`` are already on the GPU and are not written;
    ``tokens_to_write`` = ``max(0, hit_tokens - num_local_tokens)``. Build it with ``plan_read``.
    """

    num_local_tokens: int
    hit_tokens: int
    chunk_size: int
    spans: tuple[tuple[int, int], ...]
    skip_prefix: int
    tokens_to_write: int

    @property
    def skips(self) -> tuple[int, ...]:
        """Per-span skip list for ``scatter``: ``skip_prefix`` for the first span, 0 for the others."""
        return tuple(self.skip_prefix if i == 0 else 0 for i in range(len(self.spans)))

    @property
    def chunk_indices(self) -> range:
        """Indices of the chunks to read (chunk i covers tokens [i*chunk_size, (i+1)*chunk_size))."""
        if not self.spans:
            return range(0)
        first = self.spans[0][0] // self.chunk_size
        return range(first, first + len(self.spans))


def plan_read(
    num_local_tokens: int, hit_tokens: int, chunk_size: int, *, block_size: int | None = None
) -> ReadPlan:
    """Plan the retrieval of the external hit ``[num_local_tokens, hit_tokens)`` in whole chunks.

    ``block_size`` (for block-aligned layouts such as CPU_BLOCKS) makes a skip that is not a multiple of it a
    ``ValueError``. Example: 288 local, hit 512, chunk 256 -> read chunk 1 (256-511), skip 32, write 224.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if num_local_tokens < 0 or hit_tokens < 0:
        raise ValueError(f"token counts must be >= 0: local={num_local_tokens} hit={hit_tokens}")
    if num_local_tokens >= hit_tokens:
        return ReadPlan(num_local_tokens, hit_tokens, chunk_size, (), 0, 0)
    first = num_local_tokens // chunk_size
    last = (hit_tokens - 1) // chunk_size
    spans = tuple((c * chunk_size, min((c + 1) * chunk_size, hit_tokens)) for c in range(first, last + 1))
    skip = skip_prefix_for(num_local_tokens, spans[0][0])
    if block_size is not None and skip % block_size:
        raise ValueError(
            f"skip {skip} (local {num_local_tokens}) is not a multiple of block_size {block_size}"
        )
    return ReadPlan(num_local_tokens, hit_tokens, chunk_size, spans, skip, hit_tokens - num_local_tokens)
