"""``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``, ``redis+cluster://``: frames as Redis strings.

One key per object (``<prefix><key>``) holds the whole frame, or, for a frame over ``part_size``, a small
manifest naming its parts (below, "Large values"); a reader sees the old frame, the new one or nothing. On
plain TCP to a standalone server, reads, lookups and puts go through ``adapters/_resp.py`` (below); TLS,
Cluster and the rest (delete, cleanup) through ``redis.asyncio`` (RESP2: no HELLO), each with a blocking pool
of ``pool_size`` connections (a batch waits for a free connection instead of failing when the pool is busy).

URL forms::

    redis://host:6379/0            rediss://host:6380/0 (TLS)      valkey:// and valkeys:// are the same
    redis+cluster://host:7000[,host2:7001,...]                     (also rediss+cluster, valkey[s]+cluster)

A username may be in the URL (``redis://user@host``); a password may not (use ``password_env`` in the config,
which arrives here as ``password``).

Options (URL query or keyword): ``password``, ``username``, ``pool_size`` (default 16), ``socket_timeout``
(seconds, default 5: the most one call to the server may take as a whole, a new connection's connect and
handshake included on the RESP client; redis-py's own timeout is per reply, so its pipelines are bounded
by ``socket_timeout`` as a whole too), ``ttl`` (seconds; objects expire, ``SET PX``), ``prefix``
(default ``"tiercache:"``; isolates deployments sharing a server), ``part_size`` (bytes, default 4 MiB; 0:
never split), ``capacity`` (accepted and ignored: the
server's ``maxmemory`` governs; eviction by the server is normal operation and an evicted key is a miss),
and for TLS ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` (paths) and ``ssl_cert_reqs``
(``required`` (default), ``optional`` or ``none``). Unknown options raise ``ConfigError``.

How batches map to commands (the choices are measured by ``benchmarks/adapters_bench.py``; results in
``docs/performance.md``):

* contains: one pipeline of ``EXISTS`` and ``GETRANGE`` (the first 52 bytes) per key, then one of ``EXISTS``
  and ``GETRANGE`` (from where its nonce starts) per part for the keys that hold a manifest. delete: one
  pipeline of ``GETRANGE`` + ``DEL`` per key, then one of ``DEL`` per part of the manifests found.
* get: one ``GET`` per key, ``GET_VALUES_IN_FLIGHT`` of a batch at once, each on its own connection, while
  the values seen (read or written) are large (running mean > 256 KiB), else one pipeline of ``MGET``s of
  about 1 MiB of values each (cluster: of ``GET``s). Large replies land in receive buffers that are reused
  once the caller has dropped them (``adapters/_recvbuf.py``).
* put: values up to 256 KiB go in pipelines (one round trip per ~1 MiB of small values; each ``SET`` after a
  ``GETRANGE`` of the key's first 52 bytes, to find a manifest it replaces); each larger value is its own
  ``SET`` after that ``GETRANGE``, in ``PUT_VALUES_IN_FLIGHT`` lanes: on the RESP client a lane is an even
  share of the batch's large values (``PUT_PIPELINE_BYTES`` at most) on one connection, sent from a worker
  thread one value at a time (the next once the last was answered: no loop wakeup per value, and the server
  reads each value straight into its own string), and the batch's lanes are handed to the threads together
  (``RespPool.pipelines``: one loop wakeup per batch, not per lane); a batch of more lanes than run at once
  queues them one call each, a lane starting as soon as another ended; through redis-py each value is a
  lane of its own.
* On a plain-TCP standalone server reads, lookups and puts go through ``adapters/_resp.py``, a small RESP
  client that sends the caller's buffer with ``sendmsg`` and receives a reply in place (no copies of a value
  on the way out or in). It keeps ``pool_size``, ``socket_timeout`` (the deadline of each whole call:
  ``AdapterTimeout``), the password, the user name and the database; TLS and Cluster use redis-py.
* The server is not trusted (``_resp.py``): a bulk reply declared over ``MAX_VALUE_BYTES`` is refused before
  any of it is read or allocated, a reply of a type or length its command cannot have fails the call, an
  MGET's array must hold as many values as keys, AUTH and SELECT must answer ``+OK``, and a connection that
  failed, timed out or saw anything unexpected (a late or extra reply) is closed, never reused.

Large values (``adapters/_parts.py``): a value over ``part_size`` is stored as parts ``<key>#0..n-1`` of
``part_size`` bytes, each followed by the write's random 16-byte nonce, written ``PART_WRITES_IN_FLIGHT`` (8)
at a time; then the head ``<key>`` with a 52-byte manifest (size, part size, count, nonce). A read GETs the
head, then the parts ``PART_READS_IN_FLIGHT`` (4) at a time straight into one buffer (the RESP client
receives each in place; the buffer is reused once the caller dropped every view of it,
``adapters/_recvbuf.py``). Why: the server's allocator (jemalloc) serves allocations of 8 MiB and more from an
arena that returns pages at once, so every SET or reply of a bigger value would fault in fresh pages. A 4 MiB
part is a 5 MiB allocation on the server (the next size class, counted against ``maxmemory``). Rules:
parts are written before the head, so a head only names parts that were complete; a rewrite overwrites the
parts in place (the server reuses their memory) and deletes the parts past its count after its head; a value
stored whole over a parted one deletes all of its parts after its SET (the replaced head is read before it: in
the same pipeline, or on the same connection); a reader checks each part's length and nonce against its
manifest: a missing part (evicted, expired) is a miss counted in ``stats["parts_missing"]``, and the head
(only if unchanged: a compare-and-delete script) and the parts are removed; a part of another write (by nonce
or length: a rewrite in progress) is a miss counted in ``stats["parts_stale"]``; a head that starts like a
manifest and does not decode is a miss counted in ``stats["bad_manifests"]`` (a value that starts with the
manifest magic is always stored parted, so it is never mistaken for one). ``contains`` is the head and every
part existing with the manifest's length and nonce, checked and counted as a read checks them (one more
pipeline, only for manifests: a part of another write is not contained, so a lookup never counts a hit that
the read misses); ``delete`` removes the head, then the parts. Part keys land on their own cluster slots (no
hash tags: no command spans two keys, and spreading a value over the masters spreads its load). A part refused
for memory removes the parts and fails the put; a writer that dies between parts leaves them to the TTL,
eviction or the next put of the key (which overwrites them).

Keys that are not ours: a key under the prefix of another type (a list, hash, set... WRONGTYPE) or holding a
string over ``MAX_VALUE_BYTES`` is a miss wherever it is met (contains, get, a part of a parted value: stale),
counted in ``stats["foreign_keys"]`` (each time a reply tells: an MGET's nil does not), never a failure of the
tier; a put of its name replaces it (SET), a delete deletes it. A string that is not a frame is the codec
pipeline's to reject (a miss counted as a rejected frame).

Errors: connection refused/reset/closed and authentication failures raise ``AdapterUnavailable``; a server
that does not answer within ``socket_timeout`` raises ``AdapterTimeout``. Only the project's errors leave the
adapter: an error reply, or a reply a client cannot parse (a broken or hostile server), is
``AdapterUnavailable``; a batch stops at its first transport failure (calls still running are cancelled,
not left to wait out their own deadlines). A reset connection is retried once
at once (a pooled connection may be stale after a server restart); timeouts are never retried. ``open`` pings
the server, so an unreachable server or a wrong password fails at ``open`` with ``AdapterUnavailable``. After
``aclose`` every call raises ``AdapterUnavailable``. A ``SET`` refused for memory (``maxmemory`` with the
``noeviction`` policy) is a failed put (``False``), not an error.

Cluster (``RedisClusterAdapter``): ``redis.asyncio.cluster.RedisCluster`` with its own retries off (it would
retry timeouts); its exceptions (``RedisClusterException``, ``SlotNotCoveredError``, ``ClusterDownError``...)
raise ``AdapterUnavailable``, timeouts ``AdapterTimeout``; batches are cluster pipelines,
which redis-py splits per node (one round trip per node per batch) after hashing each key to its slot.
The key space is spread over the slots (no hash tags). ``pool_size`` bounds the batches in flight (and so
the connections per node).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar
from urllib.parse import unquote, urlsplit

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_lengths, is_key
from tiercache.adapters._parts import MANIFEST_BYTES, NONCE_BYTES, Manifest
from tiercache.adapters._recvbuf import RecvBuffers
from tiercache.adapters._resp import RespError, RespPool, RespTooLarge
from tiercache.adapters.options import MAX_SIZE, Range, Size, check_options, parse_options, parse_str
from tiercache.buffers import as_readable_bytes
from tiercache.errors import AdapterError, AdapterTimeout, AdapterUnavailable, ConfigError

if TYPE_CHECKING:
    from typing import Self

__all__ = ["RedisAdapter", "RedisClusterAdapter", "RedisOptions"]

_T = TypeVar("_T")

MAX_VALUE_BYTES = 512 << 20
"""Redis's default ``proto-max-bulk-len``: the largest string value a server accepts."""
DEFAULT_PREFIX = "tiercache:"
SCAN_COUNT = 1000
"""``COUNT`` of each ``SCAN`` of ``iter_keys`` (keys the server looks at per call, not a reply bound)."""
DEFAULT_POOL_SIZE = 16
DEFAULT_SOCKET_TIMEOUT = 5.0
PIPELINE_VALUE_BYTES = 256 << 10
"""Values up to this size are pipelined on put; larger ones are sent as one SET each."""
PIPELINE_BATCH_BYTES = 1 << 20
"""Bytes of small values per put pipeline."""
DEFAULT_PART_SIZE = 4 << 20
"""Values over this size are stored as parts of this size (``part_size`` option; 0: never split)."""
PART_READS_IN_FLIGHT = 4
"""Part GETs in flight per adapter: 4 beat 1, 2, 8 and 16 (benchmarks/adapters_bench.py, split_64MiB)."""
PART_WRITES_IN_FLIGHT = 8
"""Part SETs in flight per adapter: 8 beat 4 and 16 (see the module docstring)."""
GET_VALUES_IN_FLIGHT = 4
"""Large-value GETs of one batch in flight, each on its own connection (a parted value's parts share the part
lanes across the batch). ``benchmarks/vs_lmcache_resp.py --variants`` times 1 beside it."""
PUT_VALUES_IN_FLIGHT = 8
"""Lanes of large-value SETs of one batch in flight (at most ``pool_size``); the same benchmark times 1 and
16. On the RESP client a lane is one pipeline of ``GETRANGE`` + ``SET`` per value, about an even share of the
batch's large values, at most ``PUT_PIPELINE_BYTES``; through redis-py each value is its own lane."""
PUT_PIPELINE_BYTES = 16 << 20
"""Bytes of large values per pipelined put lane at most (one call: one ``socket_timeout`` for all of it)."""
RECV_BLOCKS = 512
"""Receive buffers kept for reuse per adapter (512 MiB of them at most, ``RecvBuffers``'s default)."""
_COMPARE_AND_DELETE = (
    "if redis.call('STRLEN', KEYS[1]) == string.len(ARGV[1]) and redis.call('GET', KEYS[1]) == ARGV[1] "
    "then return redis.call('DEL', KEYS[1]) end return 0"
)
"""Delete a head only if it still holds the manifest a reader found broken (never a newer write's head)."""
_TLS_SCHEMES = {"rediss", "valkeys"}
_PLAIN_SCHEMES = {"redis", "valkey"}
_CERT_REQS = {"required": "required", "optional": "optional", "none": "none"}


