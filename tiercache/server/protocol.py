"""Wire format: one msgpack array per SOCK_SEQPACKET message, ``[version, epoch, op, req_id, body]``.

:func:`decode` validates everything (types, sizes, per-op body fields) and raises :class:`ProtocolError` on
any malformed message; the server then drops the connection. It never raises anything else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from tiercache.spec import KVSpec

__all__ = [
    "CONTROL_ACTIONS",
    "MAX_KEYS",
    "MAX_MESSAGE",
    "MAX_WAIT_S",
    "PROTOCOL_VERSION",
    "ROLES",
    "SESSION_BYTES",
    "Message",
    "Op",
    "ProtocolError",
    "decode",
    "encode",
    "meta_spec",
    "spec_meta",
]

PROTOCOL_VERSION = 2
MAX_MESSAGE = 128 * 1024  # bytes of one message (a SEQPACKET datagram must fit the default socket buffer)
MAX_KEYS = 1024  # keys/slots/leases in one request
MAX_KEY_LEN = 512
MAX_META_LEN = 256  # a KV spec takes ~30 bytes
MAX_TENANT_LEN = 64  # a tenant id (tiercache.store.policy.tenant_id: 18 characters)
MAX_WAIT_S = 3600.0  # longest wait a request may ask for (LOOKUP wait_s, DRAIN timeout_s)
MAX_FENCES = 64  # lost sessions one HELLO or FENCE may end
MAX_DECLARED = 16  # object sizes one HELLO may declare
MAX_BLOCKS = 1024  # vLLM blocks one DESCRIBE chunk may cover
MAX_LORA_LEN = 256
SESSION_BYTES = 16  # a session token: random, known only to the connection it was given to
CONTROL_ACTIONS = frozenset({"pin", "unpin", "delete", "prefetch", "stats"})
"""Cache-control actions (``CONTROL``, admin connections only)."""
ROLES = frozenset({"worker", "scheduler", "admin", "probe"})
"""``probe``: a health check (no segment passed, STATS only); ``admin``: CLEAR and DRAIN (the server's own uid
or its admin group only)."""


class ProtocolError(ValueError):
    """A malformed or unexpected message; the connection that sent it is dropped."""


class Op(enum.IntEnum):
    """Requests (client -> server) and the two reply kinds."""

    HELLO = 1
    LOOKUP = 2
    ALLOC = 3
    COMMIT = 4
    ABORT = 5
    RELEASE = 6
    END = 7
    STATS = 8
    CLEAR = 9
    DRAIN = 10
    FENCE = 11
    DESCRIBE = 12
    CONTROL = 13
    OK = 64
    ERR = 65


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded, validated message."""

    epoch: int
    op: Op
    req_id: int
    body: dict[str, Any]


