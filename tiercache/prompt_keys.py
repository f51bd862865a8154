"""A prompt's chunk keys outside the process that stores them: from a keyspace description and token ids.

A vLLM instance with the connector writes its keyspace description (``kv_connector_extra_config
["keyspace_file"]``): every keyspace it keys chunks in (one per parallel rank and KV cache group), the chunk
size and its key source. :func:`prompt_keys` turns token ids (with the request's ``cache_salt`` and LoRA
adapter) into the keys that instance stores them under, so cache control can pin, prefetch or delete a prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiercache.keys import BlockHashes, KeySpace, RequestIdentity, TokenDatabase

__all__ = [
    "DESCRIPTION_FORMAT",
    "KeyspaceDescription",
    "load_description",
    "prompt_keys",
    "vllm_block_hashes",
]

DESCRIPTION_FORMAT = 1
_BLOCK_SOURCE = "vllm-block:"


@dataclass(frozen=True, slots=True)
class KeyspaceDescription:
    """What keys one vLLM instance's chunks: its keyspaces (rank-major, then KV cache group, all with one key
    source), the chunk size and whether a partial last chunk is keyed."""

    keyspaces: tuple[KeySpace, ...]
    chunk_size: int
    save_unfull_chunk: bool = True

    @property
    def key_source(self) -> str:
        """The keyspaces' key source: ``""`` (token ids) or ``vllm-block:ALGO:bsN:seed=DIGEST``."""
        return self.keyspaces[0].key_source

    @property
    def prefixes(self) -> list[str]:
        """The key prefix of each keyspace (``tc1.<digest>.``)."""
        return [f"tc{k.key_format_version}.{k.digest_hex}." for k in self.keyspaces]

    def to_json(self) -> dict[str, Any]:
        """The description as JSON (each keyspace's fields and its digest, checked when read back)."""
        spaces = []
        for space in self.keyspaces:
            fields = asdict(space)
            fields.pop("_digest")
            fields["kv_format"] = space.kv_format.value
            spaces.append({"fields": fields, "digest": space.digest_hex})
        return {
            "format": DESCRIPTION_FORMAT,
            "chunk_size": self.chunk_size,
            "save_unfull_chunk": self.save_unfull_chunk,
            "keyspaces": spaces,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "keyspace description") -> KeyspaceDescription:
        """Parse :meth:`to_json`'s output; ``ValueError`` in one line naming ``where`` when it is not one."""
        try:
            if data.get("format") != DESCRIPTION_FORMAT:
                raise ValueError(f"format {data.get('format')!r} (this version reads {DESCRIPTION_FORMAT})")
            spaces = []
            for item in data["keyspaces"]:
                space = KeySpace(**item["fields"])
                if space.digest_hex != item["digest"]:
                    raise ValueError(f"keyspace digest {item['digest']} does not match its fields")
                spaces.append(space)
            if not spaces:
                raise ValueError("no keyspaces")
            chunk, unfull = data["chunk_size"], data["save_unfull_chunk"]
            if not isinstance(chunk, int) or chunk <= 0 or not isinstance(unfull, bool):
                raise ValueError("chunk_size must be a positive integer and save_unfull_chunk a boolean")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a tiercache keyspace description ({exc})") from None
        return cls(tuple(spaces), chunk, unfull)


def load_description(path: str | os.PathLike[str]) -> KeyspaceDescription:
    """Read the keyspace description a connector wrote to ``path``; ``ValueError`` naming the file if bad."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the keyspace description ({exc})") from None
    return KeyspaceDescription.from_json(data, str(path))


def vllm_block_hashes(
    key_source: str, tokens: Sequence[int], cache_salt: str = "", lora_name: str = "", lora_path: str = ""
) -> BlockHashes:
    """vLLM's block hashes of a text-only prompt under ``key_source`` (``vllm-block:ALGO:bsN:seed=D``),
    computed with vLLM's own hash functions. ``ValueError`` when vLLM is not importable or this process's
    NONE_HASH seed (PYTHONHASHSEED) is not the instance's: its block hashes cannot be reproduced here."""
    try:
        _, algo, bs, seed_part = key_source.split(":")
        block_size = int(bs.removeprefix("bs"))
        want_seed = seed_part.removeprefix("seed=")
    except ValueError:
        raise ValueError(f"unknown key source {key_source!r}") from None
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        raise ValueError(
            f"key source {key_source}: keys derive from vLLM's block hashes and vllm is not importable here"
        ) from None
    hash_fn = get_hash_fn_by_name(algo)
    seed = kv_cache_utils.resolve_none_hash_seed(hash_fn)
    if hashlib.sha256(seed.encode()).hexdigest()[:16] != want_seed:
        raise ValueError(
            f"key source {key_source}: the instance's NONE_HASH seed is not this process's; run with the "
            "instance's PYTHONHASHSEED (a random seed cannot be reproduced outside its process)"
        )
    kv_cache_utils.init_none_hash(hash_fn)  # vLLM's hash_block_tokens chains the first block from it
    lora: list[tuple[str, ...]] = [("lora", lora_name, lora_path)] if lora_name else []
    hashes: list[bytes] = []
    parent: Any = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        salt: list[tuple[str, ...]] = [("cache_salt", cache_salt)] if start == 0 and cache_salt else []
        extra = tuple(lora + salt) or None  # vLLM's order: LoRA, multimodal, cache salt, embeddings
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + block_size], extra)
        hashes.append(bytes(parent))
    return BlockHashes(hashes, block_size)


def prompt_keys(
    description: KeyspaceDescription,
    tokens: Sequence[int],
    *,
    cache_salt: str = "",
    lora_name: str = "",
    lora_path: str = "",
) -> list[str]:
    """Every key the described instance stores ``tokens``' chunks under (a text-only prompt with this
    ``cache_salt`` and LoRA adapter), chunk-major then keyspace. ``ValueError`` when they cannot be computed
    here (see :func:`vllm_block_hashes`)."""
    tokens = [int(t) for t in tokens]
    identity = RequestIdentity(cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path)
    source = description.key_source
    blocks: BlockHashes | None = None
    if source.startswith(_BLOCK_SOURCE):
        blocks = vllm_block_hashes(source, tokens, cache_salt, lora_name, lora_path)
    elif source:
        raise ValueError(f"unknown key source {source!r}")
    per_space = []
    for space in description.keyspaces:
        db = TokenDatabase(space, description.chunk_size, description.save_unfull_chunk)
        hashes = db.prefix_hashes(tokens, identity=identity, block_hashes=blocks)
        per_space.append([db.key_prefix + h.hex() for h in hashes])
    return [key for chunk in zip(*per_space, strict=True) for key in chunk]
