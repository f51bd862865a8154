"""Does issuing a shuffled table's small copies from several host threads feed the copy engines faster?

KV: Llama-8B shape (32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks) as one device buffer of 64
planes (K and V of each layer) of blocks, a shuffled block table: a move of N tokens is 64 * N / 16 copies of
32 KiB between the blocks and a pinned host buffer (host order), issued with the driver's
``cuMemcpyBatchAsync`` (ctypes, which releases the GIL) in sub-batches of ``--sub-batches`` copies. Each
configuration cuts the copies into T host threads (``batch_t<T>_sb<S>``: a stream each), or issues them from
one thread over several streams in turn (``batch_t1_s<K>_sb<S>``), or with other batch attributes
(``_any``: source access order ANY; ``_noflag``: no preference for overlap with compute); ``pinned_copy``:
one ``cuMemcpyAsync`` of the same bytes (the ceiling). Per configuration and direction, bit-exact check
first, then: ``call_GBps`` (one move issued and waited for, as a library call that returns with its data in
place), ``issue_us_per_copy`` (host time issuing a move: the batch calls and the event records around them,
summed over the threads, per copy), ``cont_alone_GBps`` (moves back to back,
the next one queued while one runs) and, beside a model (the bf16 matrix products of 32 Llama-8B decoder
layers on 1024 tokens, one CUDA graph on its own stream), ``model_GBps`` and ``model_slowdown_pct`` against
the mean of 8 forwards alone just before and just after (``model_alone_drift_pct``: how far those differ).
One round per configuration.

Usage: ``python benchmarks/gpu_issue_threads.py [--sizes 256,4096] [--sub-batches 128,1024] [--out F]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
from _common import MatmulModel

DEV = torch.device("cuda")
L, H, D, BS = 32, 8, 128, 16
PIECE = BS * H * D * 2  # one block of one plane: 32 KiB
NB = 2 * 4096 // BS + 1
PLANES = 2 * L
WAIT_S = 120.0  # a worker's report (one move, or the end of a window) comes within this


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attr(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", Loc),
        ("dstLocHint", Loc),
        ("flags", ctypes.c_uint),
    ]


SRC_ORDER_STREAM, SRC_ORDER_ANY, PREFER_OVERLAP = 1, 3, 1
cu: Any = None  # libcuda, opened by load_driver (a run on a GPU machine; --help needs none)
BATCH: Any = None
V13 = False  # CUDA 13's cuMemcpyBatchAsync_v2 (no failIdx)
ATTR = Attr(SRC_ORDER_STREAM, Loc(0, 0), Loc(0, 0), PREFER_OVERLAP)
FIRST = (ctypes.c_size_t * 1)(0)
FAIL = ctypes.c_size_t(0)


def load_driver() -> None:
    global cu, BATCH, V13
    cu = ctypes.CDLL("libcuda.so.1")
    V13 = hasattr(cu, "cuMemcpyBatchAsync_v2")
    BATCH = cu.cuMemcpyBatchAsync_v2 if V13 else cu.cuMemcpyBatchAsync


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def batch(d: np.ndarray, s: np.ndarray, z: np.ndarray, stream: int, attr: Attr = ATTR) -> None:
    """Queue ``len(z)`` 1D copies (uint64 destination / source addresses and sizes) on ``stream``."""
    head = (ctypes.c_void_p(d.ctypes.data), ctypes.c_void_p(s.ctypes.data), ctypes.c_void_p(z.ctypes.data))
    n, one = ctypes.c_size_t(len(z)), ctypes.c_size_t(1)
    if V13:
        rc = BATCH(*head, n, ctypes.byref(attr), FIRST, one, ctypes.c_void_p(stream))
    else:
        rc = BATCH(*head, n, ctypes.byref(attr), FIRST, one, ctypes.byref(FAIL), ctypes.c_void_p(stream))
    assert rc == 0, rc


def memcpy(dst: int, src: int, n: int, stream: int) -> None:
    rc = cu.cuMemcpyAsync(
        ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(n), ctypes.c_void_p(stream)
    )
    assert rc == 0, rc


def new_stream() -> int:
    """A stream of the driver's own (non-blocking), never one of torch's pooled streams."""
    h = ctypes.c_void_p()
    assert cu.cuStreamCreate(ctypes.byref(h), 1) == 0  # CU_STREAM_NON_BLOCKING
    return int(h.value or 0)


def new_event() -> ctypes.c_void_p:
    e = ctypes.c_void_p()
    assert cu.cuEventCreate(ctypes.byref(e), 2) == 0  # no timing
    return e


class Worker(threading.Thread):
    """A host thread that issues its parts (batches or one copy) on its streams, in turn, on command:
    ``call`` (issue, wait, report) or ``cont`` (moves back to back, the next queued, until told to stop)."""

    def __init__(
        self, parts: list[tuple[Any, ...]], nbytes: int, ctx: ctypes.c_void_p, nstreams: int, attr: Attr
    ):
        super().__init__(daemon=True)
        self.attr, self.ctx = attr, ctx
        self.hs = [new_stream() for _ in range(nstreams)]  # never a stream of torch's pool: the model has one
        self.h = self.hs[0]
        self.joins = [new_event() for _ in range(nstreams)]
        self.parts, self.nbytes = parts, nbytes
        self.cmd: queue.Queue[tuple[str, threading.Event | None]] = queue.Queue()
        self.done: queue.Queue[int] = queue.Queue()
        self.moved = 0
        self.issue_s = 0.0
        self.evs = [new_event() for _ in range(2)]
        self.start()

    def issue(self) -> None:
        t0 = time.perf_counter()
        hs = self.hs
        if len(hs) > 1:  # side streams start after the main one's earlier work
            assert cu.cuEventRecord(self.joins[0], ctypes.c_void_p(hs[0])) == 0
            for h in hs[1:]:
                assert cu.cuStreamWaitEvent(ctypes.c_void_p(h), self.joins[0], 0) == 0
        for i, p in enumerate(self.parts):
            h = hs[i % len(hs)]
            if p[0] == "one":
                memcpy(p[1], p[2], p[3], h)
            else:
                batch(p[1], p[2], p[3], h, self.attr)
        for k, h in enumerate(hs[1:], 1):  # the main stream waits for the side streams
            assert cu.cuEventRecord(self.joins[k], ctypes.c_void_p(h)) == 0
            assert cu.cuStreamWaitEvent(ctypes.c_void_p(hs[0]), self.joins[k], 0) == 0
        self.issue_s += time.perf_counter() - t0

    def run(self) -> None:
        assert cu.cuCtxSetCurrent(self.ctx) == 0
        while True:
            mode, stop = self.cmd.get()
            if mode == "call":
                self.issue()
                assert cu.cuStreamSynchronize(ctypes.c_void_p(self.h)) == 0
                self.done.put(1)
            elif mode == "cont":
                assert stop is not None
                k = 0
                while not stop.is_set():
                    self.issue()
                    assert cu.cuEventRecord(self.evs[k % 2], ctypes.c_void_p(self.h)) == 0
                    if k:
                        assert cu.cuEventSynchronize(self.evs[(k - 1) % 2]) == 0
                        self.moved += self.nbytes
                    k += 1
                assert cu.cuStreamSynchronize(ctypes.c_void_p(self.h)) == 0
                if k:
                    self.moved += self.nbytes
                self.done.put(1)
            else:  # quit: the streams go with the thread
                for h in self.hs:
                    assert cu.cuStreamDestroy_v2(ctypes.c_void_p(h)) == 0
                return


def configs(threads: list[int], sub_batches: list[int]) -> list[tuple[str, int, int, int, Attr]]:
    """(name, threads, sub-batch, streams per thread, attributes) of every configuration."""
    any_order = Attr(SRC_ORDER_ANY, Loc(0, 0), Loc(0, 0), PREFER_OVERLAP)
    no_flag = Attr(SRC_ORDER_STREAM, Loc(0, 0), Loc(0, 0), 0)
    sb = sub_batches[0]
    out = [("pinned_copy", 1, 0, 1, ATTR)]
    out += [(f"batch_t{t}_sb{s}", t, s, 1, ATTR) for t in threads for s in sub_batches]
    out += [(f"batch_t1_s{k}_sb{sb}", 1, sb, k, ATTR) for k in (4, 8)]
    out += [(f"batch_t1_sb{sb}_any", 1, sb, 1, any_order), (f"batch_t1_sb{sb}_noflag", 1, sb, 1, no_flag)]
    out += [(f"batch_t4_sb{sb}_any", 4, sb, 1, any_order)]
    return out


def call(workers: list[Worker]) -> None:
    """One move: every worker issues its parts and waits for them."""
    for w in workers:
        w.cmd.put(("call", None))
    wait_all(workers)


def wait_all(workers: list[Worker]) -> None:
    """Every worker's report, or RuntimeError where one stopped reporting (its thread failed)."""
    for w in workers:
        try:
            w.done.get(timeout=WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"a worker gave no report in {WAIT_S} s (see its traceback above)") from None


