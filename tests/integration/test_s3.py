"""S3Adapter against a live moto server: the conformance kit (single PUT and multipart), layout, multipart
abort, create-only puts, addressing, credentials, and live failures (server killed, restarted, paused)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import xxhash

pytest.importorskip("aioboto3")
pytest.importorskip("moto")

from botocore.exceptions import ClientError, EndpointConnectionError

import tiercache
from tiercache.adapters.s3 import S3Adapter, object_name
from tiercache.errors import AdapterTimeout, AdapterUnavailable, ConfigError
from tiercache.keys import ChunkKey
from tiercache.testing.adapters import AdapterConformance
from tiercache.testing.harness import s3 as servers
from tiercache.testing.harness.processes import free_port

if TYPE_CHECKING:
    from tiercache.testing.adapters import AdapterFactory


BUCKET = "tc-test"
SAFETY_NET_S = 60
"""Only there so that a hung call fails the test instead of hanging it; never reached when correct."""


@pytest.fixture(scope="module")
def aws_env() -> Iterator[None]:
    """Dummy credentials in the environment (the adapter reads them through the standard AWS chain)."""
    with servers.aws_test_env():
        yield


@pytest.fixture(scope="module")
def moto(aws_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One moto server for the module."""
    with servers.moto_with_bucket(BUCKET, tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def private_moto(aws_env: None, tmp_path: Path) -> Iterator[Any]:
    """A moto server of this test alone (for killing, restarting and pausing it)."""
    with servers.moto_with_bucket(BUCKET, tmp_path / "moto.log") as server:
        yield server


@pytest.fixture
def raw(moto: Any) -> Any:
    return moto.boto3_client()


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}/cache"


class TestS3Conformance(AdapterConformance):
    """The kit, path-style, default options (the 64 MiB object reaches the threshold: 8 x 8 MiB parts)."""

    @pytest.fixture
    def adapter_factory(self, moto: Any) -> AdapterFactory:
        url = f"s3://{BUCKET}/{_prefix()}"
        return lambda: S3Adapter.open(url, endpoint_url=moto.endpoint, addressing_style="path")


class TestS3ConformanceMultipart(AdapterConformance):
    """The kit through open_adapter with URL query options: objects >= 8 MiB go multipart (5 MiB parts)."""

    @pytest.fixture
    def adapter_factory(self, moto: Any) -> AdapterFactory:
        url = f"s3a://{BUCKET}/{_prefix()}?multipart_threshold=8MiB&part_size=5MiB&max_concurrency=4"
        return lambda: tiercache.open_adapter(url, endpoint_url=moto.endpoint)


async def _open(moto: Any, prefix: str | None = None, **options: Any) -> S3Adapter:
    options.setdefault("endpoint_url", moto.endpoint)
    return await S3Adapter.open(f"s3://{BUCKET}/{prefix or _prefix()}", **options)


def _listing(raw: Any, prefix: str) -> list[str]:
    pages = raw.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _client_error(code: str, status: int, op: str) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


# -- layout ----------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_layout_shard_of_opaque_keys(moto: Any, raw: Any) -> None:
    prefix = _prefix()
    chunk = ChunkKey(bytes(range(16)), bytes.fromhex("ab" + "00" * 31), layer=3)
    plain = "plain-key"
    adapter = await _open(moto, prefix + "/")  # trailing slash is normalised
    try:
        assert await adapter.batched_put([str(chunk), plain], [b"c", b"p"]) == [True, True]
    finally:
        await adapter.aclose()
    # keys are opaque: a chunk key and a plain key are laid out alike, under two hex chars of their xxh64
    shard = {key: xxhash.xxh64_hexdigest(key.encode())[:2] for key in (str(chunk), plain)}
    expected = sorted(f"{prefix}/{shard[key]}/{key}" for key in (str(chunk), plain))
    assert _listing(raw, prefix + "/") == expected
    assert raw.get_object(Bucket=BUCKET, Key=f"{prefix}/{shard[str(chunk)]}/{chunk}")["Body"].read() == b"c"
    assert object_name("", plain) == f"{shard[plain]}/{plain}"