def encode(op: Op, epoch: int, req_id: int, body: dict[str, Any]) -> bytes:
    """One message; ProtocolError if it would exceed MAX_MESSAGE."""
    data: bytes = msgpack.packb([PROTOCOL_VERSION, epoch, int(op), req_id, body], use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    return data


def _u64(v: object, what: str) -> int:
    if type(v) is not int or not 0 <= v < 2**63:
        raise ProtocolError(f"{what} must be a non-negative int, got {v!r:.60}")
    return v


def _list(v: object, what: str, max_len: int = MAX_KEYS) -> list[Any]:
    if type(v) is not list or len(v) > max_len:
        raise ProtocolError(f"{what} must be a list of at most {max_len} items")
    return v


def _keys(v: object) -> list[str]:
    keys = _list(v, "keys")
    for k in keys:
        if type(k) is not str or not 0 < len(k) <= MAX_KEY_LEN:
            raise ProtocolError(f"a key must be a non-empty str of at most {MAX_KEY_LEN} chars")
    return keys


def _bool(v: object, what: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{what} must be a bool")
    return v


def _seconds(v: object, what: str) -> float:
    if type(v) not in (int, float) or not 0 <= v <= MAX_WAIT_S:  # type: ignore[operator]
        raise ProtocolError(f"{what} must be a number of seconds in [0, {MAX_WAIT_S:g}]")
    return float(v)  # type: ignore[arg-type]


def _slot_refs(v: object) -> list[tuple[int, int]]:
    out = []
    for ref in _list(v, "slots"):
        if type(ref) is not list or len(ref) != 2:
            raise ProtocolError("a slot reference is [slot, generation]")
        out.append((_u64(ref[0], "slot"), _u64(ref[1], "generation")))
    return out


def _sessions(v: object) -> list[bytes]:
    tokens = _list(v, "sessions", MAX_FENCES)
    for t in tokens:
        if type(t) is not bytes or len(t) != SESSION_BYTES:
            raise ProtocolError(f"a session token is {SESSION_BYTES} bytes")
    return tokens


def _validate_request(op: Op, body: dict[str, Any]) -> dict[str, Any]:
    """The normalised body of a request; ProtocolError on a missing/extra/ill-typed field."""
    if op is Op.HELLO:  # slot_bytes: the object sizes the client will store; fence: its lost sessions
        role = body.get("role")
        if type(role) is not str or role not in ROLES:
            raise ProtocolError(f"HELLO needs role, one of {sorted(ROLES)}")
        return {
            "role": role,
            "slot_bytes": [
                _u64(n, "slot_bytes") for n in _list(body.get("slot_bytes", []), "slot_bytes", MAX_DECLARED)
            ],
            "fence": _sessions(body.get("fence", [])),
        }
    if op is Op.FENCE:
        return {"sessions": _sessions(body.get("sessions"))}
    if op is Op.LOOKUP:  # l2 / prefetch / wait_s are optional (L1-only clients leave them out)
        return {
            "keys": _keys(body.get("keys")),
            "pin": _bool(body.get("pin"), "pin"),
            "prefix": _bool(body.get("prefix"), "prefix"),
            "l2": _bool(body.get("l2", False), "l2"),
            "prefetch": _bool(body.get("prefetch", False), "prefetch"),
            "wait_s": _seconds(body.get("wait_s", 0.0), "wait_s"),
        }
    if op is Op.ALLOC:
        keys = _keys(body.get("keys"))
        nbytes = [_u64(n, "nbytes") for n in _list(body.get("nbytes"), "nbytes")]
        metas = _list(body.get("meta"), "meta")
        if not len(keys) == len(nbytes) == len(metas):
            raise ProtocolError("ALLOC keys, nbytes and meta differ in length")
        for m in metas:
            if type(m) is not bytes or len(m) > MAX_META_LEN:
                raise ProtocolError(f"meta must be bytes of at most {MAX_META_LEN}")
        alloc: dict[str, Any] = {"keys": keys, "nbytes": nbytes, "meta": metas}
        if "tenant" in body:  # optional: whose quota the slots count against
            tenant = body["tenant"]
            if type(tenant) is not str or len(tenant) > MAX_TENANT_LEN:
                raise ProtocolError(f"tenant must be a string of at most {MAX_TENANT_LEN} characters")
            alloc["tenant"] = tenant
        return alloc
    if op in (Op.COMMIT, Op.ABORT):
        return {"slots": _slot_refs(body.get("slots"))}
    if op is Op.RELEASE:
        return {"leases": [_u64(x, "lease") for x in _list(body.get("leases"), "leases")]}
    if op in (Op.END, Op.STATS, Op.CLEAR):
        return {}
    if op is Op.DRAIN:
        return {"timeout_s": _seconds(body.get("timeout_s"), "timeout_s")}
    if op is Op.DESCRIBE:
        return {"chunks": [_chunk(c) for c in _list(body.get("chunks"), "chunks")]}
    if op is Op.CONTROL:
        return _control(body)
    raise ProtocolError(f"{op.name} is not a request")


def _block_hash(v: object, what: str) -> int | bytes:
    """A vLLM block hash: 1..64 bytes, or an unsigned 64-bit int (vLLM's int form)."""
    if type(v) is bytes and 0 < len(v) <= 64:
        return v
    if type(v) is not int or not 0 <= v < 2**64:
        raise ProtocolError(f"{what} must be 1-64 bytes or an unsigned 64-bit int, got {v!r:.60}")
    return v


def _chunk(v: object) -> tuple[str, list[int | bytes], int | bytes | None, list[int], int, str | None]:
    """One DESCRIBE entry: ``[key, block_hashes, parent, token_ids, block_size, lora_name]`` (the vLLM blocks
    a key covers, for the server's KV events)."""
    if type(v) is not list or len(v) != 6:
        raise ProtocolError(
            "a DESCRIBE chunk is [key, block_hashes, parent, token_ids, block_size, lora_name]"
        )
    key = _keys([v[0]])[0]
    hashes = [_block_hash(h, "block_hashes") for h in _list(v[1], "block_hashes", MAX_BLOCKS)]
    parent = None if v[2] is None else _block_hash(v[2], "parent")
    size = _u64(v[4], "block_size")
    tokens = _list(v[3], "token_ids", MAX_BLOCKS * 64)
    if not hashes or size == 0 or len(tokens) != len(hashes) * size:
        raise ProtocolError("DESCRIBE token_ids must be len(block_hashes) * block_size > 0")
    lora = v[5]
    if lora is not None and (type(lora) is not str or len(lora) > MAX_LORA_LEN):
        raise ProtocolError(f"DESCRIBE lora_name must be a str of at most {MAX_LORA_LEN}")
    return key, hashes, parent, [_u64(t, "token_ids") for t in tokens], size, lora


def _control(body: dict[str, Any]) -> dict[str, Any]:
    """``CONTROL``: ``action`` and its objects: ``keys``, or every published key under ``prefix`` (and of
    ``tenant`` when given); ``wait_s`` bounds a pin's or prefetch's load from L2."""
    action = body.get("action")
    if type(action) is not str or action not in CONTROL_ACTIONS:
        raise ProtocolError(f"CONTROL action must be one of {sorted(CONTROL_ACTIONS)}")
    out: dict[str, Any] = {"action": action, "keys": _keys(body.get("keys", []))}
    for name in ("prefix", "tenant"):
        value = body.get(name)
        if value is not None and (type(value) is not str or len(value) > MAX_KEY_LEN):
            raise ProtocolError(f"CONTROL {name} must be a str of at most {MAX_KEY_LEN} chars")
        out[name] = value
    out["wait_s"] = _seconds(body.get("wait_s", 0.0), "wait_s")
    return out


def decode(data: bytes, *, request: bool = True) -> Message:
    """Parse and validate one message; ``request`` selects request (server side) or reply (client side)."""
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        obj = msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    if type(obj) is not list or len(obj) != 5:
        raise ProtocolError("a message is [version, epoch, op, req_id, body]")
    version, epoch, op_raw, req_id, body = obj
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"protocol version {version!r:.20} is not {PROTOCOL_VERSION}")
    epoch = _u64(epoch, "epoch")
    req_id = _u64(req_id, "req_id")
    if type(op_raw) is not int or op_raw not in Op._value2member_map_:
        raise ProtocolError(f"unknown op {op_raw!r:.20}")
    op = Op(op_raw)
    if type(body) is not dict or not all(type(k) is str for k in body):
        raise ProtocolError("body must be a map with str keys")
    if request:
        return Message(epoch, op, req_id, _validate_request(op, body))
    if op not in (Op.OK, Op.ERR):
        raise ProtocolError(f"{op.name} is not a reply")
    return Message(epoch, op, req_id, body)


def spec_meta(spec: KVSpec) -> bytes:
    """A KV spec as the slot metadata of ALLOC (msgpack, ~30 bytes)."""
    meta: bytes = msgpack.packb(
        [
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            int(spec.format),
            spec.tokens,
            spec.layer_start,
            spec.layer_end,
        ]
    )
    return meta


def meta_spec(meta: bytes) -> KVSpec | None:
    """The KV spec in slot metadata; None for anything else (another client's garbage is a miss)."""
    from tiercache.spec import KVFormat, KVSpec

    try:
        f = msgpack.unpackb(meta)
        return KVSpec(f[0], f[1], f[2], f[3], KVFormat(f[4]), f[5], f[6], f[7])
    except Exception:
        return None