def measure(workers: list[Worker], nbytes: int, reps: int, model: MatmulModel) -> dict[str, float]:
    """One configuration's call rate, issue cost, queued rate alone and beside the model."""

    def window(span: Any) -> tuple[float, float]:
        stop = threading.Event()
        for w in workers:
            w.moved = 0
            w.cmd.put(("cont", stop))
        time.sleep(0.05)
        m0, t0 = sum(w.moved for w in workers), time.perf_counter()
        got = span()
        m1, t1 = sum(w.moved for w in workers), time.perf_counter()
        stop.set()
        wait_all(workers)
        return (m1 - m0) / (t1 - t0) / 1e9, got

    for w in workers:
        w.issue_s = 0.0
    for _ in range(3):
        call(workers)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call(workers)
        ts.append(time.perf_counter() - t0)
    copies = sum(len(p[3]) if p[0] == "b" else 1 for w in workers for p in w.parts)
    r = {
        "call_GBps": nbytes / statistics.median(ts) / 1e9,
        "issue_us_per_copy": sum(w.issue_s for w in workers) / (reps + 3) / copies * 1e6,
    }
    r["cont_alone_GBps"], _ = window(lambda: time.sleep(0.3))
    before = model.forwards_s(8)
    r["model_GBps"], beside = window(lambda: model.forwards_s(16))
    after = model.forwards_s(8)
    r["model_slowdown_pct"] = (beside / ((before + after) / 2) - 1) * 100
    r["model_alone_drift_pct"] = (after / before - 1) * 100
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,4096", help="tokens per move")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--sub-batches", default="128,1024", help="copies per cuMemcpyBatchAsync call")
    ap.add_argument("--out", default=None, help="write the JSON here after every size (else print it)")
    args = ap.parse_args()
    load_driver()
    torch.zeros(1, device=DEV)
    ctx = ctypes.c_void_p()
    assert cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    kvbuf = torch.randint(-3000, 3000, (PLANES * NB * PIECE // 2,), device=DEV, dtype=torch.int16)
    planes_view = kvbuf.view(torch.uint8).view(PLANES, NB, PIECE)
    model = MatmulModel(1024, 32)
    model.forwards_s(4)
    res: dict[str, Any] = {"benchmark": "gpu_issue_threads", "command": "python " + " ".join(sys.argv)}
    res |= {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "v13": V13, "sizes": {}}
    gen = torch.Generator().manual_seed(1)
    threads = [int(x) for x in args.threads.split(",")]
    sub_batches = [int(x) for x in args.sub_batches.split(",")]
    for n in (int(x) for x in args.sizes.split(",")):
        nblk = n // BS
        table = (torch.randperm(NB - 1, generator=gen)[:nblk] + 1).numpy().astype(np.uint64)
        rows_of = torch.from_numpy(table.astype(np.int64)).to(DEV)
        nbytes = PLANES * nblk * PIECE
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        hb = host.data_ptr()
        pl = np.repeat(np.arange(PLANES, dtype=np.uint64), nblk)
        j = np.tile(np.arange(nblk, dtype=np.uint64), PLANES)
        dev_addr = np.uint64(kvbuf.data_ptr()) + (pl * np.uint64(NB) + table[j]) * np.uint64(PIECE)
        host_addr = np.uint64(hb) + (pl * np.uint64(nblk) + j) * np.uint64(PIECE)
        sizes = np.full(len(j), PIECE, dtype=np.uint64)
        want = planes_view[:, rows_of].cpu()
        dbuf = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_(0, 256)
        rows = {}
        for direction in ("store", "retrieve"):
            for name, t, sb, nstreams, attr in configs(threads, sub_batches):
                parts: list[list[tuple[Any, ...]]]
                if name == "pinned_copy":
                    one = (hb, dbuf.data_ptr()) if direction == "store" else (dbuf.data_ptr(), hb)
                    parts = [[("one", *one, nbytes)]]
                else:
                    parts = []
                    for c in np.array_split(np.arange(len(sizes)), t):
                        ps: list[tuple[Any, ...]] = []
                        for a in range(0, len(c), sb):
                            idx = c[a : a + sb]
                            d, s = (
                                (host_addr[idx], dev_addr[idx])
                                if direction == "store"
                                else (dev_addr[idx], host_addr[idx])
                            )
                            ps.append(("b", *(np.ascontiguousarray(x) for x in (d, s, sizes[idx]))))
                        parts.append(ps)
                workers = [Worker(p, nbytes // len(parts), ctx, nstreams, attr) for p in parts]
                # the bit-exact check: one move (the device idle before it: the workers' streams do not
                # wait for torch's)
                if direction == "store":
                    host.zero_()
                    torch.cuda.synchronize()
                    call(workers)
                    got = host.view(PLANES, nblk, PIECE) if name != "pinned_copy" else host
                    ok = bool(torch.equal(got, want if name != "pinned_copy" else dbuf.cpu()))
                elif name != "pinned_copy":
                    host.view(PLANES, nblk, PIECE).copy_(want)
                    planes_view[:, rows_of] = 0
                    torch.cuda.synchronize()
                    call(workers)
                    ok = bool(torch.equal(planes_view[:, rows_of].cpu(), want))
                else:
                    dbuf.zero_()
                    torch.cuda.synchronize()
                    call(workers)
                    ok = bool(torch.equal(dbuf.cpu(), host))
                r: dict[str, Any] = {"ok": ok, "copies": 1 if name == "pinned_copy" else len(sizes)}
                r |= measure(workers, nbytes, 20 if n <= 256 else 5, model)
                for w in workers:
                    w.cmd.put(("quit", None))
                rows[f"{direction}/{name}"] = r
                log(n, direction, name, json.dumps(r))
        res["sizes"][f"{n}_tokens"] = rows
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
                f.write("\n")
    if not args.out:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
