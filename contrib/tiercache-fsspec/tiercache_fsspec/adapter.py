"""``fsspec+PROTOCOL://location``: any fsspec filesystem as a tiercache L2 tier.

``fsspec+memory://bucket/prefix``, ``fsspec+file:///var/cache/kv``, ``fsspec+gcs://bucket/prefix``,
``fsspec+abfs://container/prefix`` all go through this one class: the text after ``fsspec+`` is an ordinary
fsspec URL, and each key is one file ``<location>/<key>``. Objects are ``persistent`` and ``shared``
(other processes and hosts see them), except under ``fsspec+memory://``: fsspec's memory filesystem is one
per process, so those adapters (``InProcessFsspecAdapter``) are not ``shared``.

Options (URL query or keyword; unknown ones raise ``ConfigError``):

* ``storage_options``: a table passed to the filesystem's constructor (e.g. ``{ project = "p" }``). Secrets
  never sit in the config: a key ending in ``_env`` names an environment variable whose value is passed under
  the key without the suffix (``{ account_key_env = "AZURE_KEY" }`` -> ``account_key=$AZURE_KEY``).
* ``commit``: how a put becomes visible whole. ``"rename"`` writes ``<location>/.tmp.<key>.<random>`` and
  renames it over the key (the default for local filesystems, where a rename is atomic); ``"direct"`` writes
  the key in one call (the default elsewhere: object stores publish a PUT only when it is complete, and the
  memory filesystem swaps the whole value in).
* ``max_concurrency``: file operations in flight at once (default 16): the size of the thread pool for a
  blocking filesystem, a semaphore for an async one.

Async filesystems (``fs.async_impl``: gcsfs, adlfs, s3fs, http) are created with ``asynchronous=True`` and
called through their coroutine methods (``_cat_file``, ``_pipe_file``, ...) on the caller's event loop;
blocking ones (memory, local, sftp) run on the adapter's own thread pool, so the loop never blocks.

Keys can be listed (``iter_keys``: one ``ls`` of the location), so a reset or a delete by prefix reaches
objects other processes stored.

Errors: a missing file is a miss (``None``/``False``); a timeout raises ``AdapterTimeout``; any other failure
of the filesystem (connection, permission, server error) raises ``AdapterUnavailable``. Cancellation: reads
simply stop waiting; a put or delete that has started runs to its end in the background (so no temporary
file is left and the key holds the old or the new value), and ``aclose`` waits for those before returning.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, cast
from urllib.parse import urlsplit

from tiercache.adapters import (
    Adapter,
    Buffer,
    Capabilities,
    check_key,
    check_keys,
    check_lengths,
    parse_int,
    parse_options,
)
from tiercache.errors import AdapterError, AdapterTimeout, AdapterUnavailable, ConfigError
from tiercache_fsspec import SCHEME, URL_PREFIX

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "COMMIT_MODES",
    "DEFAULT_MAX_CONCURRENCY",
    "FsspecAdapter",
    "FsspecOptions",
    "InProcessFsspecAdapter",
    "split_url",
]

T = TypeVar("T")

DEFAULT_MAX_CONCURRENCY = 16
"""File operations in flight at once when ``max_concurrency`` is not set."""
COMMIT_MODES = ("rename", "direct")
"""Ways a put is made visible whole (see the module docstring)."""
_LOCAL_PROTOCOLS = frozenset({"file", "local"})
_IN_PROCESS_PROTOCOLS = frozenset({"memory"})
_TMP_PREFIX = ".tmp."  # keys start with [A-Za-z0-9], so a temporary name can never be a key
_SCALARS = (str, int, float, bool)
_EXTRAS = {"gcs": "gcs", "gs": "gcs", "abfs": "abfs", "abfss": "abfs", "az": "abfs", "s3": "s3", "s3a": "s3"}


def split_url(url: str) -> tuple[str, str, str]:
    """``fsspec+PROTO://rest?query`` -> (``PROTO``, ``PROTO://rest``, ``query``); ConfigError otherwise."""
    if not url.lower().startswith(URL_PREFIX) or "://" not in url:
        raise ConfigError(
            "fsspec: expected a URL like 'fsspec+memory://bucket/prefix' or 'fsspec+file:///dir', "
            f"got {url!r}"
        )
    inner, _, query = url[len(URL_PREFIX) :].partition("?")
    protocol = urlsplit(inner).scheme.lower()
    if not protocol:
        raise ConfigError(f"fsspec: no filesystem protocol after 'fsspec+' in {url!r}")
    return protocol, inner, query


