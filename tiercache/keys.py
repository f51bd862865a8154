"""Content addressing: KeySpace, ChunkKey, the chained prefix hash (TokenDatabase) and contiguous_prefix.

Keys are identical across processes, hosts and restarts: SHA-256 over fixed-width little-endian token ids,
never Python's ``hash()``.
"""

from __future__ import annotations

import array
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from tiercache.spec import KVFormat, KVSpec, dtype_name

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "KEY_FORMAT_VERSION",
    "ChunkKey",
    "ChunkSpan",
    "KeySpace",
    "TokenDatabase",
    "contiguous_prefix",
]

KEY_FORMAT_VERSION = 1
_DIGEST_BYTES = 16  # keyspace digest length in bytes (32 hex chars)
_HASH_BYTES = 32  # SHA-256
_TOKEN_BYTES = 4  # token ids as little-endian uint32
_KEY_RE = re.compile(r"^tc(\d+)\.([0-9a-f]{32})\.([0-9a-f]{64})(?:\.l(\d{1,5}))?$")


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Everything that makes two KV objects interchangeable; its digest is part of every key.

    ``rank`` is the tensor-parallel rank, or ``"shared"`` when every rank holds the same KV (MLA).
    ``cache_salt`` isolates tenants: different salts never share a key.
    """

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: KVFormat = KVFormat.KV_2LTD
    revision: str = ""
    world_size: int = 1
    rank: int | Literal["shared"] = 0
    cache_salt: str = ""
    key_format_version: int = KEY_FORMAT_VERSION
    layout_tag: str = ""
    """Extra layout identity for objects only one engine layout can read (e.g. vLLM CPU-backend pages);
    hashed only when set, so it never changes the keys of interchangeable layouts."""
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", dtype_name(self.kv_dtype))
        object.__setattr__(self, "kv_format", KVFormat(self.kv_format))
        if not self.model:
            raise ValueError("KeySpace.model must not be empty")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        rank: object = self.rank  # checked at run time: callers may pass anything
        if rank != "shared" and not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank must be in [0, {self.world_size}) or 'shared', got {self.rank!r}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError("num_layers, num_kv_heads and head_dim must be positive")
        fields = asdict(self)
        fields.pop("_digest")
        if not self.layout_tag:
            fields.pop("layout_tag")
        fields["kv_format"] = self.kv_format.name
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        object.__setattr__(self, "_digest", hashlib.sha256(canonical.encode()).digest()[:_DIGEST_BYTES])

    @classmethod
    def for_spec(cls, model: str, spec: KVSpec, **kwargs: object) -> KeySpace:
        """A keyspace for objects laid out as ``spec`` (layers, heads, head_dim, dtype, format)."""
        return cls(
            model=model,
            kv_dtype=spec.dtype,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            kv_format=spec.format,
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def digest(self) -> bytes:
        """16-byte digest of every field; equal digests mean interchangeable KV."""
        return self._digest

    @property
    def digest_hex(self) -> str:
        """The digest as 32 lowercase hex characters."""
        return self._digest.hex()

    @property
    def layout_fingerprint(self) -> str:
        """Human-readable layout summary, e.g. ``KV_2LTD:L32:H8:D128:bfloat16``."""
        return (
            f"{self.kv_format.name}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}:{self.kv_dtype}"
        )


class ChunkKey(NamedTuple):
    """Address of one chunk object: keyspace digest + chained chunk hash (+ layer index in layerwise mode).

    The canonical string ``tc1.<32 hex>.<64 hex>[.l<layer>]`` uses only lowercase ``[0-9a-z.]``, so it is
    a safe file name, Redis key and S3 key whatever the model name; ``ChunkKey.parse(str(k)) == k``.
    """

    keyspace_digest: bytes
    chunk_hash: bytes
    layer: int | None = None
    version: int = KEY_FORMAT_VERSION

    def __str__(self) -> str:
        base = f"tc{self.version}.{self.keyspace_digest.hex()}.{self.chunk_hash.hex()}"
        return base if self.layer is None else f"{base}.l{self.layer}"

    @classmethod
    def parse(cls, text: str) -> ChunkKey:
        """Parse a canonical key string; ``ValueError`` if it is not one."""
        match = _KEY_RE.match(text)
        if match is None:
            raise ValueError(f"not a tiercache chunk key: {text!r}")
        version, digest, chunk_hash, layer = match.groups()
        return cls(
            keyspace_digest=bytes.fromhex(digest),
            chunk_hash=bytes.fromhex(chunk_hash),
            layer=None if layer is None else int(layer),
            version=int(version),
        )

    def with_layer(self, layer: int | None) -> ChunkKey:
        """The same chunk, addressed per layer (layerwise objects)."""
        return ChunkKey(self.keyspace_digest, self.chunk_hash, layer, self.version)


class ChunkSpan(NamedTuple):
    """Tokens [start, end) of a prompt and the key of the chunk object holding them."""

    start: int
    end: int
    key: ChunkKey


def contiguous_prefix(hits: Iterable[object]) -> int:
    """Number of leading hits: a prefix stops at the first miss (None, False or 0).

    Every lookup path (one tier, several tiers, layerwise with all layers present) goes through here.
    """
    count = 0
    for hit in hits:
        if hit is None or hit is False or (isinstance(hit, int) and hit == 0):
            break
        count += 1
    return count


def _token_array(tokens: object) -> npt.NDArray[np.integer[Any]]:
    """Token ids as a 1-D integer array (no copy when possible); ValueError for ids outside [0, 2**32)."""
    import numpy as np

    if hasattr(tokens, "detach"):  # torch tensor: no torch import needed
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, list | tuple):
        # array('q') converts a list of ints about 4x faster than np.asarray (vLLM hands over lists).
        try:
            tokens = np.frombuffer(array.array("q", tokens), dtype=np.int64)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        except TypeError:
            raise ValueError("token ids must be integers") from None
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr


def _mask_prefix(mask: object, num_tokens: int, chunk_size: int) -> int:
    """Validate a FFF...TTT mask and return its count of leading Falses (a multiple of chunk_size)."""
    import numpy as np

    if hasattr(mask, "detach"):
        mask = mask.detach().cpu().numpy()
    arr = np.asarray(mask, dtype=bool)
    if arr.shape != (num_tokens,):
        raise ValueError(f"mask has shape {arr.shape}, expected ({num_tokens},) to match the tokens")
    num_false = int(num_tokens - np.count_nonzero(arr))
    if (num_false and arr[:num_false].any()) or not arr[num_false:].all():
        raise ValueError("mask must be False...False True...True (no True before a False)")
    if num_false % chunk_size:
        raise ValueError(f"mask's False count {num_false} is not a multiple of the chunk size {chunk_size}")
    return num_false


class TokenDatabase:
    """Cuts token sequences into chunks and gives each its chained prefix key.

    ``h_i = SHA256(h_{i-1} || keyspace digest || tokens of chunk i as uint32 LE)`` with ``h_{-1}`` = 32 zero
    bytes. A short tail chunk gets a key only when ``save_unfull_chunk`` is true.
    """

    def __init__(self, keyspace: KeySpace, chunk_size: int = 256, save_unfull_chunk: bool = True) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.keyspace = keyspace
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk

    @property
    def key_prefix(self) -> str:
        """Key string up to the chunk hash: ``str(key) == key_prefix + key.chunk_hash.hex()``."""
        return f"tc{self.keyspace.key_format_version}.{self.keyspace.digest_hex}."

    def prefix_hashes(self, tokens: object) -> list[bytes]:
        """Chained 32-byte hashes of every keyed chunk of ``tokens``, in order."""
        import numpy as np

        arr = _token_array(tokens)
        chunk = self.chunk_size
        full = arr.size // chunk
        tail = arr.size - full * chunk
        head = _HASH_BYTES + _DIGEST_BYTES
        row = head + chunk * _TOKEN_BYTES
        # Lay every hash input out once, so each step is one 32-byte copy and one hash call.
        layout = np.empty((full, row), dtype=np.uint8)
        layout[:, _HASH_BYTES:head] = np.frombuffer(self.keyspace.digest, dtype=np.uint8)
        # Cast straight into the layout: one pass, no intermediate array (fresh pages are slow).
        layout[:, head:].view("<u4")[...] = arr[: full * chunk].reshape(full, chunk)
        view = memoryview(layout.reshape(-1).data) if full else memoryview(bytearray())
        sha256 = hashlib.sha256
        prev = bytes(_HASH_BYTES)
        out: list[bytes] = []
        append = out.append
        for offset in range(0, full * row, row):
            view[offset : offset + _HASH_BYTES] = prev
            prev = sha256(view[offset : offset + row]).digest()
            append(prev)
        if tail and self.save_unfull_chunk:
            append(sha256(prev + self.keyspace.digest + arr[full * chunk :].astype("<u4").tobytes()).digest())
        return out

    def process_tokens(self, tokens: object, mask: object | None = None) -> list[ChunkSpan]:
        """Chunk spans with keys for ``tokens``; with ``mask``, only chunks at or after its first True."""
        hashes = self.prefix_hashes(tokens)
        num_tokens = len(tokens)  # type: ignore[arg-type]
        start_token = 0 if mask is None else _mask_prefix(mask, num_tokens, self.chunk_size)
        chunk = self.chunk_size
        first = start_token // chunk
        new = tuple.__new__  # NamedTuple construction without the generated __new__'s overhead
        digest, version = self.keyspace.digest, self.keyspace.key_format_version
        return [
            new(ChunkSpan, (start, min(start + chunk, num_tokens), new(ChunkKey, (digest, h, None, version))))
            for start, h in zip(range(first * chunk, len(hashes) * chunk, chunk), hashes[first:], strict=True)
        ]

    def keys(self, tokens: Sequence[int] | object) -> list[ChunkKey]:
        """The chunk keys of ``tokens`` in order (no mask)."""
        return [span.key for span in self.process_tokens(tokens)]
