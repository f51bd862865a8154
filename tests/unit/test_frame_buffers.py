"""Frame buffers of background stores are reused only once nothing references them."""

from __future__ import annotations

from tiercache.store._frames import FrameBuffers


def test_a_buffer_with_a_live_view_is_never_handed_out_again() -> None:
    pool = FrameBuffers(1 << 20)
    first = pool.take(1000)
    first_id = id(first)
    view = memoryview(first)[:10]  # a put still sending from it
    del first
    second = pool.take(1000)
    assert second is not view.obj
    view.release()
    del second
    again = pool.take(1000)
    assert id(again) == first_id  # no holder left: reused
    assert len(again) == 1000


def test_buffers_beyond_the_limit_are_not_kept() -> None:
    pool = FrameBuffers(1500)
    a = pool.take(1000)
    kept = id(a)
    b = pool.take(1000)  # a is in use; over the limit: a fresh buffer, not kept
    b_id = id(b)
    del a, b
    for _ in range(3):  # only the kept one comes back, each time it is free again
        c = pool.take(1000)
        assert id(c) == kept
        assert id(c) != b_id
        del c


def test_keep_frames_of_the_largest_size_even_past_the_limit() -> None:
    """Frames larger than a batch (one 32 MiB chunk per store worker): ``keep`` of them are reused though
    their bytes pass ``limit`` (the old pool kept what fit under it and faulted the rest in each time)."""
    pool = FrameBuffers(1500, keep=3)
    held = [pool.take(1000) for _ in range(3)]  # three in flight at once, 3000 bytes > limit
    ids = {id(b) for b in held}
    extra = pool.take(1000)  # a fourth: past keep x largest, not kept
    del held, extra
    again = [pool.take(1000) for _ in range(3)]
    assert {id(b) for b in again} == ids
    fourth = pool.take(1000)
    assert id(fourth) not in ids  # the three kept ones are in use; the fourth is fresh
