"""``mooncake://master-host:port``: frames as objects of a Mooncake distributed store.

The adapter is a Mooncake store client. By default it contributes no memory (``segment_size=0``): objects live
in the global segments of other store clients (e.g. ``mooncake_client --global_segment_size=...`` next to the
master), so they survive closing and reopening the adapter, but Mooncake evicts them when the segments fill up
(an evicted object is a miss) and they are lost when the master restarts.

URL and options::

    mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&protocol=tcp&segment_size=0

* ``metadata``: the transfer-engine metadata server (URL of the master's built-in HTTP metadata server,
  ``http://host:port/metadata``, or ``etcd://…``). Default ``http://<master host>:8080/metadata``.
* ``protocol``: ``tcp`` (default) or ``rdma``; ``rdma_devices``: RDMA device list (default empty).
* ``local_hostname``: the address this client advertises (default ``127.0.0.1`` when the master is on
  loopback, else required). Unless ``MC_TCP_BIND_ADDRESS`` is already set in the environment, the adapter
  sets it to ``local_hostname`` before ``setup`` so the TCP transport advertises only that address.
* ``segment_size``: bytes of this process's memory lent to the store (default 0). Objects placed there
  disappear when the adapter closes.
* ``buffer_size``: bytes of the client's transfer buffer (default 256 MiB) and of the adapter's registered
  put staging buffer (the same size). An object must fit in it with its 1-byte trailer: larger puts
  return ``False`` (nothing is stored), so the largest value is ``buffer_size - 1``.
* ``timeout``: seconds a call may take (default 5). Mooncake's client retries a dead master for about 4.3 s
  per call; past ``timeout`` a call raises ``AdapterTimeout`` (the blocked worker thread finishes later).
* ``workers``: threads running Mooncake's blocking calls (default 4). ``capacity``: accepted and ignored.
Unknown options raise ``ConfigError`` naming them.

Stored format: each object is the value followed by one trailer byte (``0x01``). Mooncake refuses empty
objects, and the trailer makes every value (including ``b""``) storable; an object without the trailer (not
written by this adapter) is a miss. The trailer costs no extra copy: values are copied into the registered
staging buffer anyway.

How calls map onto Mooncake (API behaviours pinned by ``tests/integration/test_mooncake.py``):

* put: copy into the registered staging buffer, then ``batch_upsert_from`` (one batch per staging fill).
  Mooncake's ``put`` on an existing key returns 0 but KEEPS the old value; ``upsert`` replaces it, as the
  Adapter contract requires. A refused put (no space, value too big) is ``False``.
* get: ``batch_get_buffer`` (one master query; data lands in the client buffer) and one copy out to
  ``bytes``. A ``None`` handle is disambiguated by ``batch_is_exist``: absent = miss; error =
  ``AdapterUnavailable``; present = the batch did not fit the client buffer at once, so that key is read
  alone with ``get_buffer`` (still unreadable, e.g. larger than the client buffer = miss). (``get``/
  ``get_batch`` return ``b""`` both for a miss and for a dead master, so they are not used.)
* contains: ``batch_is_exist``. delete: ``batch_remove(force=True)``: an unforced remove fails with
  ``OBJECT_HAS_LEASE`` (-706) for ``default_kv_lease_ttl`` (10 s) after any read.

Errors: RPC/metadata failures (Mooncake codes -900..-1099, e.g. -900 ``RPC_FAIL`` with the master down) raise
``AdapterUnavailable``; a call past ``timeout`` raises ``AdapterTimeout`` (its Mooncake call keeps
running in its thread and may still complete once the master is back: a timed-out put may land later).
``open`` first probes the master and an HTTP metadata server with a TCP connect (Mooncake's ``setup`` would
retry an unreachable master for minutes), and the master must also close a connection that sent it a bad RPC
header: Mooncake's ``setup`` holds the GIL while it retries (20 RPCs of 30 s each,
``MC_RPC_TIMEOUT_MS``), freezing the whole process, so a master that accepts connections but never answers
must be caught before it. An unreachable or mute master fails at ``open`` within 2 s per probe. (A master
that goes mute between the probe and ``setup`` can still freeze the process; calls after ``open`` release
the GIL and are bounded by ``timeout``.) With
``segment_size=0``, ``open`` then puts (and removes) a 1-byte probe object: a store with no segment memory to
place it in (no store client lends any) fails ``open`` with ``AdapterUnavailable`` naming the two fixes
(``mooncake_client --global_segment_size=...`` or the ``segment_size`` option). The client
reconnects by itself when the master comes back (seconds), so the same adapter recovers. After ``aclose``
every call raises ``AdapterUnavailable``; ``aclose`` is idempotent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import numpy as np
from mooncake.store import MooncakeDistributedStore

from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_lengths
from tiercache.adapters.options import MAX_SIZE, Range, Size, parse_options, parse_str
from tiercache.buffers import as_readable_bytes
from tiercache.errors import AdapterError, AdapterTimeout, AdapterUnavailable, ConfigError

if TYPE_CHECKING:
    from typing import Self

__all__ = ["MooncakeAdapter", "MooncakeOptions"]

_T = TypeVar("_T")

TRAILER = b"\x01"
DEFAULT_BUFFER_SIZE = 256 << 20
DEFAULT_TIMEOUT = 5.0
DEFAULT_WORKERS = 4
DEFAULT_METADATA_PORT = 8080
LOCAL_BUFFER_SLACK = 4 << 20
"""The client transfer buffer is ``buffer_size`` plus this, so an object of the largest size can be read."""

NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
BAD_RPC_HEADER = bytes(32)
"""Sent by the ``open`` probe: not a coro_rpc header, so a live master closes the connection at once."""


def _check_placement(store: Any, master: str) -> None:
    """With no memory of its own, make sure the store can place an object (else say how to give it some)."""
    key = f"tiercache-placement-probe.{os.getpid()}.{threading.get_ident()}"
    rc = store.put(key, TRAILER)
    if rc == 0:
        store.batch_remove([key], True)
        return
    if rc == NO_AVAILABLE_HANDLE:
        raise AdapterUnavailable(
            f"mooncake: the store at {master} has no segment memory to place objects in (a probe put got "
            "NO_AVAILABLE_HANDLE, -200): run a store client that lends memory, e.g. "
            f"`mooncake_client --master_server_address={master} --global_segment_size=4GB ...`, or give "
            'this adapter memory of its own with the option segment_size (e.g. segment_size = "4GiB"; '
            "objects placed there are lost when the adapter closes)"
        )
    if _transport_code(rc):
        raise AdapterUnavailable(f"mooncake: probe put to {master} failed (code {rc})")


def _transport_code(rc: int) -> bool:
    """Whether a Mooncake error code means the master/metadata service cannot be reached."""
    return -1099 <= rc <= -900


def _parse_protocol(value: object) -> str:
    low = parse_str(value).strip().lower()
    if low not in ("tcp", "rdma"):
        raise ValueError(f"invalid protocol {value!r}: use tcp or rdma")
    return low


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """Options of ``mooncake://`` URLs (query string or keywords); each parsed from its type."""

    metadata: str | None = None
    """Metadata server URL (default: ``http://<master host>:8080/metadata``)."""
    protocol: str = field(default="tcp", metadata={"parse": _parse_protocol})
    """Transfer protocol: tcp or rdma."""
    rdma_devices: str = ""
    """RDMA devices (rdma only)."""
    local_hostname: str | None = None
    """This host's address for the transfer engine (default: 127.0.0.1 for a loopback master)."""
    segment_size: Annotated[Size, Range(0, 1 << 44)] = 0
    """Bytes of this client's memory segment lent to the store (0: none; at most 16 TiB)."""
    buffer_size: Annotated[Size, Range(2, 1 << 40)] = DEFAULT_BUFFER_SIZE
    """Bytes of the transfer buffer (the largest value is ``buffer_size - 1``; 2 bytes to 1 TiB)."""
    timeout: Annotated[float, Range(0.001, 3600)] = DEFAULT_TIMEOUT
    """Seconds per store call (1 ms to an hour)."""
    workers: Annotated[int, Range(1, 1024)] = DEFAULT_WORKERS
    """Threads running store calls (1 to 1024)."""
    capacity: Annotated[Size, Range(0, MAX_SIZE)] | None = None
    """Accepted and ignored (Mooncake evicts by its own segment limits)."""