def _parse_storage_options(value: object) -> dict[str, Any]:
    """A mapping of scalar values; ``NAME_env = "VAR"`` entries become ``NAME = $VAR``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a table of filesystem options, got {value!r}")
    out: dict[str, Any] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not isinstance(item, _SCALARS):
            raise ValueError(f"entry {name!r} = {item!r}: names are strings and values str/int/float/bool")
        if name.endswith("_env"):
            if not isinstance(item, str):
                raise ValueError(f"{name!r} must name an environment variable, got {item!r}")
            env_value = os.environ.get(item)
            if env_value is None:
                raise ValueError(f"{name!r} names the environment variable {item!r}, which is not set")
            out[name.removesuffix("_env")] = env_value
        else:
            out[name] = item
    return out


def _parse_concurrency(value: object) -> int:
    n = parse_int(value)
    if n < 1:
        raise ValueError(f"must be at least 1, got {n}")
    return n


@dataclass(frozen=True, slots=True)
class FsspecOptions:
    """Options of ``fsspec+PROTO://`` URLs (query string or keywords), parsed by
    ``tiercache.adapters.parse_options`` from these field types."""

    storage_options: dict[str, Any] = field(default_factory=dict, metadata={"parse": _parse_storage_options})
    """Passed to the filesystem's constructor; ``NAME_env = "VAR"`` entries become ``NAME = $VAR``."""
    commit: Literal["rename", "direct"] | None = None
    """How a put becomes visible whole (default: rename on local filesystems, else direct)."""
    max_concurrency: int = field(default=DEFAULT_MAX_CONCURRENCY, metadata={"parse": _parse_concurrency})
    """File operations in flight at once (at least 1)."""


def _filesystem_class(protocol: str) -> type[Any]:
    """fsspec's class for ``protocol``, or a ConfigError that says what to install."""
    import fsspec

    try:
        return fsspec.get_filesystem_class(protocol)  # type: ignore[no-any-return]
    except ImportError as exc:  # fsspec knows the protocol; its implementation package is missing
        extra = _EXTRAS.get(protocol)
        hint = f"; install it with: pip install 'tiercache-fsspec[{extra}]'" if extra else ""
        raise ConfigError(
            f"fsspec: protocol {protocol!r} needs a package that is not installed: {exc}{hint}"
        ) from exc
    except ValueError as exc:
        known = ", ".join(sorted(fsspec.available_protocols()))
        raise ConfigError(f"fsspec: unknown protocol {protocol!r}; fsspec knows: {known}") from exc