# -- multipart -------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["client_error", "server_error", "connection"])
async def test_multipart_failure_is_aborted(moto: Any, raw: Any, failure: str) -> None:
    """A part failing mid-upload aborts the upload: no object, no multipart upload left in progress."""
    prefix = _prefix()
    adapter = await _open(moto, prefix, multipart_threshold="5MiB", part_size="5MiB", max_concurrency=1)
    real = adapter._client.upload_part
    calls: list[int] = []

    async def flaky(**kwargs: Any) -> Any:
        calls.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] == 2:
            if failure == "client_error":
                raise _client_error("InvalidRequest", 400, "UploadPart")
            if failure == "server_error":
                raise _client_error("InternalError", 500, "UploadPart")
            raise EndpointConnectionError(endpoint_url=moto.endpoint)
        return await real(**kwargs)

    adapter._client.upload_part = flaky
    try:
        value = os.urandom(12 << 20)  # 3 parts
        if failure == "client_error":
            assert await adapter.batched_put(["big"], [value]) == [False]
        else:
            with pytest.raises(AdapterUnavailable):
                await adapter.batched_put(["big"], [value])
        assert 2 in calls
        assert await adapter.batched_contains(["big"]) == [False]
        assert await adapter.batched_get(["big"]) == [None]
    finally:
        await adapter.aclose()
    assert _listing(raw, prefix) == []
    uploads = raw.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert uploads == []


@pytest.mark.asyncio
async def test_multipart_round_trip_odd_size(moto: Any, raw: Any) -> None:
    prefix = _prefix()
    adapter = await _open(moto, prefix, multipart_threshold="5MiB", part_size="5MiB")
    try:
        value = os.urandom((11 << 20) + 13)
        assert await adapter.batched_put(["odd"], [value]) == [True]
        (got,) = await adapter.batched_get(["odd"])
        assert got == value
    finally:
        await adapter.aclose()
    (name,) = _listing(raw, prefix)
    assert raw.head_object(Bucket=BUCKET, Key=name)["ETag"].endswith('-3"')  # really multipart


