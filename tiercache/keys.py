"""Content addressing: KeySpace, ChunkKey, RequestIdentity, the chained prefix hash (TokenDatabase) and
contiguous_prefix.

Keys are identical across processes, hosts and restarts: SHA-256 over fixed-width little-endian token ids
and a canonical encoding of the request's identity (salt, LoRA adapter, multimodal inputs, prompt
embeddings), never Python's ``hash()``. When the caller has vLLM's block hashes (which already chain the
prefix and the same identity), a chunk's key is derived from the hash of its last block instead.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import json
import re
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from tiercache.spec import KVFormat, KVSpec, dtype_name

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "KEY_FORMAT_VERSION",
    "BlockHashes",
    "ChunkKey",
    "ChunkSpan",
    "InputSpan",
    "KeySpace",
    "RequestIdentity",
    "TokenDatabase",
    "contiguous_prefix",
]

KEY_FORMAT_VERSION = 1
_DIGEST_BYTES = 16  # keyspace digest length in bytes (32 hex chars)
_HASH_BYTES = 32  # SHA-256
_TOKEN_BYTES = 4  # token ids as little-endian uint32
_KEY_RE = re.compile(r"^tc(\d+)\.([0-9a-f]{32})\.([0-9a-f]{64})(?:\.l(\d{1,5}))?$")
_EXTRAS_TAG = b"tiercache.extras.v1\x00"  # domain tag: h_{i-1} mixed with chunk i's identity extras
_BLOCK_TAG = b"tiercache.vllm-block.v1\x00"  # domain tag: a chunk key derived from a vLLM block hash
_SPAN_BOUNDS = struct.Struct("<QQ")


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
    key_source: str = ""
    """How chunk hashes are computed when not from the tokens alone, e.g.
    ``vllm-block:sha256:bs32:seed=<fingerprint>`` when they derive from vLLM's block hashes; hashed only
    when set. Processes whose key sources differ get different digests: they miss, never mix keys."""
    kv_group: str = ""
    """The KV cache group an object belongs to when a model has attention of several kinds, e.g.
    ``sliding_window:64:<layers digest>``: its kind, window or chunk size and layers (hashed only when
    set), so one group's objects are never served to another group or another window."""
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
        for optional in ("layout_tag", "key_source", "kv_group"):
            if not fields[optional]:
                fields.pop(optional)
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


class InputSpan(NamedTuple):
    """An input the token ids do not describe (an image, audio, prompt embeddings) covering tokens
    ``[start, end)``, named by a stable digest (vLLM's multimodal identifier, a SHA-256 hex, ...)."""

    kind: str
    digest: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class RequestIdentity:
    """What makes a request's KV differ beyond its tokens; folded into its chunk hashes where vLLM folds it.

    ``cache_salt`` goes into the first chunk, the LoRA adapter (by name and path, never a per-process id)
    into every chunk, each input span into the chunks it overlaps (with its offsets relative to the
    chunk). An empty identity leaves the keys exactly as the tokens alone give them.
    """

    cache_salt: str = ""
    lora_name: str = ""
    lora_path: str = ""
    inputs: tuple[InputSpan, ...] = ()
    _starts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _longest: int = field(default=0, init=False, repr=False, compare=False)
    _plain_extras: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.lora_path and not self.lora_name:
            raise ValueError("a LoRA adapter needs its name (lora_path without lora_name)")
        spans = tuple(InputSpan(*span) for span in self.inputs)
        for span in spans:
            fields: tuple[object, ...] = tuple(span)  # checked at run time: callers may pass anything
            kind, digest, start, end = fields
            if not (isinstance(kind, str) and kind and isinstance(digest, str) and digest):
                raise ValueError(f"input span needs a non-empty kind and digest: {span!r}")
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
                raise ValueError(f"input span must cover [start, end) with 0 <= start < end: {span!r}")
        ordered = tuple(sorted(spans, key=lambda sp: (sp.start, sp.end, sp.kind, sp.digest)))
        object.__setattr__(self, "inputs", ordered)
        object.__setattr__(self, "_starts", tuple(span.start for span in ordered))
        object.__setattr__(self, "_longest", max((span.end - span.start for span in ordered), default=0))
        plain: list[list[object]] = [["lora", self.lora_name, self.lora_path]] if self.lora_name else []
        object.__setattr__(self, "_plain_extras", _canonical(plain))

    @property
    def is_empty(self) -> bool:
        """True when the identity adds nothing to the tokens (the keys are the token-only keys)."""
        return not (self.cache_salt or self.lora_name or self.inputs)

    def chunk_extras(self, start: int, end: int) -> bytes:
        """Canonical bytes of the identity parts that apply to tokens ``[start, end)``; empty if none."""
        # spans that can overlap [start, end): those starting in (start - longest, end)
        first = bisect.bisect_right(self._starts, start - self._longest) if self._starts else 0
        last = bisect.bisect_left(self._starts, end, first)
        overlapping = [span for span in self.inputs[first:last] if span.end > start]
        if not overlapping and (start or not self.cache_salt):
            return self._plain_extras  # the common case: the same bytes for every chunk
        items: list[list[object]] = []
        if self.lora_name:
            items.append(["lora", self.lora_name, self.lora_path])
        for span in overlapping:
            items.append([span.kind, span.digest, span.start - start, span.end - start])
        if start == 0 and self.cache_salt:
            items.append(["salt", self.cache_salt])
        return _canonical(items)