class FsspecAdapter(Adapter):
    """One directory (or bucket prefix) of an fsspec filesystem; each key is one file in it."""

    scheme: ClassVar[str] = SCHEME
    capabilities: ClassVar[Capabilities] = Capabilities(
        persistent=True, shared=True, delete=True, list_keys=True
    )

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        commit: str = "direct",
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        label: str = "",
    ) -> None:
        """Wrap the filesystem instance ``fs`` at ``root`` (a path in ``fs``'s own form, no protocol).

        An async ``fs`` must have been created with ``asynchronous=True``; a blocking one gets a private
        thread pool of ``max_concurrency`` threads, shut down by ``aclose``.
        """
        if commit not in COMMIT_MODES:
            raise ConfigError(f"fsspec: commit must be one of {', '.join(COMMIT_MODES)}, got {commit!r}")
        self._fs = fs
        self._root = root.rstrip("/")
        self._commit = commit
        self._async = bool(getattr(fs, "async_impl", False))
        self._label = label or f"{SCHEME}+{type(fs).__name__}:{self._root}"
        self._limit = asyncio.Semaphore(max_concurrency)
        self._pool = None if self._async else ThreadPoolExecutor(max_concurrency, "tiercache-fsspec")
        self._writes: set[asyncio.Future[Any]] = set()
        self._closed = False

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Create the filesystem named after ``fsspec+`` and check it answers (AdapterUnavailable if not)."""
        protocol, inner, query = split_url(url)
        opts = parse_options(FsspecOptions, SCHEME, query, options)
        fs_class = _filesystem_class(protocol)
        protocols = {fs_class.protocol} if isinstance(fs_class.protocol, str) else set(fs_class.protocol)
        root = str(fs_class._strip_protocol(inner)).rstrip("/")
        if not root.strip("/"):
            raise ConfigError(f"fsspec: {url!r} names no directory or bucket to store objects in")
        kwargs: dict[str, Any] = {**fs_class._get_kwargs_from_urls(inner), **opts.storage_options}
        kwargs["skip_instance_cache"] = True  # this adapter owns its instance (sessions, aclose)
        if getattr(fs_class, "async_impl", False):
            kwargs["asynchronous"] = True
        label = f"{URL_PREFIX}{protocol}://{root.lstrip('/')}"
        try:
            fs = fs_class(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"fsspec: cannot create the {protocol!r} filesystem for {label}: {exc}"
            ) from exc
        except Exception as exc:
            raise AdapterUnavailable(f"fsspec: cannot open {label}: {type(exc).__name__}: {exc}") from exc
        default_commit = "rename" if protocols & _LOCAL_PROTOCOLS else "direct"
        make = InProcessFsspecAdapter if protocols & _IN_PROCESS_PROTOCOLS else cls
        adapter = make(
            fs,
            root,
            commit=opts.commit or default_commit,
            max_concurrency=opts.max_concurrency,
            label=label,
        )
        try:
            await adapter._prepare()
        except BaseException:
            await adapter.aclose()
            raise
        return cast("Self", adapter)

    # ----- plumbing ----------------------------------------------------------------------------------------
    async def _prepare(self) -> None:
        """Create the directory where renames need one; otherwise just reach the filesystem once."""
        if self._commit == "rename":
            await self._guard("open", self._call("makedirs", self._root, exist_ok=True))
        else:
            await self._guard("open", self._call("exists", self._root))

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.method(*args)``: the coroutine ``_method`` of an async fs, else on the thread pool."""
        async with self._limit:
            if self._async:
                return await getattr(self._fs, f"_{method}")(*args, **kwargs)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool, functools.partial(getattr(self._fs, method), *args, **kwargs)
            )

    async def _guard(self, op: str, call: Awaitable[T]) -> T:
        """Await ``call``; map filesystem failures to adapter errors (FileNotFoundError passes through)."""
        try:
            return await call
        except (FileNotFoundError, AdapterError):
            raise
        except TimeoutError as exc:
            raise AdapterTimeout(f"{self._label}: {op} timed out: {exc}") from exc
        except Exception as exc:
            raise AdapterUnavailable(f"{self._label}: {op} failed: {type(exc).__name__}: {exc}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"{self._label} is closed")

    async def _finish_in_background(self, work: Awaitable[T]) -> T:
        """Run a write to its end even if the caller is cancelled; ``aclose`` waits for it."""
        task = asyncio.ensure_future(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return await asyncio.shield(task)

    # ----- one key -----------------------------------------------------------------------------------------
    async def _contains_one(self, key: str) -> bool:
        try:
            await self._guard("contains", self._call("info", self._path(key)))  # exists() would hide errors
        except FileNotFoundError:
            return False
        return True

    async def _get_one(self, key: str) -> Buffer | None:
        try:
            data = await self._guard("get", self._call("cat_file", self._path(key)))
        except FileNotFoundError:
            return None
        return data if isinstance(data, bytes | bytearray | memoryview) else bytes(data)

    async def _put_one(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if self._commit == "direct":
            await self._guard("put", self._call("pipe_file", path, data))
            return True
        tmp = f"{self._root}/{_TMP_PREFIX}{key}.{secrets.token_hex(6)}"
        try:
            await self._guard("put", self._call("pipe_file", tmp, data))
            await self._guard("put", self._call("mv", tmp, path))
        except BaseException:
            with contextlib.suppress(Exception):  # the temp may not exist; report the put's own error
                await self._call("rm_file", tmp)
            raise
        return True

    async def _delete_one(self, key: str) -> bool:
        path = self._path(key)
        try:
            await self._guard("delete", self._call("info", path))
            await self._guard("delete", self._call("rm_file", path))
        except FileNotFoundError:
            return False
        return True

    # ----- the Adapter API ---------------------------------------------------------------------------------
    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its file exists (a missing file is False; errors raise)."""
        self._check_open()
        check_keys(keys)
        return list(await asyncio.gather(*(self._contains_one(k) for k in keys)))

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, the file's bytes or None when it does not exist."""
        self._check_open()
        check_keys(keys)
        return list(await asyncio.gather(*(self._get_one(k) for k in keys)))

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Write each value (copied first) so that it appears whole; True for each stored value."""
        self._check_open()
        check_lengths(keys, values)
        check_keys(keys)
        copies = [bytes(v) for v in values]

        async def put_all() -> list[bool]:
            return list(
                await asyncio.gather(*(self._put_one(k, v) for k, v in zip(keys, copies, strict=True)))
            )

        return await self._finish_in_background(put_all())

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key's file; True where one existed."""
        self._check_open()
        check_keys(keys)

        async def delete_all() -> list[bool]:
            return list(await asyncio.gather(*(self._delete_one(k) for k in keys)))

        return await self._finish_in_background(delete_all())

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """The keys of the files in the location starting with ``prefix`` (one ``ls``; temp files skipped)."""
        self._check_open()
        try:
            entries = await self._guard("list", self._call("ls", self._root, detail=True))
        except FileNotFoundError:
            return
        keys: list[str] = []
        for entry in entries:
            name = str(entry.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") != "file" or not name.startswith(prefix):
                continue
            with contextlib.suppress(ValueError):  # a temp file or another name that is no key
                keys.append(check_key(name))
        if keys:
            yield keys

    async def aclose(self) -> None:
        """Wait for started writes, then release the thread pool; idempotent. Later calls raise."""
        self._closed = True
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


class InProcessFsspecAdapter(FsspecAdapter):
    """``fsspec+memory://``: fsspec's memory filesystem lives in this process only (not ``shared``)."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        persistent=True, shared=False, delete=True, list_keys=True
    )