def _parse_cert_reqs(value: object) -> str:
    low = parse_str(value).strip().lower()
    if low not in _CERT_REQS:
        raise ValueError(f"invalid ssl_cert_reqs {value!r}: use required, optional or none")
    return _CERT_REQS[low]


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """Options of ``redis://`` / ``valkey://`` (and TLS, cluster) URLs: query string or keywords."""

    password: str | None = None
    """Server password (use ``password_env`` in config files)."""
    username: str | None = None
    """ACL user name (default: the URL's user part)."""
    pool_size: Annotated[int, Range(1, 1024)] = DEFAULT_POOL_SIZE
    """Connections per adapter."""
    socket_timeout: Annotated[float, Range(0.001, 3600)] = DEFAULT_SOCKET_TIMEOUT
    """Seconds one whole call may take: connecting, or sending a request and reading its answer."""
    ttl: Annotated[float, Range(0.001, 315_360_000)] | None = None
    """Seconds after which stored objects expire (at most ten years; None: never)."""
    prefix: str = DEFAULT_PREFIX
    """Prepended to every key."""
    capacity: Annotated[Size, Range(0, MAX_SIZE)] | None = None
    """Bytes this tier may hold (None: the server's own limit)."""
    part_size: Annotated[Size, Range(0, MAX_VALUE_BYTES)] = DEFAULT_PART_SIZE
    """Values over this many bytes are stored as parts of this size (0: never; else at least 1024)."""
    ssl_ca_certs: str | None = None
    """TLS only: CA bundle path."""
    ssl_certfile: str | None = None
    """TLS only: client certificate path."""
    ssl_keyfile: str | None = None
    """TLS only: client key path."""
    ssl_cert_reqs: str | None = field(default=None, metadata={"parse": _parse_cert_reqs})
    """TLS only: required (default), optional or none."""