def _canonical(items: list[list[object]]) -> bytes:
    """Unambiguous bytes of identity items (compact ASCII JSON); empty for no items."""
    return json.dumps(items, ensure_ascii=True, separators=(",", ":")).encode() if items else b""


@dataclass(frozen=True, slots=True)
class BlockHashes:
    """vLLM's chained block hashes of a prompt: ``hashes[j]`` covers tokens ``[0, (j+1)*block_size)`` and
    the request identity vLLM folded into them. Only stable ones (SHA-256 family, fixed seed) may be used."""

    hashes: Sequence[bytes]
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


_NATIVE_WORDS = array.array("I").itemsize == _TOKEN_BYTES and sys.byteorder == "little"
"""array('I') is uint32 little-endian here: a list of ids packs straight into the hashed layout."""


def _token_words(tokens: object) -> tuple[memoryview | array.array[int], int]:
    """Token ids as a buffer of uint32 little-endian words (sliced by token, not byte) and their count;
    ValueError for ids outside [0, 2**32)."""
    if isinstance(tokens, (list, tuple)) and _NATIVE_WORDS:
        # array('I') converts a list of ints faster than any numpy route (vLLM hands over lists).
        try:
            packed = array.array("I", tokens)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        except TypeError:
            raise ValueError("token ids must be integers") from None
        return packed, len(packed)
    return _array_words(tokens)