# -- create-only puts ------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("threshold", ["64MiB", "5MiB"], ids=["single", "multipart"])
async def test_create_only_first_writer_wins(moto: Any, threshold: str) -> None:
    adapter = await _open(moto, create_only=True, multipart_threshold=threshold, part_size="5MiB")
    try:
        assert adapter.conditional_puts is not None
        a, b = os.urandom(6 << 20), os.urandom(6 << 20)
        assert await adapter.batched_put(["k"], [a]) == [True]
        assert await adapter.batched_put(["k"], [b]) == [True]  # already stored: equivalent object
        assert await adapter.batched_get(["k"]) == [a]
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_create_only_moto_honours_if_none_match(moto: Any) -> None:
    """moto 5.x implements If-None-Match: * on PutObject (412), so the probe picks conditional puts."""
    adapter = await _open(moto, create_only=True)
    try:
        assert adapter.conditional_puts is True
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["501", "ignored"])
async def test_create_only_falls_back(moto: Any, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A server that rejects (501) or ignores If-None-Match: the probe notices, HEAD-then-PUT is used."""
    import aiobotocore.client

    seen: list[dict[str, Any]] = []
    real = aiobotocore.client.AioBaseClient._make_api_call

    async def fake(self: Any, operation: str, params: dict[str, Any]) -> Any:
        if operation == "PutObject" and "IfNoneMatch" in params:
            seen.append(params)
            if mode == "501":
                raise _client_error("NotImplemented", 501, operation)
            params = {k: v for k, v in params.items() if k != "IfNoneMatch"}
        return await real(self, operation, params)

    monkeypatch.setattr(aiobotocore.client.AioBaseClient, "_make_api_call", fake)
    adapter = await _open(moto, create_only=True)
    try:
        assert adapter.conditional_puts is False
        probes = len(seen)
        assert await adapter.batched_put(["k"], [b"first"]) == [True]
        assert await adapter.batched_put(["k"], [b"second"]) == [True]
        assert await adapter.batched_get(["k"]) == [b"first"]
        assert len(seen) == probes  # no conditional put after the probe
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_plain_put_overwrites(moto: Any) -> None:
    adapter = await _open(moto)
    try:
        assert adapter.conditional_puts is None
        assert await adapter.batched_put(["k"], [b"first"]) == [True]
        assert await adapter.batched_put(["k"], [b"second"]) == [True]
        assert await adapter.batched_get(["k"]) == [b"second"]
    finally:
        await adapter.aclose()


# -- addressing, credentials, options --------------------------------------------------------------------


class _Sent(Exception):
    pass


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("style", "host", "path"),
    [
        ("virtual", f"{BUCKET}.s3.example.invalid:9000", "/p/"),
        ("path", "s3.example.invalid:9000", f"/{BUCKET}/p/"),
    ],
)
async def test_addressing_style_builds_requests(
    aws_env: None, monkeypatch: pytest.MonkeyPatch, style: str, host: str, path: str
) -> None:
    """The URL each style produces (no network: moto on 127.0.0.1 cannot serve bucket.<host> names here)."""

    async def no_check(self: S3Adapter) -> None:
        return None

    monkeypatch.setattr(S3Adapter, "_check_bucket", no_check)
    adapter = await S3Adapter.open(
        f"s3://{BUCKET}/p", endpoint_url="http://s3.example.invalid:9000", addressing_style=style
    )
    urls: list[str] = []

    def capture(request: Any, **kwargs: Any) -> None:
        urls.append(request.url)
        raise _Sent

    adapter._client.meta.events.register("before-send.s3", capture)
    try:
        with pytest.raises(_Sent):
            await adapter.batched_get(["some-key"])
    finally:
        await adapter.aclose()
    (url,) = urls
    assert url == f"http://{host}{path}{object_name('', 'some-key')}"


@pytest.mark.asyncio
async def test_credentials_from_env_and_options(moto: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Env credentials are used; explicit (resolved *_env) options win. moto does not check secrets, so a
    wrong secret is not testable here."""
    adapter = await _open(moto)
    try:
        creds = await adapter._client._get_credentials().get_frozen_credentials()
        assert (creds.access_key, creds.secret_key) == ("testing", "testing")
    finally:
        await adapter.aclose()
    adapter = await _open(moto, access_key_id="other", secret_access_key="also-other")
    try:
        creds = await adapter._client._get_credentials().get_frozen_credentials()
        assert creds.access_key == "other"
        assert await adapter.batched_put(["k"], [b"v"]) == [True]
    finally:
        await adapter.aclose()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AdapterUnavailable, match="credentials"):
        await _open(moto)


@pytest.mark.asyncio
async def test_config_errors(aws_env: None) -> None:
    with pytest.raises(ConfigError, match="credentials"):
        await S3Adapter.open("s3://user:secret@bucket/p")
    with pytest.raises(ConfigError, match="nope"):
        await S3Adapter.open("s3://bucket/p?nope=1")
    with pytest.raises(ConfigError, match="part_size"):
        await S3Adapter.open("s3://bucket/p", part_size="1MiB")
    with pytest.raises(ConfigError, match="addressing_style"):
        await S3Adapter.open("s3://bucket/p", addressing_style="sideways")
    with pytest.raises(ConfigError, match="together"):
        await S3Adapter.open("s3://bucket/p", access_key_id="x")


@pytest.mark.asyncio
async def test_missing_bucket(moto: Any, raw: Any) -> None:
    name = f"tc-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(AdapterUnavailable, match="does not exist"):
        await S3Adapter.open(f"s3://{name}/p", endpoint_url=moto.endpoint)
    adapter = await S3Adapter.open(f"s3://{name}/p", endpoint_url=moto.endpoint, create_bucket=True)
    try:
        assert await adapter.batched_put(["k"], [b"v"]) == [True]
    finally:
        await adapter.aclose()
    assert _listing_bucket(raw, name) == [object_name("p", "k")]