def _translate(exc: BaseException, where: str) -> AdapterError:
    """The tiercache error for a redis-py/OS error (transport failures only)."""
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, rexc.TimeoutError | asyncio.TimeoutError | TimeoutError):
        return AdapterTimeout(f"{where}: no answer within the socket timeout: {exc}")
    return AdapterUnavailable(f"{where}: {type(exc).__name__}: {exc}")


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a ``SCAN MATCH`` glob pattern."""
    return "".join("\\" + c if c in "\\*?[]" else c for c in text)


def _wrong_type(reply: object) -> bool:
    """Whether ``reply`` is the server's WRONGTYPE error: the key holds a list, hash, set... not a string."""
    return isinstance(reply, rexc.ResponseError | RespError) and str(reply).startswith("WRONGTYPE")


class _Foreign:
    """A key under the prefix that holds no value of ours (another type, or a string over the limit)."""


_FOREIGN = _Foreign()


def _value_or_none(reply: object) -> bool:
    """Whether ``reply`` is what a GET of a string can get: bytes (a view from the RESP client) or nil."""
    return reply is None or isinstance(reply, bytes | memoryview)


def _unexpected(where: str, what: str, reply: object) -> AdapterUnavailable:
    shown = reply[:64] if isinstance(reply, bytes | bytearray) else reply
    return AdapterUnavailable(f"{where}: unexpected reply to {what}: {type(reply).__name__} {shown!r:.100}")


# RedisClusterException (and its SlotNotCoveredError, ...) does not derive from RedisError.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    rexc.RedisError,
    rexc.RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)


_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class _Common:
    """Options shared by the standalone and cluster adapters (parsed once in ``_parse_url``)."""

    def __init__(self, scheme: str, opts: RedisOptions) -> None:
        self.tls = scheme.split("+")[0] in _TLS_SCHEMES
        self.prefix: str = opts.prefix
        check_options(opts, scheme)  # the declared ranges, for options built in code too
        ttl = opts.ttl
        self.ttl_ms: int | None = None if ttl is None else max(1, round(ttl * 1000))
        self.pool_size: int = opts.pool_size
        self.socket_timeout: float = opts.socket_timeout
        self.capacity: int | None = opts.capacity
        self.part_size: int = opts.part_size
        if self.part_size != 0 and not 1024 <= self.part_size <= MAX_VALUE_BYTES:
            raise ConfigError(
                f"{scheme}: option 'part_size' must be 0 (never split) or 1024 to {MAX_VALUE_BYTES} bytes, "
                f"got {self.part_size}"
            )
        ssl_keys = {k for k in (*_SSL_OPTIONS, "ssl_cert_reqs") if getattr(opts, k) is not None}
        if ssl_keys and not self.tls:
            raise ConfigError(
                f"{scheme}: option(s) {', '.join(sorted(ssl_keys))} need a TLS URL (rediss:// or valkeys://)"
            )

    def connection_kwargs(self, opts: RedisOptions, username: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "username": opts.username if opts.username is not None else username,
            "password": opts.password,
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            # One immediate retry for a reset/stale connection; never for a timeout (it would double it).
            "retry": Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
            # RESP2, the replies this module reads: no HELLO to negotiate (redis-py would send HELLO 3 and
            # parse whatever answers it; a server without HELLO got a warning per connection).
            "protocol": 2,
        }
        if self.tls:
            kwargs["ssl_cert_reqs"] = {
                "required": ssl.CERT_REQUIRED,
                "optional": ssl.CERT_OPTIONAL,
                "none": ssl.CERT_NONE,
            }[opts.ssl_cert_reqs or "required"]
            for name in _SSL_OPTIONS:
                if getattr(opts, name) is not None:
                    kwargs[name] = getattr(opts, name)
        return kwargs