def _array_words(tokens: object) -> tuple[memoryview, int]:
    import numpy as np

    arr = _token_array(tokens)
    return np.ascontiguousarray(arr, dtype="<u4").data, int(arr.size)


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

    ``h_i = SHA256(p_i || keyspace digest || tokens of chunk i as uint32 LE)`` with ``h_{-1}`` = 32 zero
    bytes, where ``p_i = h_{i-1}`` when the request identity adds nothing to chunk i, else
    ``p_i = SHA256("tiercache.extras.v1\\0" || h_{i-1} || identity extras of chunk i)``. With vLLM block
    hashes, a chunk ending on a block boundary covered by them is instead
    ``SHA256("tiercache.vllm-block.v1\\0" || keyspace digest || start, end as u64 LE || block hash)``.
    A short tail chunk gets a key only when ``save_unfull_chunk`` is true.
    """

    def __init__(self, keyspace: KeySpace, chunk_size: int = 256, save_unfull_chunk: bool = True) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.keyspace = keyspace
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self._block_hasher = hashlib.sha256(_BLOCK_TAG + keyspace.digest)
        self._chain_start = hashlib.sha256(bytes(_HASH_BYTES) + keyspace.digest)
        self._key_prefix = f"tc{keyspace.key_format_version}.{keyspace.digest_hex}."

    @property
    def key_prefix(self) -> str:
        """Key string up to the chunk hash: ``str(key) == key_prefix + key.chunk_hash.hex()``."""
        return self._key_prefix

    def prefix_hashes(
        self,
        tokens: object,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> list[bytes]:
        """Chained 32-byte hashes of every keyed chunk of ``tokens``, in order."""
        chunk = self.chunk_size
        if identity is not None and identity.is_empty:
            identity = None
        if block_hashes is None and identity is None:
            if not isinstance(tokens, list | tuple):  # arrays and tensors: cast straight into the layout
                return self._array_chain(_token_array(tokens))
            data, num_tokens = _token_words(tokens)
            return self._token_chain(data, num_tokens, self._keyed(num_tokens))
        num_tokens = len(tokens)  # type: ignore[arg-type]
        keyed = self._keyed(num_tokens)
        derived = self._derivable(block_hashes, num_tokens, keyed)
        # Only the chunks not derived from block hashes need their tokens (no pass over the rest).
        rest = tokens[derived * chunk :] if derived else tokens  # type: ignore[index]
        data, _ = _token_words(rest)
        return self._mixed_chain(data, num_tokens, keyed, identity, block_hashes, derived)

    def _keyed(self, num_tokens: int) -> int:
        """Number of chunks of ``num_tokens`` tokens that get a key."""
        keyed = num_tokens // self.chunk_size
        if num_tokens % self.chunk_size and self.save_unfull_chunk:
            keyed += 1
        return keyed

    def _token_chain(self, data: memoryview | array.array[int], num_tokens: int, keyed: int) -> list[bytes]:
        """The plain chain (no identity, no block hashes): one SHA-256 per chunk over the token words."""
        if not keyed:
            return []
        chunk = self.chunk_size
        hasher = self._chain_start.copy()  # h_{-1} and the keyspace digest: the same for every prompt
        if num_tokens <= chunk:  # one chunk (the usual per-call case): no slicing
            hasher.update(data)
            return [hasher.digest()]
        view = memoryview(data)
        hasher.update(view[:chunk])
        prev = hasher.digest()
        out = [prev]
        append = out.append
        digest = self.keyspace.digest
        sha256 = hashlib.sha256
        for start in range(chunk, keyed * chunk, chunk):
            hasher = sha256(prev + digest)
            hasher.update(view[start : start + chunk])
            prev = hasher.digest()
            append(prev)
        return out

    def _array_chain(self, arr: npt.NDArray[np.integer[Any]]) -> list[bytes]:
        """The plain chain of an integer array: every hash input laid out once, one hash call per chunk."""
        import numpy as np

        chunk = self.chunk_size
        full = arr.size // chunk
        tail = arr.size - full * chunk
        head = _HASH_BYTES + _DIGEST_BYTES
        row = head + chunk * _TOKEN_BYTES
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

    def _derivable(self, block_hashes: BlockHashes | None, num_tokens: int, keyed: int) -> int:
        """How many leading chunks can be derived from ``block_hashes`` (whole chunks ending on a block)."""
        if block_hashes is None:
            return 0
        block = block_hashes.block_size
        if self.chunk_size % block:
            return 0  # chunks would not end on block boundaries: the token chain keys them
        full = min(num_tokens // self.chunk_size, len(block_hashes.hashes) * block // self.chunk_size)
        tail_ends_on_a_block = num_tokens % block == 0 and num_tokens // block <= len(block_hashes.hashes)
        if full == num_tokens // self.chunk_size and keyed > full and tail_ends_on_a_block:
            return keyed  # every full chunk and the tail chunk
        return full

    def _mixed_chain(
        self,
        data: memoryview | array.array[int],
        num_tokens: int,
        keyed: int,
        identity: RequestIdentity | None,
        block_hashes: BlockHashes | None,
        derived: int,
    ) -> list[bytes]:
        """Chunks derived from block hashes first, then the token chain with the identity's extras
        (``data``: the tokens from the first chunk not derived)."""
        chunk = self.chunk_size
        digest = self.keyspace.digest
        sha256 = hashlib.sha256
        out: list[bytes] = []
        if derived:
            assert block_hashes is not None
            hashes, block = block_hashes.hashes, block_hashes.block_size
            pack, base_hasher = _SPAN_BOUNDS.pack, self._block_hasher
            append = out.append
            full = min(derived, num_tokens // chunk)
            # the hash of each full chunk's last block: every (chunk // block)-th, from the first chunk's end
            per = chunk // block
            for start, block_hash in zip(
                range(0, full * chunk, chunk), hashes[per - 1 : full * per : per], strict=True
            ):
                hasher = base_hasher.copy()
                hasher.update(pack(start, start + chunk))
                hasher.update(block_hash)
                append(hasher.digest())
            if derived > full:  # a tail chunk ending on a block boundary
                start = full * chunk
                hasher = base_hasher.copy()
                hasher.update(pack(start, num_tokens))
                hasher.update(hashes[num_tokens // block - 1])
                append(hasher.digest())
        prev = out[-1] if out else bytes(_HASH_BYTES)
        base = derived * chunk  # ``data`` starts at this token
        view = memoryview(data)
        for index in range(derived, keyed):
            start = index * chunk
            end = min(start + chunk, num_tokens)
            extras = identity.chunk_extras(start, end) if identity is not None else b""
            if extras:
                prev = sha256(_EXTRAS_TAG + prev + extras).digest()
            hasher = sha256(prev)
            hasher.update(digest)
            hasher.update(view[start - base : end - base])
            prev = hasher.digest()
            out.append(prev)
        return out

    def process_tokens(
        self,
        tokens: object,
        mask: object | None = None,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> list[ChunkSpan]:
        """Chunk spans with keys for ``tokens`` under ``identity`` (None: the tokens alone); with ``mask``,
        only chunks at or after its first True. ``block_hashes``: vLLM's stable block hashes of the same
        request (they must cover the same identity), used for every chunk that ends on one."""
        hashes = self.prefix_hashes(tokens, identity=identity, block_hashes=block_hashes)
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

    def mask_start(self, mask: object, num_tokens: int) -> int:
        """The False count of a valid FFF...TTT mask over ``num_tokens`` tokens (ValueError otherwise)."""
        return _mask_prefix(mask, num_tokens, self.chunk_size)

    def keys(
        self,
        tokens: Sequence[int] | object,
        *,
        identity: RequestIdentity | None = None,
        block_hashes: BlockHashes | None = None,
    ) -> list[ChunkKey]:
        """The chunk keys of ``tokens`` in order (no mask)."""
        spans = self.process_tokens(tokens, identity=identity, block_hashes=block_hashes)
        return [span.key for span in spans]