def _listing_bucket(raw: Any, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", []))


@pytest.mark.asyncio
async def test_endpoint_down_at_open(aws_env: None) -> None:
    """Nothing listens: a refused connection is AdapterUnavailable at once (a hang hits the safety net)."""
    port = free_port()
    opening = S3Adapter.open(
        f"s3://{BUCKET}/p", endpoint_url=f"http://127.0.0.1:{port}", connect_timeout=1, max_attempts=1
    )
    with pytest.raises(AdapterUnavailable, match="cannot reach"):
        await asyncio.wait_for(opening, SAFETY_NET_S)


# -- live failures ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_server_killed_then_restarted(private_moto: Any) -> None:
    """Killed: every call raises AdapterUnavailable (a refused connection, not a timeout). Restarted on the
    same port: the same adapter works again (moto is in-memory, so the bucket is re-created first)."""
    adapter = await _open(private_moto, connect_timeout=1, read_timeout=2, max_attempts=2)
    try:
        assert await adapter.batched_put(["a", "b"], [b"1", b"2"]) == [True, True]
        private_moto.kill()
        for call in (
            lambda: adapter.batched_contains(["a", "b"]),
            lambda: adapter.batched_get(["a"]),
            lambda: adapter.batched_put(["c"], [b"3"]),
            lambda: adapter.batched_delete(["a"]),
        ):
            with pytest.raises(AdapterUnavailable, match="cannot reach"):  # refused, not timed out
                await asyncio.wait_for(call(), SAFETY_NET_S)
        private_moto.start()
        private_moto.boto3_client().create_bucket(Bucket=BUCKET)
        assert await adapter.batched_contains(["a"]) == [False]  # in-memory server: data is gone
        assert await adapter.batched_put(["a"], [b"again"]) == [True]
        assert await adapter.batched_get(["a"]) == [b"again"]
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_paused_server_times_out(private_moto: Any) -> None:
    """SIGSTOP: connections are accepted, nothing answers: the adapter's own timeouts end the call with
    AdapterTimeout (the safety net, far above ``request_bound_s``, would raise a plain TimeoutError)."""
    adapter = await _open(private_moto, connect_timeout=1, read_timeout=1, max_attempts=2)
    try:
        assert adapter.request_bound_s == (1 + 1) * 2
        assert await adapter.batched_put(["a"], [b"1"]) == [True]
        private_moto.pause()
        try:
            with pytest.raises(AdapterTimeout, match="timed out talking to"):
                await asyncio.wait_for(adapter.batched_get(["a", "b"]), SAFETY_NET_S)
        finally:
            private_moto.resume()
        assert await adapter.batched_get(["a"]) == [b"1"]
    finally:
        await adapter.aclose()


@pytest.mark.asyncio
async def test_bounded_concurrency(moto: Any) -> None:
    adapter = await _open(moto, max_concurrency=2)
    in_flight = 0
    peak = 0
    calls = 0

    def counted(fn: Any) -> Any:
        async def wrapper(**kwargs: Any) -> Any:
            nonlocal in_flight, peak, calls
            in_flight += 1
            calls += 1
            peak = max(peak, in_flight)
            try:
                await asyncio.sleep(0.01)  # make overlap observable
                return await fn(**kwargs)
            finally:
                in_flight -= 1

        return wrapper

    for op in ("put_object", "get_object", "head_object"):
        setattr(adapter._client, op, counted(getattr(adapter._client, op)))
    keys = [f"k{i}" for i in range(20)]
    values = [os.urandom(1000 + i) for i in range(20)]
    try:
        assert await adapter.batched_put(keys, values) == [True] * 20
        assert await adapter.batched_contains(keys) == [True] * 20
        assert await adapter.batched_get(keys) == values
    finally:
        await adapter.aclose()
    assert calls == 60
    assert peak == 2


@pytest.mark.asyncio
async def test_delete_many(moto: Any, raw: Any) -> None:
    prefix = _prefix()
    adapter = await _open(moto, prefix)
    keys = [f"d{i}" for i in range(30)]
    try:
        assert await adapter.batched_put(keys[:20], [b"x"] * 20) == [True] * 20
        assert await adapter.batched_delete(keys) == [True] * 20 + [False] * 10
    finally:
        await adapter.aclose()
    assert _listing(raw, prefix) == []


@pytest.mark.asyncio
async def test_bucket_gone_is_unavailable_not_a_miss(moto: Any, raw: Any) -> None:
    name = f"tc-gone-{uuid.uuid4().hex[:8]}"
    adapter = await S3Adapter.open(f"s3://{name}/p", endpoint_url=moto.endpoint, create_bucket=True)
    try:
        raw.delete_bucket(Bucket=name)
        with pytest.raises(AdapterUnavailable, match="NoSuchBucket"):
            await adapter.batched_get(["k"])
        with pytest.raises(AdapterUnavailable, match="NoSuchBucket"):
            await adapter.batched_put(["k"], [b"v"])
    finally:
        await adapter.aclose()


# -- cancellation ----------------------------------------------------------------------


def _uploads(raw: Any, prefix: str) -> list[Any]:
    return list(raw.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []))