async def _probe(host: str, port: int, limit_s: float, *, answers: bool = False) -> None:
    """AdapterUnavailable unless a TCP connection to ``host:port`` opens within ``limit_s`` seconds; with
    ``answers``, the peer must also react to a bad RPC header (a live master closes the connection)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), limit_s)
    except (OSError, TimeoutError) as exc:
        raise AdapterUnavailable(f"mooncake: cannot connect to {host}:{port}: {exc!r}") from exc
    try:
        if answers:
            writer.write(BAD_RPC_HEADER)
            await asyncio.wait_for(reader.read(1), limit_s)
    except TimeoutError:
        raise AdapterUnavailable(
            f"mooncake: {host}:{port} accepts connections but does not answer within {limit_s} s"
        ) from None
    except OSError:
        pass  # reset: the master reacted (a dead one is caught by setup's own RPC with an error code)
    finally:
        writer.transport.abort()


class MooncakeAdapter(Adapter):
    """A Mooncake distributed store reached through its master (``mooncake://host:port``)."""

    scheme: ClassVar[str] = "mooncake"
    capabilities: ClassVar[Capabilities] = Capabilities(persistent=False, shared=True, delete=True)

    def __init__(
        self, store: Any, staging: np.ndarray[Any, Any], timeout: float, workers: int, name: str
    ) -> None:
        """Wrap a set-up store with its registered staging buffer (``open`` builds both)."""
        self._store = store
        self._staging = staging
        self._staging_ptr: int = staging.ctypes.data
        self.max_value_bytes = staging.nbytes - len(TRAILER)
        """Largest value a put accepts (``buffer_size - 1``)."""
        self.timeout = timeout
        self.name = name
        self._closed = False
        self._put_lock = threading.Lock()  # one staging buffer: puts take turns
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tiercache-mooncake")

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Set up a store client against the master of ``url`` (AdapterUnavailable if setup fails)."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "mooncake":
            raise ConfigError(f"mooncake: expected a mooncake://host:port URL, got {url!r}")
        opts = parse_options(MooncakeOptions, "mooncake", parts.query, options)
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise ConfigError(f"mooncake: invalid port in {url!r}") from None
        if not host or port is None or parts.path.strip("/"):
            raise ConfigError(f"mooncake: expected mooncake://master-host:port, got {url!r}")
        loopback = host in ("127.0.0.1", "localhost", "::1")
        local = (
            opts.local_hostname if opts.local_hostname is not None else ("127.0.0.1" if loopback else None)
        )
        if local is None:
            raise ConfigError("mooncake: option 'local_hostname' is required when the master is not local")
        metadata = opts.metadata or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        buffer_size, segment_size, timeout, workers = (
            opts.buffer_size,
            opts.segment_size,
            opts.timeout,
            opts.workers,
        )
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local)
        master = f"{host}:{port}"
        config = {
            "local_hostname": local,
            "metadata_server": metadata,
            "global_segment_size": segment_size,
            "local_buffer_size": buffer_size + LOCAL_BUFFER_SLACK,
            "protocol": opts.protocol,
            "rdma_devices": opts.rdma_devices,
            "master_server_addr": master,
        }

        def setup() -> tuple[Any, np.ndarray[Any, Any]]:
            store = MooncakeDistributedStore()
            rc = store.setup(config)
            if rc != 0:
                with contextlib.suppress(Exception):
                    store.close()
                raise AdapterUnavailable(f"mooncake: setup against master {master} failed (code {rc})")
            staging = np.empty(buffer_size, dtype=np.uint8)
            rc = store.register_buffer(staging.ctypes.data, staging.nbytes)
            if rc != 0:
                with contextlib.suppress(Exception):
                    store.close()
                raise AdapterUnavailable(f"mooncake: register_buffer failed (code {rc})")
            if segment_size == 0:
                try:
                    _check_placement(store, master)
                except BaseException:
                    with contextlib.suppress(Exception):
                        store.close()
                    raise
            return store, staging

        # Mooncake's setup retries an unreachable master for a long time (minutes): probe first.
        # It also holds the GIL while it waits, so a master that accepts but never answers would freeze the
        # whole process (event loop and timeouts included) for 20 x 30 s: the master must answer a probe.
        await _probe(host, port, min(timeout, 2.0), answers=True)
        meta = urlsplit(metadata)
        if meta.scheme in ("http", "https") and meta.hostname:
            meta_port = meta.port or (443 if meta.scheme == "https" else 80)
            await _probe(meta.hostname, meta_port, min(timeout, 2.0))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[Any, np.ndarray[Any, Any]]] = loop.create_future()

        def settle(result: tuple[Any, np.ndarray[Any, Any]] | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def run_setup() -> None:  # a daemon thread: a hung setup must not block interpreter exit
            try:
                result = setup()
            except BaseException as exc:
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        threading.Thread(target=run_setup, name="tiercache-mooncake-setup", daemon=True).start()
        try:
            store, staging = await asyncio.wait_for(asyncio.shield(done), timeout + 10)
        except TimeoutError:
            raise AdapterTimeout(f"mooncake: setup against {master} took over {timeout + 10} s") from None
        return cls(store, staging, timeout, workers, f"mooncake://{master}")

    # -- helpers ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"mooncake adapter {self.name} is closed")

    async def _run(self, fn: Callable[[], _T]) -> _T:
        """Run a blocking Mooncake call on the adapter's threads, bounded by ``timeout``."""
        self._check_open()
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._pool, fn)
        except RuntimeError as exc:  # pool shut down by a concurrent aclose
            raise AdapterUnavailable(f"mooncake adapter {self.name} is closed") from exc
        try:
            return await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise AdapterTimeout(f"{self.name}: no answer within {self.timeout} s") from None
        except AdapterError:
            raise
        except Exception as exc:  # whatever the Mooncake binding raises is a transport failure here
            raise AdapterUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def _fail(self, rc: int, op: str) -> AdapterUnavailable:
        return AdapterUnavailable(f"{self.name}: {op} failed with Mooncake code {rc} (master unreachable?)")

    # -- the adapter API -------------------------------------------------------------------------------

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether the store holds it now (``batch_is_exist``)."""
        self._check_open()
        names = [check_key(k) for k in keys]
        if not names:
            return []
        codes: list[int] = await self._run(lambda: self._store.batch_is_exist(names))
        for rc in codes:
            if rc < 0:
                raise self._fail(rc, "batch_is_exist")
        return [rc == 1 for rc in codes]

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, its bytes or None (``batch_get_buffer`` and one copy out)."""
        self._check_open()
        names = [check_key(k) for k in keys]
        if not names:
            return []
        return await self._run(lambda: self._get(names))

    def _get(self, names: list[str]) -> list[Buffer | None]:
        handles = self._store.batch_get_buffer(names)
        out: list[Buffer | None] = [None] * len(names)
        unknown: list[int] = []
        for i, handle in enumerate(handles):
            if handle is None:
                unknown.append(i)
                continue
            size = handle.size()
            view = memoryview(handle)
            if size >= 1 and view[size - 1 : size] == TRAILER:
                out[i] = bytes(view[: size - 1])
            del view
        del handles
        if unknown:
            codes = self._store.batch_is_exist([names[i] for i in unknown])
            for i, rc in zip(unknown, codes, strict=True):
                if rc < 0:
                    raise self._fail(rc, "batch_get_buffer")
                if rc == 1:  # present but no handle: the batch did not fit the client buffer at once
                    out[i] = self._get_one(names[i])
        return out

    def _get_one(self, name: str) -> bytes | None:
        handle = self._store.get_buffer(name)
        if handle is None:
            return None  # gone meanwhile, or larger than the client buffer
        size = handle.size()
        view = memoryview(handle)
        try:
            if size >= 1 and view[size - 1 : size] == TRAILER:
                return bytes(view[: size - 1])
            return None
        finally:
            del view

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Upsert each value (staged in the registered buffer, ``batch_upsert_from``); False if refused."""
        self._check_open()
        check_lengths(keys, values)
        names = [check_key(k) for k in keys]
        if not names:
            return []
        views = [as_readable_bytes(v) for v in values]
        return await self._run(lambda: self._put(names, views))

    def _put(self, names: list[str], views: list[memoryview]) -> list[bool]:
        out = [False] * len(names)
        cap = self._staging.nbytes
        with self._put_lock:
            i = 0
            while i < len(names):
                batch: list[int] = []
                used = 0
                while i < len(names):
                    need = views[i].nbytes + len(TRAILER)
                    if need > cap:
                        i += 1  # too big for the staging buffer: False
                        continue
                    if used + need > cap:
                        break
                    batch.append(i)
                    used += need
                    i += 1
                if batch:
                    self._flush(names, views, batch, out)
        return out

    def _flush(self, names: list[str], views: list[memoryview], batch: list[int], out: list[bool]) -> None:
        staging = self._staging
        ptrs: list[int] = []
        sizes: list[int] = []
        offset = 0
        for j in batch:
            n = views[j].nbytes
            staging[offset : offset + n] = np.frombuffer(views[j], dtype=np.uint8)
            staging[offset + n] = TRAILER[0]
            ptrs.append(self._staging_ptr + offset)
            sizes.append(n + 1)
            offset += n + 1
        codes = self._store.batch_upsert_from([names[j] for j in batch], ptrs, sizes)
        for j, rc in zip(batch, codes, strict=True):
            if _transport_code(rc):
                raise self._fail(rc, "batch_upsert_from")
            out[j] = rc == 0

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key even under a read lease (``batch_remove(force=True)``); True where it existed."""
        self._check_open()
        names = [check_key(k) for k in keys]
        if not names:
            return []
        codes: list[int] = await self._run(lambda: self._store.batch_remove(names, True))
        for rc in codes:
            if _transport_code(rc):
                raise self._fail(rc, "batch_remove")
        return [rc == 0 for rc in codes]

    # No ``iter_keys``: the Mooncake store client has no call that lists keys (``capabilities.list_keys`` is
    # False), so a reset reaches only the keys an event sink saw stored.

    async def aclose(self) -> None:
        """Close the store client and its threads; idempotent. Later calls raise AdapterUnavailable."""
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            # Wait for calls already running (at most one Mooncake retry cycle, ~4.3 s with a dead master):
            # closing the client under them would free memory they use.
            self._pool.shutdown(wait=True, cancel_futures=True)
            with self._put_lock:
                with contextlib.suppress(Exception):
                    self._store.unregister_buffer(self._staging_ptr)
                with contextlib.suppress(Exception):
                    self._store.close()

        await asyncio.to_thread(close)