def _split_url(
    url: str, schemes: set[str], adapter: str
) -> tuple[str, str, list[tuple[str, int]], str | None, int]:
    """(scheme, query, [(host, port)], username, db) of a Redis URL; ConfigError if malformed."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        raise ConfigError(f"{adapter}: expected a {'/'.join(sorted(schemes))}:// URL, got {url!r}")
    netloc = parts.netloc
    username: str | None = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        if ":" in userinfo:
            raise ConfigError(
                f"{adapter}: no password in the URL; pass it as option "
                "'password' (in a config file: password_env = \"VAR\")"
            )
        username = unquote(userinfo) or None
    hosts: list[tuple[str, int]] = []
    for item in netloc.split(",") if netloc else []:
        host, sep, port_s = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not sep:
            host, port_s = item, "6379"
        host = host.strip("[]")
        try:
            port = int(port_s)
        except ValueError:
            raise ConfigError(f"{adapter}: invalid port {port_s!r} in {url!r}") from None
        if not host or not 0 < port < 65536:
            raise ConfigError(f"{adapter}: invalid host:port {item!r} in {url!r}")
        hosts.append((host, port))
    if not hosts:
        hosts = [("localhost", 6379)]
    path = parts.path.strip("/")
    try:
        db = int(path) if path else 0
    except ValueError:
        raise ConfigError(f"{adapter}: the URL path must be a database number, got {parts.path!r}") from None
    return scheme, parts.query, hosts, username, db


class RedisAdapter(Adapter):
    """A standalone Redis or Valkey server (``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``)."""

    scheme: ClassVar[str] = "redis"
    capabilities: ClassVar[Capabilities] = Capabilities(
        persistent=True, shared=True, delete=True, ttl=True, max_value_bytes=MAX_VALUE_BYTES, list_keys=True
    )
    _schemes: ClassVar[set[str]] = _PLAIN_SCHEMES | _TLS_SCHEMES

    def __init__(self, client: Any, common: _Common, name: str) -> None:
        """Use an opened ``redis.asyncio`` client (``open`` builds it); ``name`` labels errors."""
        self._client = client
        self._common = common
        self.prefix = common.prefix
        self.ttl_ms = common.ttl_ms
        self.name = name
        self._closed = False
        self._mean_hit_bytes = 0.0
        self._resp: RespPool | None = None
        """Plain-TCP standalone servers: the zero-copy path for values over ``PIPELINE_VALUE_BYTES``."""
        self.part_size = common.part_size
        self._read_lanes = asyncio.Semaphore(PART_READS_IN_FLIGHT)
        self._value_lanes = asyncio.Semaphore(GET_VALUES_IN_FLIGHT)
        self._put_lanes = asyncio.Semaphore(PUT_VALUES_IN_FLIGHT)
        self._put_lane_count = PUT_VALUES_IN_FLIGHT
        """Lanes a batch's large values are split into (``_put_lanes`` of them in flight)."""
        self._lane_threads = True
        """A batch's put lanes go to the RESP client's ``pipelines`` together (False: one ``pipeline`` call
        per lane, as ``benchmarks/vs_lmcache_resp.py --variants`` times beside it)."""
        self._write_lanes = asyncio.Semaphore(PART_WRITES_IN_FLIGHT)
        self._recv = RecvBuffers(min_bytes=PIPELINE_VALUE_BYTES + 1, max_blocks=RECV_BLOCKS)
        """Receive buffers of large values (GETs over ``PIPELINE_VALUE_BYTES``, parted reads), reused once the
        caller has dropped every view of one (a fresh 1 MiB buffer's page faults cost more than its
        receive)."""
        self.stats: dict[str, int] = {
            "parts_missing": 0,
            "parts_stale": 0,
            "bad_manifests": 0,
            "foreign_keys": 0,
        }
        """Reads that were misses: a parted object with a part gone (evicted, expired), a part of a rewrite
        in progress, a head that looks like a manifest and is none; a key under the prefix that holds no
        value of ours (a list, hash, set... or a string over ``MAX_VALUE_BYTES``), each time one is seen."""
        self._call_s = common.socket_timeout
        """Seconds one call through redis-py may take as a whole (its own timeout is per reply)."""

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Connect to the server of ``url`` and PING it (AdapterUnavailable if unreachable or refused)."""
        scheme, query, hosts, username, db = _split_url(url, cls._schemes, "redis")
        if len(hosts) != 1:
            raise ConfigError(
                f"redis: one host:port expected, got {url!r} (for a cluster use redis+cluster://)"
            )
        opts = parse_options(RedisOptions, "redis", query, options)
        common = _Common(scheme, opts)
        (host, port), kwargs = hosts[0], common.connection_kwargs(opts, username)
        if common.tls:
            kwargs["connection_class"] = aredis.SSLConnection
        pool = aredis.BlockingConnectionPool(
            host=host, port=port, db=db, max_connections=common.pool_size, timeout=None, **kwargs
        )
        client = aredis.Redis(connection_pool=pool)
        self = cls(client, common, f"{scheme}://{host}:{port}/{db}")
        if not common.tls:
            self._resp = RespPool(
                host,
                port,
                db=db,
                username=kwargs["username"],
                password=kwargs["password"],
                timeout=common.socket_timeout,
                size=common.pool_size,
                max_bulk=MAX_VALUE_BYTES,
                alloc=self._recv.take,
            )
        try:
            if await self._guard(client.ping()) is not True:  # redis-py: True for +PONG
                raise AdapterUnavailable(f"{self.name}: PING not answered +PONG: not a Redis server")
        except BaseException:
            await self._shutdown()
            raise
        return self

    # -- helpers ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"redis adapter {self.name} is closed")

    async def _guard(self, call: Awaitable[_T]) -> _T:
        """Await ``call``, translating transport errors into AdapterUnavailable/AdapterTimeout. Any other
        exception of a client (an error reply, or a reply it could not parse: a broken or hostile server)
        is AdapterUnavailable too: nothing but the project's errors leaves the adapter."""
        try:
            return await call
        except AdapterError:
            raise
        except _TRANSPORT_ERRORS as exc:
            if self._closed:
                raise AdapterUnavailable(f"redis adapter {self.name} is closed") from exc
            raise _translate(exc, self.name) from exc
        except Exception as exc:
            if self._closed:
                raise AdapterUnavailable(f"redis adapter {self.name} is closed") from exc
            raise AdapterUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    async def _bounded(self, call: Awaitable[_T]) -> _T:
        """Await one call through redis-py within ``socket_timeout`` as a whole (redis-py's own timeout is
        per reply: each reply of a pipeline may take that long again); TimeoutError past it."""
        async with asyncio.timeout(self._call_s):
            return await call

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self.prefix + check_key(k) for k in keys]

    async def _pipeline(self, build: Callable[[Any], object]) -> list[Any]:
        """Run one non-transactional pipeline (within ``socket_timeout`` as a whole); per-command errors
        come back as exception objects."""
        async with self._client.pipeline(transaction=False) as pipe:
            build(pipe)
            result: list[Any] = await self._bounded(pipe.execute(raise_on_error=False))
            return result

    @staticmethod
    async def _all(calls: Sequence[Awaitable[Any]]) -> list[Any]:
        """Await ``calls`` concurrently; a server refusal (``ResponseError``) comes back in place. At the
        first other exception the calls still running are cancelled (on a server that stopped answering
        each would wait out its own deadline: a parted value's parts, queued for the pool, one after
        another) and it is raised once every call has ended."""
        tasks = [asyncio.ensure_future(c) for c in calls]
        failed: BaseException | None = None
        try:
            pending: set[asyncio.Future[Any]] = set(tasks)
            while pending and failed is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    exc = None if task.cancelled() else task.exception()
                    if exc is not None and not isinstance(exc, rexc.ResponseError):
                        failed = exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if failed is not None:
            raise failed
        return [task.exception() or task.result() for task in tasks]

    def _raise_first(self, results: Sequence[Any]) -> None:
        for r in results:
            if isinstance(r, BaseException):
                raise _translate(r, self.name) from r

    def _set(self, target: Any, key: str, value: bytes | memoryview) -> Any:
        if self.ttl_ms is None:
            return target.set(key, value)
        return target.set(key, value, px=self.ttl_ms)

    # -- the adapter API -------------------------------------------------------------------------------

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether the server holds it now (one pipeline of EXISTS and GETRANGE); a key of
        another type is not contained (counted in ``foreign_keys``)."""
        self._check_open()
        full = self._keys(keys)
        if not full:
            return []
        return await self._guard(self._contains(full))

    async def _probe(self, probes: Sequence[tuple[str, int, int]]) -> list[Any]:
        """One pipeline of ``EXISTS key`` and ``GETRANGE key start end`` per (key, start, end): the replies,
        flat, errors in place. On plain TCP through the RESP client (replies checked, each bulk at most
        ``end - start + 1`` bytes), else redis-py."""
        if self._resp is None:
            return await self._pipeline(lambda p: [(p.exists(k), p.getrange(k, a, b)) for k, a, b in probes])
        commands: list[list[bytes | memoryview]] = []
        for k, a, b in probes:
            key = k.encode()
            commands += [[b"EXISTS", key], [b"GETRANGE", key, str(a).encode(), str(b).encode()]]
        longest = max(b - a + 1 for _, a, b in probes)
        return await self._resp.pipeline(commands, max_bulk=longest)

    async def _contains(self, full: Sequence[str]) -> list[bool]:
        results = await self._probe([(k, 0, MANIFEST_BYTES - 1) for k in full])
        found: list[bool] = []
        heads: dict[int, bytes] = {}
        for i, (exists, head) in enumerate(zip(results[0::2], results[1::2], strict=True)):
            if _wrong_type(head):
                self.stats["foreign_keys"] += 1
                found.append(False)
                continue
            self._raise_first((exists, head))
            if not isinstance(exists, int) or not isinstance(head, bytes):
                raise _unexpected(self.name, "EXISTS + GETRANGE", (exists, head))
            found.append(bool(exists))
            if exists and Manifest.looks_like(head):
                heads[i] = head
        if heads:
            manifests = {i: self._manifest(h) for i, h in heads.items()}
            whole = await self._parts_exist(full, manifests)
            for i in heads:
                found[i] = whole[i]
        return found

    def _manifest(self, head: bytes | memoryview) -> Manifest | None:
        """The manifest in a head that looks like one; None (counted) if it is corrupt."""
        manifest = Manifest.decode(head, MAX_VALUE_BYTES)
        if manifest is None:
            self.stats["bad_manifests"] += 1
        return manifest

    async def _parts_exist(
        self, full: Sequence[str], manifests: dict[int, Manifest | None]
    ) -> dict[int, bool]:
        """For each object index, whether every part of its manifest is on the server and of that write
        (its length and nonce, as a read checks them; one pipeline). An object with a part gone is counted
        in ``parts_missing`` and removed; one with a part of another write (or another type) in
        ``parts_stale`` (kept: a rewrite in progress), as a read would count them."""
        todo = [(i, m, m.part_keys(full[i])) for i, m in manifests.items() if m is not None]
        probes = [(k, b - a) for _, m, keys in todo for k, (a, b) in zip(keys, m.bounds(), strict=True)]
        results = await self._probe([(k, n, n + NONCE_BYTES) for k, n in probes]) if probes else []
        pairs: list[tuple[bool, bytes]] = []  # (exists, bytes from its nonce on)
        for exists, tail in zip(results[0::2], results[1::2], strict=True):
            if _wrong_type(tail):
                self.stats["foreign_keys"] += 1
                pairs.append((True, b""))  # there, and not of this write
                continue
            self._raise_first((exists, tail))
            if not isinstance(exists, int) or not isinstance(tail, bytes):
                raise _unexpected(self.name, "EXISTS + GETRANGE", (exists, tail))
            pairs.append((bool(exists), tail))
        whole = {i: False for i in manifests}
        at = 0
        for i, m, keys in todo:
            mine, at = pairs[at : at + len(keys)], at + len(keys)
            if not all(found for found, _ in mine):
                self.stats["parts_missing"] += 1
                await self._drop_broken(full[i], m)
            elif any(tail != m.nonce for _, tail in mine):  # another nonce, or another length
                self.stats["parts_stale"] += 1
            else:
                whole[i] = True
        return whole

    async def _drop_broken(self, head: str, manifest: Manifest) -> None:
        """Remove an object with a part gone: its head if it still holds ``manifest`` (never a newer write's
        head), then its parts. Best effort: a failure leaves them to TTL or eviction; the miss stands."""
        with contextlib.suppress(*_TRANSPORT_ERRORS):
            if await self._bounded(self._client.eval(_COMPARE_AND_DELETE, 1, head, manifest.encode())):
                await self._pipeline(lambda p: [p.delete(k) for k in manifest.part_keys(head)])

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, its bytes or None: one pipeline of MGETs for small values, else GETs one by one.

        The mode follows the sizes seen so far (a running mean of hit sizes): pipelined GETs of MiB-sized
        values measured slower than the same GETs one after another, while small values need the pipeline.
        A key of another type, or holding a string over ``MAX_VALUE_BYTES`` (refused before any of it is
        read), is a miss (counted in ``foreign_keys`` where the reply tells: a GET's, not an MGET's).
        """
        self._check_open()
        full = self._keys(keys)
        if not full:
            return []
        return await self._guard(self._get(full))

    async def _get(self, full: Sequence[str]) -> list[Buffer | None]:
        if len(full) == 1 or self._mean_hit_bytes > PIPELINE_VALUE_BYTES:
            results: list[Any] = await self._all([self._get_whole(k) for k in full])
            self._raise_first(results)
        else:
            results = await self._get_small(full)
            for i, r in enumerate(results):
                if r is not None and Manifest.looks_like(r):
                    results[i] = await self._resolve(full[i], r)
        self._learn_sizes([len(r) for r in results if r is not None])
        return results

    async def _get_whole(self, key: str) -> Any:
        """One large value: its GET (``GET_VALUES_IN_FLIGHT`` of a batch at once), then its parts if it is
        parted (sharing the part lanes with the batch's other values); None if absent or not ours."""
        async with self._value_lanes:
            value = await self._get_one(key)
        if value is _FOREIGN or value is None:
            return None
        return await self._resolve(key, value) if Manifest.looks_like(value) else value

    async def _resolve(self, head: str, value: Any) -> Buffer | None:
        """A head that looks like a manifest: the value it names (None: a miss, see ``_read_parts``)."""
        manifest = self._manifest(value)
        return None if manifest is None else await self._read_parts(head, manifest)

    async def _get_small(self, full: Sequence[str]) -> list[Any]:
        """Small values: one pipeline of ``MGET``s, each for about ``PIPELINE_BATCH_BYTES`` of values by the
        running mean (one command per group, not per key: 64 x 1 KiB and 64 x 64 KiB read 1.4-2x faster
        than a pipeline of GETs). A key of another type is a miss (MGET's nil)."""
        group = max(1, min(512, int(PIPELINE_BATCH_BYTES // max(self._mean_hit_bytes, 1.0))))
        groups = [full[i : i + group] for i in range(0, len(full), group)]
        replies: list[Any]
        if self._resp is not None:  # replies checked: as many values as keys, each within the limit
            try:
                replies = await self._resp.pipeline([[b"MGET", *(k.encode() for k in g)] for g in groups])
            except RespTooLarge:  # a string over the limit: one GET each finds which (a miss, counted)
                found = [await self._get_one(k) for k in full]
                return [None if r is _FOREIGN else r for r in found]
        else:
            replies = await self._pipeline(lambda p: [p.mget(g) for g in groups])
        self._raise_first(replies)
        values: list[Any] = []
        for g, reply in zip(groups, replies, strict=True):
            if not isinstance(reply, list) or len(reply) != len(g) or not all(map(_value_or_none, reply)):
                raise _unexpected(self.name, f"MGET of {len(g)} keys", reply)
            values += reply
        return values

    async def _read_parts(self, head: str, manifest: Manifest) -> Buffer | None:
        """The whole value of a parted object, its parts read concurrently into one buffer. None if a part
        is missing (counted in ``parts_missing``; the object is removed) or is of another write, by its
        nonce or its length, or of another type (counted in ``parts_stale``; kept: a rewrite in progress,
        whose head is next)."""
        whole = self._recv.take(manifest.total)
        keys = manifest.part_keys(head)

        async def read(k: str, into: memoryview) -> bytes | None:
            async with self._read_lanes:
                return await self._get_into(k, into)

        calls = [read(k, whole[a:b]) for k, (a, b) in zip(keys, manifest.bounds(), strict=True)]
        tails = await self._all(calls)
        self._raise_first(tails)
        if all(t == manifest.nonce for t in tails):
            return whole
        if any(t is None for t in tails):
            self.stats["parts_missing"] += 1
            await self._drop_broken(head, manifest)
        else:
            self.stats["parts_stale"] += 1
        return None

    async def _get_into(self, key: str, into: memoryview) -> bytes | None:
        """GET ``key``, a value of ``into``'s size plus a nonce, into ``into``; its nonce, ``b""`` if it is
        of another size or type, None if absent."""
        if self._resp is not None:
            try:
                return await self._resp.get_into(key.encode(), into, NONCE_BYTES)
            except RespError as exc:
                if not _wrong_type(exc):
                    raise
                self.stats["foreign_keys"] += 1
                return b""
        value = await self._get_one(key)
        if value is _FOREIGN:
            return b""
        if value is None or len(value) != into.nbytes + NONCE_BYTES:
            return None if value is None else b""
        view = memoryview(value).cast("B")
        into[:] = view[: into.nbytes]
        return bytes(view[into.nbytes :])

    def _learn_sizes(self, sizes: Sequence[int]) -> None:
        """Fold the sizes of values just read or written into the running mean that picks the get mode."""
        if sizes:
            self._mean_hit_bytes = 0.75 * self._mean_hit_bytes + 0.25 * (sum(sizes) / len(sizes))

    async def _get_one(self, key: str) -> Any:
        """GET ``key``: its value, None if absent, ``_FOREIGN`` (counted) if it holds another type or a
        string over ``MAX_VALUE_BYTES``."""
        try:
            if self._resp is not None:
                return await self._resp.get(key.encode())
            value = await self._bounded(self._client.get(key))
        except (RespError, rexc.ResponseError) as exc:
            if not _wrong_type(exc):
                raise
        except RespTooLarge:
            pass
        else:
            if not _value_or_none(value):
                raise _unexpected(self.name, "GET", value)
            return value
        self.stats["foreign_keys"] += 1
        return _FOREIGN

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """SET each value (small ones pipelined, large ones concurrently, each its own SET, up to
        ``PUT_VALUES_IN_FLIGHT`` at a time); False if over 512 MiB or OOM."""
        self._check_open()
        check_lengths(keys, values)
        full = self._keys(keys)
        data = [as_readable_bytes(v) for v in values]
        self._learn_sizes([v.nbytes for v in data])  # what a tier writes is what it is asked for later
        return await self._guard(self._put(full, data))

    async def _put(self, full: Sequence[str], data: Sequence[memoryview]) -> list[bool]:
        out = [False] * len(full)
        small: list[int] = []
        small_bytes = 0

        async def flush() -> None:
            nonlocal small, small_bytes
            if not small:
                return
            todo, small, small_bytes = small, [], 0
            for i, ok in zip(todo, await self._peek_set_drop(full, data, todo), strict=True):
                out[i] = ok

        large: list[int] = []
        whole: list[int] = []  # large values stored whole, on the RESP client: pipelined in lanes
        for i, value in enumerate(data):
            size = memoryview(value).nbytes
            if size > MAX_VALUE_BYTES:
                continue
            if size > PIPELINE_VALUE_BYTES or self._parted(value):
                (whole if self._resp is not None and not self._parted(value) else large).append(i)
                continue
            small.append(i)
            small_bytes += size
            if small_bytes >= PIPELINE_BATCH_BYTES:
                await flush()
        await flush()
        lanes = self._lanes(whole, [data[i].nbytes for i in whole], self._put_lane_count)

        async def lane(todo: list[int]) -> list[bool]:
            async with self._put_lanes:
                return await self._peek_set_drop(full, data, todo, pace=True)

        if large or lanes:
            # the lanes to the RESP client's threads together where they run at once; more lanes than that
            # queue for ``_put_lanes`` one call each, a lane starting as soon as another ended (no group
            # waiting for its slowest lane)
            threaded = self._lane_threads and 1 < len(lanes) <= self._put_lane_count
            results = await self._all(
                [
                    *(self._put_large(full[i], data[i]) for i in large),
                    *(
                        [self._peek_set_lanes(full, data, lanes)]
                        if threaded
                        else (lane(todo) for todo in lanes)
                    ),
                ]
            )
            lane_oks = results[len(large)] if threaded else results[len(large) :]
            for i, r in zip(large, results, strict=False):
                out[i] = self._put_result(r)
            for todo, oks in zip(lanes, lane_oks, strict=True):
                for i, ok in zip(todo, oks, strict=True):
                    out[i] = ok
        return out

    async def _peek_set_lanes(
        self, full: Sequence[str], data: Sequence[memoryview], lanes: list[list[int]]
    ) -> list[list[bool]]:
        """``_peek_set_drop`` of each of ``lanes`` at once through the RESP client's ``pipelines`` (its
        threads send every lane; one event-loop wake-up for all), then one drop of what they replaced."""
        assert self._resp is not None
        replies = await self._resp.pipelines(
            [self._peek_set_commands([full[i] for i in todo], [data[i] for i in todo]) for todo in lanes],
            max_bulk=MANIFEST_BYTES,
            pace=2,
        )
        out: list[list[bool]] = []
        replaced: list[tuple[str, Any]] = []
        for todo, lane in zip(lanes, replies, strict=True):
            results = self._resp_results(lane)
            oks = [self._put_result(r) for r in results[1::2]]
            replaced += [(full[i], old) for i, old, ok in zip(todo, results[0::2], oks, strict=True) if ok]
            out.append(oks)
        await self._drop_replaced(replaced)
        return out

    @staticmethod
    def _lanes(indexes: list[int], sizes: list[int], count: int) -> list[list[int]]:
        """``indexes`` in runs of about an even share of their bytes per lane (``count`` lanes), at most
        ``PUT_PIPELINE_BYTES`` each (one value at least)."""
        share = min(PUT_PIPELINE_BYTES, -(-sum(sizes) // count))
        lanes: list[list[int]] = []
        held = 0
        for i, size in zip(indexes, sizes, strict=True):
            if not lanes or (held and held + size > share):
                lanes.append([])
                held = 0
            lanes[-1].append(i)
            held += size
        return lanes

    async def _peek_set_drop(
        self, full: Sequence[str], data: Sequence[memoryview], todo: Sequence[int], pace: bool = False
    ) -> list[bool]:
        """Put values ``todo`` (indexes into ``full`` and ``data``) in one pipeline (``_peek_and_set``), then
        drop the parts of the manifests they replaced: True for each stored, False for each refused (OOM)."""
        results = await self._peek_and_set([full[i] for i in todo], [data[i] for i in todo], pace)
        oks = [self._put_result(r) for r in results[1::2]]
        replaced = [(full[i], old) for i, old, ok in zip(todo, results[0::2], oks, strict=True) if ok]
        await self._drop_replaced(replaced)
        return oks

    async def _peek_and_set(
        self, keys: Sequence[str], values: Sequence[memoryview], pace: bool = False
    ) -> list[Any]:
        """One pipeline of ``GETRANGE`` (a key's first ``MANIFEST_BYTES``) then ``SET`` per key: (old head,
        SET result) pairs, flat; per-command errors in place. On plain TCP through the RESP client (its
        replies parse at a fraction of redis-py's cost per command), else redis-py."""
        if self._resp is None:
            return await self._pipeline(
                lambda p: [
                    (p.getrange(k, 0, MANIFEST_BYTES - 1), self._set(p, k, v))
                    for k, v in zip(keys, values, strict=True)
                ]
            )
        commands = self._peek_set_commands(keys, values)
        replies = await self._resp.pipeline(commands, max_bulk=MANIFEST_BYTES, pace=2 if pace else 0)
        return self._resp_results(replies)

    def _peek_set_commands(
        self, keys: Sequence[str], values: Sequence[memoryview]
    ) -> list[list[bytes | memoryview]]:
        """``GETRANGE`` (a key's first ``MANIFEST_BYTES``) then ``SET`` per key, as RESP client commands."""
        px = [] if self.ttl_ms is None else [b"PX", str(self.ttl_ms).encode()]
        peek = str(MANIFEST_BYTES - 1).encode()
        commands: list[list[bytes | memoryview]] = []
        for k, v in zip(keys, values, strict=True):
            key = k.encode()
            commands += [[b"GETRANGE", key, b"0", peek], [b"SET", key, v, *px]]
        return commands

    @staticmethod
    def _resp_results(replies: Sequence[object]) -> list[Any]:
        """A ``GETRANGE`` + ``SET`` pipeline's RESP client replies as redis-py's: (old head, SET result)
        pairs, flat; an error reply as ``ResponseError`` in place."""
        return [
            rexc.ResponseError(str(r)) if isinstance(r, RespError) else (r == b"OK" if i % 2 else r)
            for i, r in enumerate(replies)
        ]

    def _parted(self, value: memoryview) -> bool:
        """Whether ``value`` is stored as parts: over ``part_size``, or starting like a manifest."""
        return bool(self.part_size and value.nbytes > self.part_size) or Manifest.looks_like(value)

    async def _put_large(self, key: str, value: memoryview) -> Any:
        """One SET (then the parts of a parted value it replaced are dropped), or a parted write."""
        if self._parted(value):
            return await self._put_parts(key, value)
        if self._resp is not None:  # GETRANGE + SET on one connection, one round trip
            try:
                async with self._put_lanes:
                    old: Any = await self._resp.replace(key.encode(), value, self.ttl_ms, peek=MANIFEST_BYTES)
            except RespError as exc:
                return rexc.ResponseError(str(exc))
        else:  # the head before the SET (concurrently, the GETRANGE could run after it)
            old = await self._old_head(key)
            written = await self._set_one(key, value)
            if written is not True:
                return written
        await self._drop_replaced([(key, old)])
        return True

    async def _old_head(self, head: str) -> Any:
        """The first ``MANIFEST_BYTES`` of ``head`` as it was before a put (a manifest names its parts), or
        the exception that read raised (then nothing is dropped)."""
        try:
            return (await self._pipeline(lambda p: p.getrange(head, 0, MANIFEST_BYTES - 1)))[0]
        except _TRANSPORT_ERRORS as exc:
            return exc

    async def _drop_replaced(self, replaced: Sequence[tuple[str, Any]], keep: int = 0) -> None:
        """After a put of each head: delete the parts past ``keep`` of the manifest it replaced (``old``: its
        first bytes, as ``_old_head`` read them). Best effort: a failure leaves them to TTL or eviction."""
        extra = [
            k
            for head, old in replaced
            if isinstance(old, bytes | memoryview)  # not an error (another type, a failed read)
            and (previous := Manifest.decode(old, MAX_VALUE_BYTES)) is not None
            for k in previous.part_keys(head, start=keep)
        ]
        if extra:
            with contextlib.suppress(*_TRANSPORT_ERRORS):
                await self._pipeline(lambda p: [p.delete(k) for k in extra])

    async def _put_parts(self, head: str, value: memoryview) -> Any:
        """Write the parts (each followed by the nonce) concurrently, then the head, so no reader sees a
        part alone; then drop the parts past the new count that the replaced manifest had. A refused part
        (OOM) drops the parts and is returned."""
        manifest = Manifest.new(value.nbytes, self.part_size or max(value.nbytes, 1))
        keys = manifest.part_keys(head)

        async def write(k: str, part: memoryview) -> Any:
            async with self._write_lanes:
                return await self._set_one(k, part, manifest.nonce)

        writes = [write(k, value[a:b]) for k, (a, b) in zip(keys, manifest.bounds(), strict=True)]
        *written, old = await self._all([*writes, self._old_head(head)])
        refused = next((r for r in written if r is not True), None)
        if refused is None:
            refused = r = await self._set_one(head, manifest.encode())
            if r is True:
                refused = None
        if refused is not None:
            await self._pipeline(lambda p: [p.delete(k) for k in keys])
            return refused
        await self._drop_replaced([(head, old)], keep=manifest.count)
        return True

    async def _set_one(self, key: str, value: bytes | memoryview, tail: bytes = b"") -> Any:
        """One SET of ``value`` followed by ``tail``; a refusal by the server (e.g. OOM) is returned, not
        raised."""
        try:
            if self._resp is not None:
                return await self._resp.set(key.encode(), memoryview(value), self.ttl_ms, tail)
            return await self._bounded(self._set(self._client, key, bytes(value) + tail if tail else value))
        except rexc.ResponseError as exc:
            return exc
        except RespError as exc:
            return rexc.ResponseError(str(exc))

    def _put_result(self, r: Any) -> bool:
        """True for OK; False for a refused SET (OOM); raise for a transport error."""
        if isinstance(r, rexc.ResponseError) and not isinstance(r, rexc.ConnectionError):
            if str(r).startswith(("OOM", "command not allowed")) or isinstance(r, rexc.OutOfMemoryError):
                return False
            raise _translate(r, self.name) from r
        if isinstance(r, BaseException):
            raise _translate(r, self.name) from r
        return bool(r)

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """DEL each key (one pipeline); True where it existed (a key of another type too: it is deleted)."""
        self._check_open()
        full = self._keys(keys)
        if not full:
            return []
        return await self._guard(self._delete(full))

    async def _delete(self, full: Sequence[str]) -> list[bool]:
        results = await self._pipeline(
            lambda p: [(p.getrange(k, 0, MANIFEST_BYTES - 1), p.delete(k)) for k in full]
        )
        heads = [b"" if _wrong_type(h) else h for h in results[0::2]]  # another type: no manifest
        self._raise_first([*heads, *results[1::2]])
        if not all(isinstance(h, bytes) for h in heads) or not all(isinstance(r, int) for r in results[1::2]):
            raise _unexpected(self.name, "GETRANGE + DEL", results)
        parts = [
            k
            for head, h in zip(full, heads, strict=True)
            if (m := Manifest.decode(h, MAX_VALUE_BYTES)) is not None
            for k in m.part_keys(head)
        ]
        if parts:
            self._raise_first(await self._pipeline(lambda p: [p.delete(k) for k in parts]))
        return [bool(r) for r in results[1::2]]

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """``SCAN MATCH <tier prefix><prefix>*`` (``COUNT`` ``SCAN_COUNT``) on the server (cluster: on every
        primary), one batch per reply; the tier prefix is taken off and part keys are skipped."""
        self._check_open()
        pattern = _glob_escape(self.prefix + prefix) + "*"
        skip = len(self.prefix)
        for node in self._scan_nodes():
            cursor = 0
            while True:
                cursor, names = await self._guard(self._bounded(self._scan(node, cursor, pattern)))
                batch: list[str] = []
                for name in names:
                    text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
                    if is_key(key := text[skip:]):  # a part (``<key>#<n>``) is no key
                        batch.append(key)
                if batch:
                    yield batch
                if not cursor:
                    break

    def _scan_nodes(self) -> list[Any]:
        """The nodes a listing scans (None: the one server)."""
        return [None]

    async def _scan(self, node: Any, cursor: int, pattern: str) -> tuple[int, list[Any]]:
        """One ``SCAN`` step on ``node``: the next cursor (0 at the end) and the names it returned."""
        cursor, names = await self._client.scan(cursor=cursor, match=pattern, count=SCAN_COUNT)
        return int(cursor), list(names)

    async def _shutdown(self) -> None:
        if self._resp is not None:
            self._resp.close()
        with contextlib.suppress(*_TRANSPORT_ERRORS):
            await self._client.aclose()

    def add_expiry_listener(self, fn: Callable[[str, Sequence[str]], None]) -> Callable[[], None]:
        """Call ``fn("expired", keys)`` for the objects the server expires (``ttl``), as it announces them
        (``adapters/redis_expiry.py``); returns a function that stops it."""
        from tiercache.adapters.redis_expiry import watch_expiry

        return watch_expiry(self, fn)

    async def aclose(self) -> None:
        """Close the client and its pool; idempotent. Later calls raise AdapterUnavailable."""
        if self._closed:
            return
        self._closed = True
        await self._shutdown()


class RedisClusterAdapter(RedisAdapter):
    """A Redis (or Valkey) cluster: ``redis+cluster://host:port[,host:port...]``."""

    scheme: ClassVar[str] = "redis+cluster"
    _schemes: ClassVar[set[str]] = {f"{s}+cluster" for s in _PLAIN_SCHEMES | _TLS_SCHEMES}

    def __init__(self, client: Any, common: _Common, name: str) -> None:
        super().__init__(client, common, name)
        self._slots = asyncio.Semaphore(common.pool_size)
        self._stale_slots = False

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Connect to the cluster through its startup nodes and load the slot map."""
        scheme, query, hosts, username, db = _split_url(url, cls._schemes, "redis+cluster")
        if db != 0:
            raise ConfigError(f"redis+cluster: a cluster has only database 0, got {url!r}")
        opts = parse_options(RedisOptions, "redis+cluster", query, options)
        common = _Common(scheme, opts)
        kwargs = common.connection_kwargs(opts, username)
        # The cluster client retries every error of RedisCluster.ERRORS_ALLOW_RETRY, timeouts included, as
        # often as its Retry allows (a paused master cost 3x the socket timeout): no retries at that level.
        kwargs["retry"] = Retry(NoBackoff(), 0)
        if common.tls:
            kwargs["ssl"] = True
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in hosts],
            max_connections=max(common.pool_size, 1),
            require_full_coverage=True,
            **kwargs,
        )
        self = cls(client, common, f"{scheme}://{','.join(f'{h}:{p}' for h, p in hosts)}")
        try:
            await self._guard(client.initialize())
        except BaseException:
            await self._shutdown()
            raise
        return self

    async def _guard(self, call: Awaitable[_T]) -> _T:
        """Like the plain adapter's; after a connection or cluster error the next call reloads the slot map
        first (with no client retries redis-py would not), so a replica promoted by a failover is found."""
        if self._stale_slots:
            self._stale_slots = False
            with contextlib.suppress(Exception):  # still failing over: the call below fails as it would
                await self._client.nodes_manager.initialize()
        try:
            return await super()._guard(call)
        except AdapterUnavailable:
            self._stale_slots = True
            raise

    async def _pipeline(self, build: Callable[[Any], object]) -> list[Any]:
        async with self._slots:
            pipe = self._client.pipeline()
            build(pipe)
            result: list[Any] = await self._bounded(pipe.execute(raise_on_error=False))
            return result

    async def _set_one(self, key: str, value: bytes | memoryview, tail: bytes = b"") -> Any:
        async with self._slots:
            return await super()._set_one(key, value, tail)

    async def _get_small(self, full: Sequence[str]) -> list[Any]:
        """One cluster pipeline of GETs (an MGET across slots is refused; redis-py splits it per node); a
        key of another type is a miss (counted in ``foreign_keys``)."""
        results = await self._pipeline(lambda p: [p.get(k) for k in full])
        out: list[Any] = []
        for r in results:
            if _wrong_type(r):
                self.stats["foreign_keys"] += 1
                r = None
            self._raise_first((r,))
            if not _value_or_none(r):
                raise _unexpected(self.name, "GET", r)
            out.append(r)
        return out

    async def _get_one(self, key: str) -> Any:
        async with self._slots:
            return await super()._get_one(key)

    def _scan_nodes(self) -> list[Any]:
        """Every primary of the cluster (each holds its own slots' keys)."""
        return list(self._client.get_primaries())

    async def _scan(self, node: Any, cursor: int, pattern: str) -> tuple[int, list[Any]]:
        cursors, names = await self._client.scan(
            cursor=cursor, match=pattern, count=SCAN_COUNT, target_nodes=node
        )
        return int(cursors[node.name]), list(names)