@pytest.mark.asyncio
async def test_cancel_during_create_multipart_never_loses_the_upload(moto: Any, raw: Any) -> None:
    """A deadline firing while CreateMultipartUpload is in flight: the upload is still aborted."""
    prefix = _prefix()
    adapter = await _open(moto, prefix, multipart_threshold="5MiB", part_size="5MiB")
    real = adapter._client.create_multipart_upload
    created = asyncio.Event()
    answer = asyncio.Event()

    async def slow_answer(**kwargs: Any) -> Any:
        result = await real(**kwargs)  # the server has created the upload ...
        created.set()
        await answer.wait()  # ... but its answer is late
        return result

    adapter._client.create_multipart_upload = slow_answer
    put = asyncio.ensure_future(adapter.batched_put(["big"], [os.urandom(6 << 20)]))
    await created.wait()
    assert len(_uploads(raw, prefix)) == 1
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    answer.set()
    await adapter.aclose()  # waits for the detached abort
    assert _uploads(raw, prefix) == []
    assert _listing(raw, prefix) == []


@pytest.mark.asyncio
async def test_cancelled_multipart_put_does_not_wait_for_its_abort(moto: Any, raw: Any) -> None:
    """The abort runs detached; the cancelled call ends at once; aclose waits for the abort."""
    prefix = _prefix()
    adapter = await _open(moto, prefix, multipart_threshold="5MiB", part_size="5MiB", max_concurrency=1)
    real_part, real_abort = adapter._client.upload_part, adapter._client.abort_multipart_upload
    part_started, abort_started, abort_gate = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def hanging_part(**kwargs: Any) -> Any:
        part_started.set()
        await asyncio.Event().wait()  # a stalled part
        return await real_part(**kwargs)

    async def slow_abort(**kwargs: Any) -> Any:
        abort_started.set()
        await abort_gate.wait()
        return await real_abort(**kwargs)

    adapter._client.upload_part = hanging_part
    adapter._client.abort_multipart_upload = slow_abort
    put = asyncio.ensure_future(adapter.batched_put(["big"], [os.urandom(11 << 20)]))
    await part_started.wait()
    put.cancel()
    done, _ = await asyncio.wait({put}, timeout=30)  # safety net only: it ends without the abort
    assert put in done
    assert put.cancelled()
    await abort_started.wait()
    assert not abort_gate.is_set()  # the cancelled call ended while its abort was still running
    assert len(_uploads(raw, prefix)) == 1
    closing = asyncio.ensure_future(adapter.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # aclose waits for the abort ...
    abort_gate.set()
    await closing  # ... which then ends
    assert _uploads(raw, prefix) == []


@pytest.mark.asyncio
async def test_aclose_waits_for_a_hung_abort_a_bounded_time(moto: Any, raw: Any) -> None:
    prefix = _prefix()
    adapter = await _open(moto, prefix, multipart_threshold="5MiB", part_size="5MiB")
    adapter.request_bound_s = 0.2  # normally (connect + read timeout) x attempts

    async def failing_part(**kwargs: Any) -> Any:
        raise EndpointConnectionError(endpoint_url=moto.endpoint)

    async def hung_abort(**kwargs: Any) -> Any:
        await asyncio.Event().wait()

    adapter._client.upload_part = failing_part
    adapter._client.abort_multipart_upload = hung_abort
    with pytest.raises(AdapterUnavailable):
        await adapter.batched_put(["big"], [os.urandom(6 << 20)])  # its abort timed out (bounded)
    await asyncio.wait_for(adapter.aclose(), 30)  # safety net only
