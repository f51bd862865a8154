"""``s3://bucket/prefix``: objects in an S3 (or S3-compatible) bucket through one shared aioboto3 client.

Layout: ``<prefix>/<shard>/<key>``. Keys are opaque to the adapter (it never parses the key format);
``<shard>`` is the first two hex characters of the key's xxh64 digest, which spreads keys over 256 S3
prefixes for request-rate partitioning.

One ``aioboto3.Session`` and one S3 client per adapter, created in ``open`` and closed in ``aclose``. Every
request holds a slot of a semaphore of ``max_concurrency`` (also the HTTP connection pool size), so a batch
never has more requests in flight than that; a multipart upload takes one slot per part, never one for the
whole upload (no deadlock when many big puts run at once).

Writes: a single ``PutObject`` below ``multipart_threshold``, else a multipart upload in ``part_size`` parts
(raised to fit S3's 10 000-part limit) that is aborted on any failure, so no partial object is ever visible
(S3 shows an object only once ``CompleteMultipartUpload`` succeeds). ``batched_put`` replaces old values
(plain PUT). With ``create_only=true`` puts carry ``If-None-Match: *`` (first writer wins; a put onto an
existing key reports True because keys are content addressed, so the stored object is equivalent). Whether
the server honours the header is probed once at open; where it does not (HTTP 501, or the header is silently
ignored) the adapter falls back to HEAD-then-PUT, which is racy between writers but never tears an object.

Credentials come from the standard AWS chain (environment, shared files, instance metadata), never from the
URL; ``access_key_id``/``secret_access_key``/``session_token`` options exist for values a config resolved
from ``*_env`` variables. Errors: connection refused/reset and every other client-library error ->
``AdapterUnavailable``; connect or read timeouts (after ``max_attempts`` total attempts, botocore's standard
retry mode) -> ``AdapterTimeout``; a missing bucket at open -> ``AdapterUnavailable`` (or created with
``create_bucket=true``, for tests/dev). Every request is bounded as a whole by ``request_bound_s`` =
``(connect_timeout + read_timeout) * max_attempts`` (this covers waits botocore's timeouts miss, such as a
PUT's ``Expect: 100-continue``), with or without the storage manager.

Every object carries its length (``x-amz-meta-tc-length``); a GET whose body is shorter or longer (a
truncated response without ``Content-Length``, a connection ending inside the body) is a miss, counted in
``stats["short_bodies"]``. Cancellation: a multipart upload's id is never lost (the create runs as a tracked
task that aborts the upload if its caller was cancelled meanwhile) and aborts run detached from the
cancelled call, tracked until they end; ``aclose`` waits for them at most ``request_bound_s``.
``capacity`` is accepted (config passes it) but not enforced: bound a bucket with a lifecycle rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar
from urllib.parse import unquote, urlsplit

import xxhash

from tiercache._secrets import redact_url
from tiercache.adapters._base import Adapter, Buffer, Capabilities, check_key, check_lengths, is_key
from tiercache.adapters._detached import DetachedWork
from tiercache.adapters.options import MAX_SIZE, Range, Size, check_options, parse_options, parse_str
from tiercache.buffers import as_readable_bytes
from tiercache.errors import AdapterError, AdapterTimeout, AdapterUnavailable, ConfigError, Unsupported

if TYPE_CHECKING:
    from typing import Self

__all__ = ["S3Adapter", "S3Options", "object_name"]

_T = TypeVar("_T")
_MIB = 1 << 20
_MIN_PART = 5 * _MIB  # S3's smallest part (all but the last)
_MAX_PART = 5 << 30  # S3's largest part
_MAX_OBJECT = 5 << 40  # S3's largest object
_MIN_SECONDS = 0.001
_MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # most keys one DeleteObjects call accepts
_SHARDS = [f"{i:02x}" for i in range(256)]  # the shard prefixes under the tier's prefix
_LIST_SHARDS_AT_ONCE = 16  # shards ``iter_keys`` lists concurrently
_LIST_PAGE = 1000  # keys one ListObjectsV2 page asks for (S3's most)
_MISS_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_NOT_IMPLEMENTED = frozenset({"501", "NotImplemented"})
_PRECONDITION = frozenset({"412", "PreconditionFailed", "409", "ConditionalRequestConflict"})
_ADDRESSING = ("auto", "path", "virtual")
_LENGTH_META = "tc-length"  # x-amz-meta-tc-length: the object's length, checked against every body read


def _addressing(value: object) -> str:
    text = parse_str(value).lower()
    if text not in _ADDRESSING:
        raise ValueError(f"expected one of {', '.join(_ADDRESSING)}, got {value!r}")
    return text


@dataclass(frozen=True, slots=True)
class S3Options:
    """Options of ``s3://bucket/prefix`` URLs (query string or keywords); each parsed from its type."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (None: AWS)."""
    region: str | None = None
    """Region name (None: the AWS chain's)."""
    addressing_style: str = field(default="auto", metadata={"parse": _addressing})
    """auto, path or virtual."""
    max_concurrency: Annotated[int, Range(1, 4096)] = 16
    """Requests in flight per adapter (and HTTP connections); 1 to 4096."""
    multipart_threshold: Annotated[Size, Range(1, _MAX_OBJECT)] = 64 * _MIB
    """Values at least this large are uploaded in parts (bytes or "64MiB")."""
    part_size: Annotated[Size, Range(_MIN_PART, _MAX_PART)] = 8 * _MIB
    """Bytes per multipart part (5 MiB to 5 GiB, S3's limits)."""
    create_only: bool = False
    """Conditional puts (``If-None-Match: *``) where the server honours them."""
    create_bucket: bool = False
    """Create the bucket at open when it is missing."""
    connect_timeout: Annotated[float, Range(_MIN_SECONDS, 3600)] = 5.0
    """Seconds per connection attempt (1 ms to an hour)."""
    read_timeout: Annotated[float, Range(_MIN_SECONDS, 3600)] = 30.0
    """Seconds to wait for an answer per attempt (1 ms to an hour)."""
    max_attempts: Annotated[int, Range(1, 100)] = 2
    """Total attempts per request (botocore standard retry mode); 1 to 100."""
    checksums: bool = False
    """Let botocore add/validate CRC32 checksums where supported (off: only where S3 requires them; frames
    carry their own checksum)."""
    access_key_id: str | None = None
    """With ``secret_access_key`` (use ``*_env`` in config files); None: the AWS chain."""
    secret_access_key: str | None = None
    session_token: str | None = None
    capacity: Annotated[Size, Range(0, MAX_SIZE)] | None = None
    """Bytes this tier may hold (None: unbounded)."""


