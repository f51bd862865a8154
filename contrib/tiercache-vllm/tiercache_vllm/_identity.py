"""Request identity and key source for the connector: what a vLLM ``Request`` adds to its tokens' keys.

Both halves of the connector (and both processes of a prefill/decode pair) must compute the same chunk keys:
the scheduler turns each request into a :class:`~tiercache.keys.RequestIdentity` (salt, LoRA adapter by name
and path, multimodal identifiers over their placeholder ranges, prompt-embedding digests per chunk) and, when
vLLM's block hashes are stable across processes, hands their slice along, so the worker keys the same chunks
the same way without seeing the ``Request``.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiercache.keys import BlockHashes, InputSpan, RequestIdentity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

__all__ = [
    "KEY_SOURCES",
    "KeyArgs",
    "UnkeyableRequest",
    "hash_block_size",
    "key_args",
    "request_identity",
    "vllm_key_source",
]

logger = logging.getLogger(__name__.replace("tiercache_vllm", "tiercache.vllm", 1))

KEY_SOURCES = ("auto", "tokens")
"""``kv_connector_extra_config["key_source"]`` values: ``auto`` derives chunk keys from vLLM's block hashes
when they are stable across processes (SHA-256 family), else from the tokens; ``tokens``: always tokens."""

_STABLE_ALGOS = ("sha256", "sha256_cbor")  # vLLM seeds these with a fixed default or PYTHONHASHSEED
_KNOWN_EXTRA_TAGS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})
_logged: set[str] = set()


class UnkeyableRequest(ValueError):
    """The request carries identity tiercache cannot key stably: it is neither looked up nor stored."""


@dataclass(frozen=True, slots=True)
class KeyArgs:
    """What the engine needs besides the tokens to key a request's chunks (``identity``, ``block_hashes``)."""

    identity: RequestIdentity | None
    block_hashes: BlockHashes | None

    def up_to(self, num_tokens: int) -> KeyArgs:
        """The same, with block hashes trimmed to the first ``num_tokens`` tokens (what a worker op needs)."""
        if self.block_hashes is None:
            return self
        blocks = num_tokens // self.block_hashes.block_size
        return KeyArgs(
            self.identity, BlockHashes(list(self.block_hashes.hashes[:blocks]), self.block_hashes.block_size)
        )


def _log_once(message: str, *args: object) -> None:
    text = message % args
    if text not in _logged:
        _logged.add(text)
        logger.warning(text)


def vllm_key_source(vllm_config: VllmConfig, key_source: str) -> str:
    """The keyspace's ``key_source`` for this vLLM config: ``""`` (token chain) or the block-hash fingerprint.

    The fingerprint names the hash algorithm, the hash block size and a digest of the NONE_HASH seed, so two
    processes whose block hashes cannot agree get different keyspaces (they miss, and each logs its source).
    """
    if key_source not in KEY_SOURCES:
        raise ValueError(
            f"kv_connector_extra_config['key_source'] must be one of {KEY_SOURCES}: {key_source!r}"
        )
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "") or "")
    if key_source == "tokens" or algo not in _STABLE_ALGOS:
        _log_once(
            "tiercache: chunk keys from the token ids (key_source=%s, prefix_caching_hash_algo=%s)",
            key_source,
            algo or "?",
        )
        return ""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    seed = resolve_none_hash_seed(get_hash_fn_by_name(algo))
    seed_digest = hashlib.sha256(seed.encode()).hexdigest()[:16]
    source = f"vllm-block:{algo}:bs{_hash_block_size(vllm_config)}:seed={seed_digest}"
    _log_once(
        "tiercache: chunk keys from vLLM block hashes (%s); every process sharing these tiers must use the "
        "same prefix_caching_hash_algo, block size and PYTHONHASHSEED (or none), else its lookups miss",
        source,
    )
    return source