def object_name(prefix: str, key: str) -> str:
    """The S3 object name of ``key`` under ``prefix`` (``""`` or without slashes at either end)."""
    name = f"{xxhash.xxh64_hexdigest(key.encode())[:2]}/{key}"
    return f"{prefix}/{name}" if prefix else name


def _body(view: memoryview) -> bytes | bytearray:
    """A request body botocore accepts and can resend on a retry (it rewinds anything but bytes-likes).

    A whole ``bytes``/``bytearray`` is passed as is (no copy); slices and other buffers are copied once.
    """
    obj = view.obj
    if isinstance(obj, bytes | bytearray) and view.c_contiguous and len(view) == len(obj):
        return obj
    return bytes(view)


def _error_code(exc: BaseException) -> tuple[str, str]:
    """(error code, HTTP status) of a botocore ClientError; empty strings for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", ""
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code, status


class S3Adapter(Adapter):
    """Objects in an S3 bucket under a prefix; persistent and shared between hosts."""

    scheme: ClassVar[str] = "s3"
    capabilities: ClassVar[Capabilities] = Capabilities(
        persistent=True, shared=True, delete=True, max_value_bytes=_MAX_OBJECT, list_keys=True
    )

    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None) -> None:
        """Settings only (``S3Options`` documents each); ``open`` creates the client and checks the bucket."""
        o = options or S3Options()
        check_options(o, "s3")
        endpoint_url, max_concurrency, part_size = o.endpoint_url, o.max_concurrency, o.part_size
        multipart_threshold, max_attempts = o.multipart_threshold, o.max_attempts
        access_key_id, secret_access_key = o.access_key_id, o.secret_access_key
        connect_timeout, read_timeout = o.connect_timeout, o.read_timeout
        if not bucket:
            raise ConfigError("s3: URL must name a bucket: s3://bucket/prefix")
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError("s3: access_key_id and secret_access_key must be given together")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.region = o.region
        self.addressing_style = o.addressing_style
        self.max_concurrency = max_concurrency
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.create_only = o.create_only
        self.create_bucket = o.create_bucket
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_attempts = max_attempts
        self.checksums = o.checksums
        self.capacity = o.capacity
        self._credentials = (access_key_id, secret_access_key, o.session_token)
        self._conditional: bool | None = None  # If-None-Match honoured? None: not probed
        self.stats: dict[str, int] = {"short_bodies": 0}
        """``short_bodies``: GET bodies shorter (or longer) than their object, served as misses."""
        self._sem = asyncio.Semaphore(max_concurrency)
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._closed = False
        at = f" at {redact_url(endpoint_url)}" if endpoint_url else ""
        self._where = f"s3://{bucket}/{self.prefix}{at}"  # for messages and logs: never a secret
        self._cleanup = DetachedWork(f"s3 {self._where}")  # multipart aborts, detached from their caller
        self.request_bound_s = (connect_timeout + read_timeout) * max_attempts
        """Longest one request may take, every attempt and wait included (the ``Expect: 100-continue``
        wait of a PUT too): ``(connect_timeout + read_timeout) * max_attempts``; then AdapterTimeout."""

    @classmethod
    async def open(cls, url: str, **options: object) -> Self:
        """Open ``s3://bucket[/prefix][?option=value...]``; options: ``S3Options``."""
        parts = urlsplit(url)
        if parts.scheme not in ("s3", "s3a"):
            raise ConfigError(f"s3: expected an s3://bucket/prefix URL, got {url!r}")
        if "@" in parts.netloc or ":" in parts.netloc:
            raise ConfigError(
                "s3: the URL must be s3://bucket/prefix (no credentials, no port); "
                "credentials come from the AWS chain or *_env options"
            )
        opts = parse_options(S3Options, "s3", parts.query, options)
        self = cls(parts.netloc, unquote(parts.path), opts)
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            self._closed = True
            raise
        return self

    # -- lifecycle -------------------------------------------------------------------------------------

    async def _start(self) -> None:
        import aioboto3
        from botocore.config import Config

        key_id, secret, token = self._credentials
        session = aioboto3.Session(
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            aws_session_token=token,
            region_name=self.region,
        )
        when = "when_supported" if self.checksums else "when_required"
        config = Config(
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
            max_pool_connections=self.max_concurrency,
            s3={"addressing_style": self.addressing_style},
            request_checksum_calculation=when,
            response_checksum_validation=when,
        )
        self._client = await self._stack.enter_async_context(
            session.client("s3", endpoint_url=self.endpoint_url, config=config)
        )
        await self._check_bucket()
        if self.create_only:
            await self._probe_conditional()

    async def _check_bucket(self) -> None:
        try:
            await self._call(lambda c: c.head_bucket(Bucket=self.bucket))
        except AdapterError as exc:
            code, status = _error_code(exc.__cause__ or exc)
            if code not in ("404", "NoSuchBucket", "NotFound") and status != "404":
                raise
            if not self.create_bucket:
                raise AdapterUnavailable(
                    f"s3: bucket {self.bucket!r} does not exist ({self._where}); create it, "
                    "or set create_bucket=true (tests/dev)"
                ) from exc
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            region = self._client.meta.region_name
            if region and region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:
                await self._call(lambda c: c.create_bucket(**kwargs))
            except AdapterError as exc2:
                code2, _ = _error_code(exc2.__cause__ or exc2)
                if code2 not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    async def _probe_conditional(self) -> None:
        """Find out whether the server honours ``If-None-Match: *`` on PutObject (one probe object)."""
        name = f"{self.prefix}/.tiercache-probe-{secrets.token_hex(8)}".lstrip("/")
        try:
            await self._put_single(name, memoryview(b"1"), conditional=True)
            second = await self._put_single(name, memoryview(b"2"), conditional=True)
            self._conditional = not second  # the second create must be refused
        except Unsupported:
            self._conditional = False
        finally:
            with contextlib.suppress(AdapterError):
                await self._call(lambda c: c.delete_object(Bucket=self.bucket, Key=name))

    async def aclose(self) -> None:
        """Wait (at most ``request_bound_s``) for clean-up still running (multipart aborts), then close the
        client (its connection pool); idempotent. Later calls raise AdapterUnavailable."""
        if self._closed:
            return
        self._closed = True
        await self._cleanup.wait(self.request_bound_s)
        await self._stack.aclose()
        self._client = None

    # -- helpers ---------------------------------------------------------------------------------------

    @property
    def conditional_puts(self) -> bool | None:
        """Whether create-only puts use ``If-None-Match: *`` (None until probed, i.e. create_only off)."""
        return self._conditional

    def _name(self, key: str) -> str:
        return object_name(self.prefix, check_key(key))

    def _check_open(self) -> None:
        if self._closed:
            raise AdapterUnavailable(f"s3 adapter on {self._where} is closed")

    def _translate(self, exc: Exception) -> AdapterError:
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        if isinstance(exc, ConnectTimeoutError | ReadTimeoutError | TimeoutError):
            return AdapterTimeout(f"s3: timed out talking to {self._where}: {exc}")
        if isinstance(exc, NoCredentialsError):
            return AdapterUnavailable(f"s3: no AWS credentials found for {self._where}: {exc}")
        if isinstance(exc, ClientError):
            code, status = _error_code(exc)
            return AdapterUnavailable(f"s3: {self._where} answered {code or status}: {exc}")
        return AdapterUnavailable(f"s3: cannot reach {self._where}: {exc}")

    async def _call(self, fn: Callable[[Any], Awaitable[_T]], *, cleanup: bool = False) -> _T:
        """``fn(client)`` under a concurrency slot, bounded by ``request_bound_s``; every exception of the
        client libraries becomes AdapterTimeout or AdapterUnavailable. ``cleanup`` calls (multipart aborts)
        still run while ``aclose`` waits for them."""
        from botocore.exceptions import BotoCoreError, ClientError

        if not cleanup:
            self._check_open()
        async with self._sem:
            client = self._client
            if client is None:
                raise AdapterUnavailable(f"s3 adapter on {self._where} is closed")
            try:
                async with asyncio.timeout(self.request_bound_s):
                    return await fn(client)
            except (TimeoutError, BotoCoreError, ClientError, OSError) as exc:
                raise self._translate(exc) from exc
            except Exception as exc:  # aiohttp and other errors that escaped botocore's wrapping
                import aiohttp

                if isinstance(exc, aiohttp.ClientError | ValueError | RuntimeError | EOFError):
                    raise self._translate(exc) from exc
                raise

    @staticmethod
    def _is(exc: AdapterError, codes: frozenset[str]) -> bool:
        code, status = _error_code(exc.__cause__ or exc)
        if code == "NoSuchBucket":  # the bucket went away: unavailable, not a miss
            return False
        return code in codes or status in codes

    # -- the adapter API -------------------------------------------------------------------------------

    async def _head(self, name: str) -> bool:
        try:
            await self._call(lambda c: c.head_object(Bucket=self.bucket, Key=name))
        except AdapterUnavailable as exc:
            if self._is(exc, _MISS_CODES):
                return False
            raise
        return True

    async def batched_contains(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether its object exists (concurrent HEAD requests; 404 is False)."""
        self._check_open()
        names = [self._name(k) for k in keys]
        return list(await asyncio.gather(*(self._head(n) for n in names)))

    async def _get(self, name: str) -> Buffer | None:
        """The object's bytes, or None if it is missing or its body is not as long as the object (a
        truncated response: the length we stored in its metadata, else its Content-Length)."""
        from botocore.exceptions import IncompleteReadError, ResponseStreamingError

        async def get(client: Any) -> bytes | None:
            response = await client.get_object(Bucket=self.bucket, Key=name)
            async with response["Body"] as body:
                data: bytes = await body.read()
            expected = (response.get("Metadata") or {}).get(_LENGTH_META, response.get("ContentLength"))
            try:
                wanted = None if expected is None else int(expected)
            except ValueError:
                wanted = None
            if wanted is not None and wanted != len(data):
                self.stats["short_bodies"] += 1
                return None
            return data

        try:
            return await self._call(get)
        except AdapterUnavailable as exc:
            if self._is(exc, _MISS_CODES):
                return None
            if isinstance(exc.__cause__, IncompleteReadError | ResponseStreamingError):
                self.stats["short_bodies"] += 1
                return None  # the connection ended inside the body: a miss, never a part of the object
            raise

    async def batched_get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """For each key, its bytes or None (concurrent GETs, each body read whole)."""
        self._check_open()
        names = [self._name(k) for k in keys]
        return list(await asyncio.gather(*(self._get(n) for n in names)))

    async def _put_single(self, name: str, body: memoryview, *, conditional: bool) -> bool:
        """PutObject; False if a conditional put found an object. ``Unsupported`` on HTTP 501."""
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": name,
            "Body": _body(body),
            "Metadata": {_LENGTH_META: str(len(body))},
        }
        return await self._write("put_object", kwargs, conditional=conditional)

    async def _write(self, method: str, kwargs: dict[str, Any], *, conditional: bool) -> bool:
        """Call the client's ``method`` (a put or a multipart complete), with ``If-None-Match: *`` when
        ``conditional``: False if that found an object, ``Unsupported`` when the store answers HTTP 501."""
        if conditional:
            kwargs = {**kwargs, "IfNoneMatch": "*"}
        try:
            await self._call(lambda c: getattr(c, method)(**kwargs))
        except AdapterUnavailable as exc:
            if conditional and self._is(exc, _PRECONDITION):
                return False
            if conditional and self._is(exc, _NOT_IMPLEMENTED):
                raise Unsupported from exc
            raise
        return True

    async def _put_multipart(self, name: str, body: memoryview, *, conditional: bool) -> bool:
        """Multipart upload, aborted on any failure; False if a conditional complete found an object.

        The upload id is never lost: the create runs as a tracked task, and a caller cancelled while it is
        in flight leaves that task to abort the upload once the id arrives. Aborts run detached from the
        cancelled call (tracked; ``aclose`` waits for them a bounded time)."""
        size = len(body)
        part = max(self.part_size, -(-size // _MAX_PARTS))
        create = self._cleanup.start(
            self._call(
                lambda c: c.create_multipart_upload(
                    Bucket=self.bucket, Key=name, Metadata={_LENGTH_META: str(size)}
                )
            )
        )
        try:
            created = await asyncio.shield(create)
        except asyncio.CancelledError:
            self._cleanup.start(self._abort_once_created(name, create))
            raise
        upload_id = created["UploadId"]
        done = cancelled = False
        try:

            async def upload(number: int, start: int) -> dict[str, Any]:
                chunk = _body(body[start : start + part])
                result = await self._call(
                    lambda c: c.upload_part(
                        Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=chunk
                    )
                )
                return {"PartNumber": number, "ETag": result["ETag"]}

            tasks = [
                asyncio.ensure_future(upload(i + 1, start)) for i, start in enumerate(range(0, size, part))
            ]
            try:
                etags = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": name,
                "UploadId": upload_id,
                "MultipartUpload": {"Parts": list(etags)},
            }
            if not await self._write("complete_multipart_upload", kwargs, conditional=conditional):
                return False  # not done: the upload is aborted
            done = True
            return True
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if not done:
                abort = self._cleanup.start(self._abort(name, upload_id))
                if not cancelled:  # a cancelled caller never waits for the clean-up
                    await asyncio.shield(abort)

    async def _abort_once_created(self, name: str, create: asyncio.Task[Any]) -> None:
        """Abort the upload ``create`` starts, once its id arrives (its caller was cancelled)."""
        try:
            created = await create
        except Exception:
            return  # no upload was created (or we cannot know its id: the server lists it for clean-up)
        await self._abort(name, created["UploadId"])

    async def _abort(self, name: str, upload_id: str) -> None:
        with contextlib.suppress(AdapterError):
            await self._call(
                lambda c: c.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id),
                cleanup=True,
            )

    async def _put_one(self, name: str, value: Buffer) -> bool:
        body = as_readable_bytes(value)
        write = self._put_multipart if len(body) >= self.multipart_threshold else self._put_single
        if not self.create_only:
            return await write(name, body, conditional=False)
        if self._conditional:
            try:
                await write(name, body, conditional=True)  # False: someone else created it first
                return True
            except Unsupported:
                self._conditional = False  # e.g. only multipart completes lack support: fall back
        if await self._head(name):
            return True
        return await write(name, body, conditional=False)

    async def batched_put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        """Store each value (PutObject, or multipart at ``multipart_threshold``); True where stored.

        A client error for one object (HTTP 4xx, e.g. EntityTooLarge) is False for it; server errors (5xx
        after the retries), connection failures and timeouts raise, so the manager can open its circuit.
        """
        self._check_open()
        check_lengths(keys, values)
        names = [self._name(k) for k in keys]

        async def one(name: str, value: Buffer) -> bool:
            try:
                return await self._put_one(name, value)
            except AdapterUnavailable as exc:
                from botocore.exceptions import ClientError

                if isinstance(exc.__cause__, ClientError):
                    code, status = _error_code(exc.__cause__)
                    if status.startswith("4") and code != "NoSuchBucket":
                        return False
                raise

        return list(await asyncio.gather(*(one(n, v) for n, v in zip(names, values, strict=True))))

    async def iter_keys(self, prefix: str) -> AsyncIterator[list[str]]:
        """``ListObjectsV2`` of ``<tier prefix>/<shard>/<prefix>`` for each of the 256 shards (paginated,
        ``_LIST_SHARDS_AT_ONCE`` shards at a time), one batch per group of shards."""
        self._check_open()
        for start in range(0, len(_SHARDS), _LIST_SHARDS_AT_ONCE):
            shards = _SHARDS[start : start + _LIST_SHARDS_AT_ONCE]
            found = await asyncio.gather(*(self._list_shard(s, prefix) for s in shards))
            batch = [key for keys in found for key in keys]
            if batch:
                yield batch

    async def _list_shard(self, shard: str, prefix: str) -> list[str]:
        """The keys under ``shard`` starting with ``prefix`` (names of other shape or shard are skipped)."""
        head = f"{self.prefix}/{shard}/" if self.prefix else f"{shard}/"
        out: list[str] = []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = await self._call(
                lambda c, e=extra: c.list_objects_v2(  # type: ignore[misc]
                    Bucket=self.bucket, Prefix=head + prefix, MaxKeys=_LIST_PAGE, **e
                )
            )
            for item in page.get("Contents") or []:
                key = str(item.get("Key", ""))[len(head) :]
                if is_key(key) and object_name(self.prefix, key) == head + key:
                    out.append(key)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return out

    async def batched_delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove each key; True where an object existed (HEADs, then DeleteObjects in batches of 1000)."""
        self._check_open()
        names = [self._name(k) for k in keys]
        present = list(await asyncio.gather(*(self._head(n) for n in names)))
        doomed = sorted({n for n, p in zip(names, present, strict=True) if p})
        for start in range(0, len(doomed), _DELETE_BATCH):
            batch = [{"Key": n} for n in doomed[start : start + _DELETE_BATCH]]
            result = await self._call(
                lambda c, b=batch: c.delete_objects(  # type: ignore[misc]
                    Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}
                )
            )
            errors = result.get("Errors") or []
            if errors:
                failed = {e.get("Key") for e in errors}
                present = [p and n not in failed for n, p in zip(names, present, strict=True)]
        return present