def _hash_block_size(vllm_config: VllmConfig) -> int:
    """Tokens per vLLM block hash (one full-attention group: the block size)."""
    return int(vllm_config.cache_config.block_size)


def hash_block_size(vllm_config: VllmConfig, key_source: str) -> int | None:
    """Tokens per block hash when ``key_source`` is a block source, else None."""
    return _hash_block_size(vllm_config) if key_source else None


def key_args(request: Request, chunk_size: int, block_size: int | None) -> KeyArgs:
    """The request's identity, plus its block hashes when keys come from them (``block_size`` set).

    Raises :class:`UnkeyableRequest` when part of the identity has no stable name (a multimodal item without
    an identifier, a LoRA adapter without a name, an extra key this version does not know).
    """
    identity = request_identity(request, chunk_size)
    blocks: BlockHashes | None = None
    if block_size:
        hashes = request.block_hashes
        if len(hashes) == request.num_tokens // block_size:  # one hash per full block, as expected
            blocks = BlockHashes(hashes, block_size)
        else:
            _log_once("tiercache: vLLM block hashes do not match block size %d; keying tokens", block_size)
    return KeyArgs(None if identity.is_empty else identity, blocks)


def request_identity(request: Request, chunk_size: int) -> RequestIdentity:
    """Salt, LoRA (name and path), multimodal identifiers and per-chunk prompt-embedding digests of
    ``request``; :class:`UnkeyableRequest` when one of them cannot be named stably."""
    lora_name = lora_path = ""
    lora = request.lora_request
    if lora is not None:
        lora_name, lora_path = str(lora.lora_name or ""), str(lora.lora_path or "")
        if not lora_name:
            raise UnkeyableRequest("LoRA adapter without a name")
    spans: list[InputSpan] = []
    for feature in request.mm_features or ():
        ident = getattr(feature, "identifier", None)
        pos = feature.mm_position
        if not ident or int(pos.length) <= 0:
            raise UnkeyableRequest(f"multimodal item without a stable identifier ({feature.modality})")
        spans.append(InputSpan("mm", str(ident), int(pos.offset), int(pos.offset) + int(pos.length)))
    embeds = request.prompt_embeds
    if embeds is not None:
        spans.extend(_embeds_spans(embeds, chunk_size))
    _check_extra_keys(request)
    try:
        return RequestIdentity(
            cache_salt=str(request.cache_salt or ""),
            lora_name=lora_name,
            lora_path=lora_path,
            inputs=tuple(spans),
        )
    except ValueError as exc:
        raise UnkeyableRequest(str(exc)) from None


def _embeds_spans(embeds: Any, chunk_size: int) -> list[InputSpan]:
    """One SHA-256 (dtype, shape, bytes) per chunk of the prompt embeddings."""
    from vllm.v1.utils import tensor_data

    out = []
    for start in range(0, int(embeds.shape[0]), chunk_size):
        part = embeds[start : start + chunk_size]
        hasher = hashlib.sha256(f"{part.dtype}:{tuple(part.shape)}".encode())
        hasher.update(tensor_data(part))
        out.append(InputSpan("embeds", hasher.hexdigest(), start, start + int(part.shape[0])))
    return out


def _check_extra_keys(request: Request) -> None:
    """Refuse identity vLLM folds into block hashes that this module does not know how to key."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:  # pragma: no cover - other vLLM versions
        return
    end = max(1, int(request.num_prompt_tokens))
    try:
        extra, _ = generate_block_hash_extra_keys(request, 0, end, 0)
    except Exception as exc:  # vLLM could not key it either
        raise UnkeyableRequest(f"vLLM cannot derive its extra keys ({exc!r})") from None
    unknown = {
        str(key[0]) for key in extra or () if not (isinstance(key, tuple) and key[0] in _KNOWN_EXTRA_TAGS)
    }
    if unknown:
        raise UnkeyableRequest(f"unknown identity parts {sorted(unknown)}")
