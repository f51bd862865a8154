"""``tiercache demo``: a prefill process stores prompts, a separate decode process restores and verifies them.

The parent (the CLI) makes a work dir, spawns ``python -P -m tiercache.cli.demo prefill`` and then
``... decode`` as real OS processes (so only L2 is shared), reads the JSON each writes, prints a table per
request and the totals, and fails if any restored KV differs from what the prefill computed. KV is a
deterministic function of the token ids and positions (``expected_kv``), so both processes know it
without sharing tensors.

Run a step by hand (tests do, to corrupt the L2 between the steps)::

    python -P -m tiercache.cli.demo prefill --workdir DIR [--config FILE] --out prefill.json
    python -P -m tiercache.cli.demo decode  --workdir DIR [--config FILE] --out decode.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercache.config import redact_url
from tiercache.errors import TiercacheError

if TYPE_CHECKING:
    import torch

    from tiercache.config import Config
    from tiercache.gpu.layouts import PagedLayout
    from tiercache.store.engine import CacheEngine, LookupResult

__all__ = [
    "DemoRequest",
    "demo_config",
    "demo_layout",
    "demo_requests",
    "expected_kv",
    "run_demo",
    "verdict_lines",
]

MODEL = "tiercache-demo/toy-4L-2H-64D-int"  # the integer toy KV (``expected_kv``)
VOCAB = 32000
LOCAL_HIT = 288  # tokens a decode request already holds in its own GPU prefix cache (seed §5's example)
_POISON = 0x5A5A  # bit pattern of never-written paged KV in the decode process (int16 view)
_PREFILL_SEED = 1
_DECODE_SEED = 2


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One demo request: name, token ids, whether prefill stores it, tokens decode already holds locally."""

    name: str
    tokens: tuple[int, ...]
    prefilled: bool
    local: int = 0


def demo_layout() -> PagedLayout:
    """The toy model's paged layout: vLLM flash view, 4 layers, 2 KV heads of 64, blocks of 16, bf16."""
    from tiercache.gpu.layouts import LayoutKind, PagedLayout

    return PagedLayout(
        LayoutKind.VLLM_FLASH, num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
    )


def demo_config(workdir: Path) -> Config:
    """The embedded default (as ``examples/embedded.toml``): 1 GiB L1 + a POSIX tier under ``workdir/l2``."""
    from tiercache.config import config_from_dict

    return config_from_dict(
        {
            "chunk_size": 256,
            "save_unfull_chunk": True,
            "l1": {"capacity": "1GiB"},
            "tiers": [
                {
                    "name": "disk",
                    "url": f"file://{workdir.resolve()}/l2",
                    "capacity": "4GiB",
                    "codecs": ["raw"],
                }
            ],
        },
        source="<embedded default>",
    )


def demo_requests() -> list[DemoRequest]:
    """Six requests: a shared 1000-token system prompt + user turns, a repeat, an unrelated prompt, and one
    turn the prefill never saw (its shared prefix still hits)."""
    import random

    rng = random.Random(20240601)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    system = ids(1000)
    a, b, c, d = ids(400), ids(600), ids(300), ids(500)
    return [
        DemoRequest("chat-a", system + a, prefilled=True),
        DemoRequest("chat-b", system + b, prefilled=True),
        DemoRequest("chat-c+local", system + c, prefilled=True, local=LOCAL_HIT),
        DemoRequest("chat-a-again", system + a, prefilled=True),
        DemoRequest("solo", ids(700), prefilled=True),
        DemoRequest("chat-d-new", system + d, prefilled=False),
    ]


# ----- the toy model's KV -----------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF  # the hash works on 32-bit values: times a multiplier below 2**31 it stays inside int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """32-bit values (int64) scrambled by rounds of xor-shift and odd multiply mod 2**32 (exact, in place)."""
    for mult in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x.bitwise_xor_(x >> 15).mul_(mult).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def _bf16_bits(x: torch.Tensor, exponent: int) -> torch.Tensor:
    """bfloat16 bit patterns (int16) taking the sign and the 9 low bits from ``x`` (2 exponent bits and the
    mantissa) around the fixed ``exponent`` bits (``0x3E00``: exponents 124..127, magnitudes 1/8 to 2; 0: the
    taken bits alone, a pattern that flips them and keeps the fixed ones)."""
    import torch

    return (((x & 0x01FF) | exponent) - (x & 0x8000)).to(torch.int16)


def expected_kv(tokens: Sequence[int], layout: PagedLayout) -> torch.Tensor:
    """The toy model's KV of ``tokens``: ``[2, L, T, H*D]`` in the layout's dtype, a deterministic function of
    the token ids, their positions and the prefix before them (never zero, never the poison pattern).

    Integer arithmetic only, then exact conversions: every process on every CPU computes the same bytes
    (transcendental float math does not: torch's scalar and vectorized kernels round differently, so a
    frame stored by a process on another math path would restore as wrong KV)."""
    import torch

    layers, width = layout.num_layers, layout.num_kv_heads * layout.head_dim
    ids = torch.tensor(list(tokens), dtype=torch.int64) & _MASK32
    pos = torch.arange(ids.numel(), dtype=torch.int64)
    prefix = torch.cumsum(ids, 0) & _MASK32  # KV depends on the whole prefix
    seed = _mix((_mix((_mix(ids.clone()) + pos) & _MASK32) + prefix) & _MASK32)  # [T]
    channel = torch.arange(width, dtype=torch.int64)
    rows = _bf16_bits(_mix((seed[:, None] * 31 + channel) & _MASK32), 0x3E00)  # [T, H*D]
    # each plane and layer flips its own constant pattern of the random bits (the exponent bits stay)
    flips = _bf16_bits(_mix(torch.arange(1, 2 * layers * width + 1, dtype=torch.int64)), 0)
    kv = (rows[None, None] ^ flips.view(2, layers, 1, width)).view(torch.bfloat16)
    return kv.to(getattr(torch, layout.dtype)).contiguous()


class _PagedKV:
    """One process's paged KV (per layer ``[NB, H, BS, 2D]``) and a seeded, shuffled free-block list."""

    def __init__(self, layout: PagedLayout, num_blocks: int, seed: int, poison: bool) -> None:
        import torch

        self.layout = layout
        dtype = getattr(torch, layout.dtype)
        self.caches = [
            torch.zeros(layout.layer_shape(num_blocks), dtype=dtype) for _ in range(layout.num_layers)
        ]
        if poison:
            for layer in self.caches:
                layer.view(torch.int16).fill_(_POISON)
        gen = torch.Generator().manual_seed(seed)
        self._free = torch.randperm(num_blocks, generator=gen).tolist()

    def allocate(self, num_tokens: int) -> torch.Tensor:
        """Fresh blocks for ``num_tokens`` tokens; returns the slot mapping (block_id * BS + offset)."""
        import torch

        bs = self.layout.block_size
        need = -(-num_tokens // bs)
        if need > len(self._free):
            raise TiercacheError(f"demo paged KV is out of blocks ({need} needed, {len(self._free)} free)")
        blocks = torch.tensor([self._free.pop() for _ in range(need)], dtype=torch.int64)
        offsets = torch.arange(bs, dtype=torch.int64)
        return (blocks[:, None] * bs + offsets).reshape(-1)[:num_tokens]

    def write(self, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``[2, L, T, H*D]`` KV into the slots (what the model's forward pass would do)."""
        from tiercache.gpu import Move, reference

        reference.scatter(
            self.caches, Move.scatter(self.layout, slot_mapping[: kv.shape[2]], [(0, kv.shape[2])], [kv])
        )

    def read(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The KV at the slots as ``[2, L, T, H*D]``."""
        import torch

        from tiercache.gpu import Move, reference
        from tiercache.gpu.layouts import object_spec

        t = int(slot_mapping.shape[0])
        out = torch.empty(object_spec(self.layout, t).shape, dtype=getattr(torch, self.layout.dtype))
        if t:
            reference.gather(self.caches, Move.gather(self.layout, slot_mapping, [(0, t)], [out]))
        return out

    def untouched(self, slot_mapping: torch.Tensor) -> bool:
        """True when every slot still holds the poison pattern (nothing was written there)."""
        import torch

        if not slot_mapping.numel():
            return True
        return bool((self.read(slot_mapping).view(torch.int16) == _POISON).all())


def _blocks_for(requests: Sequence[DemoRequest], block_size: int) -> int:
    return sum(-(-len(r.tokens) // block_size) for r in requests) + 8


def _progress(role: str, message: str) -> None:
    print(f"[{role} pid {os.getpid()}] {message}", file=sys.stderr, flush=True)


async def _open_engine(config: Config, layout: PagedLayout, metrics: Any) -> CacheEngine:
    from tiercache.store.engine import CacheEngine

    return await CacheEngine.open(config, layout, model=MODEL, metrics=metrics)


# ----- the two processes ------------------------------------------------------------------------------------
async def prefill(config: Config) -> dict[str, Any]:
    """Compute (write) each prefilled request's KV into this process's paged KV and store it; drain to L2."""
    from tiercache.metrics import Metrics

    layout = demo_layout()
    requests = [r for r in demo_requests() if r.prefilled]
    paged = _PagedKV(layout, _blocks_for(requests, layout.block_size), _PREFILL_SEED, poison=False)
    metrics = Metrics()
    engine = await _open_engine(config, layout, metrics)
    rows: list[dict[str, Any]] = []
    try:
        for req in requests:
            slots = paged.allocate(len(req.tokens))
            paged.write(expected_kv(req.tokens, layout), slots)
            stored = await engine.store(list(req.tokens), paged.caches, slots)
            rows.append({"name": req.name, "tokens": len(req.tokens), "stored": stored})
            _progress("prefill", f"{req.name}: {len(req.tokens)} tokens, {stored} newly stored")
        started = time.perf_counter()
        await engine.drain()
        _progress("prefill", f"L2 stores drained in {time.perf_counter() - started:.2f} s")
    finally:
        await engine.aclose()
    dropped = {t.name: _stores_dropped(metrics, t.name) for t in config.tiers}
    return {
        "role": "prefill",
        "pid": os.getpid(),
        "requests": rows,
        "stores_dropped": dropped,
        "metrics": metrics.render(),
    }


def _stores_dropped(metrics: Any, tier: str) -> int:
    """Stores of ``tier`` that did not land (any ``reason`` of ``tiercache_stores_dropped``)."""
    from tiercache.metrics import DROP_REASONS

    name = "tiercache_stores_dropped_total"
    return int(sum(metrics.value(name, tier=tier, reason=reason) for reason in DROP_REASONS))


CHECK_BYTES = "bytes"
CHECK_MASK = "ret_mask"
CHECK_PAST_END = "blocks past the restored end"
"""The three checks of a restored request, as ``failed_checks`` names them."""


def _bad_tokens(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per token of ``got`` (``[2, L, T, H*D]``): whether its KV differs from ``expected``'s (first T)."""
    import torch

    want = expected[:, :, : got.shape[2]]
    return (got.view(torch.int16) != want.view(torch.int16)).flatten(3).any(3).any(1).any(0)


def _failed_checks(
    paged: _PagedKV,
    slots: torch.Tensor,
    got: torch.Tensor,
    expected: torch.Tensor,
    ret_mask: torch.Tensor,
    local: int,
    restored_end: int,
    chunk_size: int,
    hit_tiers: Sequence[str],
    *,
    kv_ok: bool,
    untouched: bool,
    mask_ok: bool,
) -> dict[str, str]:
    """Each failed check of one request and where it first fails: the first token whose KV differs from
    the prefill's (and which chunk, which tier served it, what its bytes look like), the first token past
    the restored end that was written, the first ret_mask entry that is wrong."""
    import torch

    held = int(got.shape[2])
    out: dict[str, str] = {}
    if not kv_ok:
        bad = _bad_tokens(got, expected)
        first, count = int(bad.nonzero()[0, 0]), int(bad.sum())
        chunk = first // chunk_size
        source = hit_tiers[chunk] if chunk < len(hit_tiers) else "no tier"
        part = "the local prefix" if first < local else "the restored part"
        token = got[:, :, first].view(torch.int16)
        if bool((token == _POISON).all()):
            looks = "never written (poison)"
        elif not bool(token.any()):
            looks = "zeros"
        else:
            diff = token != expected[:, :, first].view(torch.int16)
            looks = f"{int(diff.sum())} of {diff.numel()} values differ"
        out[CHECK_BYTES] = (
            f"bytes: token {first} differs from the prefill's ({part}, chunk {chunk} served by {source}, "
            f"block offset {first % paged.layout.block_size}: {looks}); {count} of {held} tokens differ"
        )
    if not untouched:
        rest = paged.read(slots[held:]).view(torch.int16)
        written = (rest != _POISON).flatten(3).any(3).any(1).any(0)
        first, count = held + int(written.nonzero()[0, 0]), int(written.sum())
        out[CHECK_PAST_END] = (
            f"blocks past the restored end: token {first} was written though the restore ended at "
            f"{restored_end} ({count} tokens written past it)"
        )
    if not mask_ok:
        want = torch.zeros(int(ret_mask.shape[0]), dtype=torch.bool)
        want[local:restored_end] = True
        wrong = ret_mask.to(torch.bool) != want
        first, count = int(wrong.nonzero()[0, 0]), int(wrong.sum())
        out[CHECK_MASK] = (
            f"ret_mask: token {first} is {bool(ret_mask[first])}, expected True exactly for tokens "
            f"{local}..{restored_end - 1} ({count} entries wrong)"
        )
    return out


async def _object_holds(
    engine: CacheEngine, hit: LookupResult, chunk: int, expected: torch.Tensor, chunk_size: int
) -> str:
    """What the object that served ``chunk`` of a failed restore holds now, read again from its tier: the
    prefill's KV (then the copy into L1 or into the paged KV went wrong) or other bytes (a valid frame that
    a process computing other KV stored under the same key)."""
    import torch

    from tiercache.errors import FrameError

    if chunk >= len(hit.tiers):
        return "no object served that chunk"
    key, tier = hit.keys[chunk], hit.tiers[chunk]
    want = expected[:, :, chunk * chunk_size : (chunk + 1) * chunk_size]
    if tier == engine.l1_tier:
        what = "its L1 object"
        lease = engine.manager.l1.acquire(key)
        if lease is None:
            return f"{what} is gone now"
        try:
            held = lease.obj.tensor().clone()
        finally:
            lease.release()
    else:
        what = f"its object in {tier}"
        client = next(t for t in engine.manager.tiers if t.name == tier)
        try:
            frame = (await client.adapter.batched_get([key]))[0]
        except TiercacheError as exc:
            return f"{what} cannot be read again ({exc})"
        if frame is None:
            return f"{what} is gone now"
        try:
            held, _ = client.pipeline.decode(frame, key)
        except FrameError as exc:
            return f"{what} fails its checks now ({exc})"
    if held.shape != want.shape:
        return f"{what} holds {tuple(held.shape)}, not {tuple(want.shape)}"
    differ = int((held.view(torch.int16) != want.view(torch.int16)).sum())
    if not differ:
        return f"{what} holds the prefill's KV (the copy out of it went wrong)"
    return f"{what} holds other KV ({differ} of {want.numel()} values differ: a valid frame of other bytes)"


def _tier_tokens(hit_tiers: Sequence[str], num_tokens: int, chunk_size: int, l1: bool) -> int:
    """Tokens of the chunks of a lookup's prefix served by L1 (``l1``) or by any L2 tier (not ``l1``)."""
    total = 0
    for i, tier in enumerate(hit_tiers):
        if (tier == "L1") == l1:
            total += min((i + 1) * chunk_size, num_tokens) - i * chunk_size
    return total


async def decode(config: Config) -> dict[str, Any]:
    """Look up each request, restore what this process lacks into fresh blocks, verify bit-exact."""
    import torch

    from tiercache.gpu.layouts import plan_read
    from tiercache.metrics import Metrics

    layout = demo_layout()
    requests = demo_requests()
    paged = _PagedKV(layout, _blocks_for(requests, layout.block_size), _DECODE_SEED, poison=True)
    metrics = Metrics()
    engine = await _open_engine(config, layout, metrics)
    cs = config.chunk_size
    rows: list[dict[str, Any]] = []
    try:
        for req in requests:
            tokens = list(req.tokens)
            n = len(tokens)
            slots = paged.allocate(n)
            expected = expected_kv(tokens, layout)
            if req.local:
                paged.write(expected[:, :, : req.local], slots)  # the local GPU prefix hit
            hit = await engine.lookup_hit(tokens)
            res = await engine.retrieve_result(tokens, paged.caches, slots, skip_tokens=req.local)
            restored_end = req.local + res.tokens_written if res.tokens_written else req.local
            plan = plan_read(req.local, restored_end, cs)
            tokens_read = sum(e - s for s, e in plan.spans)  # whole chunks (the tail chunk may be short)
            held = max(req.local, restored_end)
            mask_ok = bool(res.ret_mask[req.local : restored_end].all()) and int(res.ret_mask.sum()) == (
                restored_end - req.local
            )
            got = paged.read(slots[:held])
            bits = torch.int16
            kv_ok = bool(torch.equal(got.view(bits), expected[:, :, :held].view(bits)))
            untouched = paged.untouched(slots[held:])
            verified = kv_ok and untouched and mask_ok
            failed = (
                {}
                if verified
                else _failed_checks(
                    paged,
                    slots,
                    got,
                    expected,
                    res.ret_mask,
                    req.local,
                    restored_end,
                    cs,
                    hit.tiers,
                    kv_ok=kv_ok,
                    untouched=untouched,
                    mask_ok=mask_ok,
                )
            )
            if CHECK_BYTES in failed:
                first = int(_bad_tokens(got, expected).nonzero()[0, 0])
                held_now = await _object_holds(engine, hit, first // cs, expected, cs)
                failed[CHECK_BYTES] += f"; {held_now}"
            row = {
                "name": req.name,
                "tokens": n,
                "prefilled": req.prefilled,
                "local": req.local,
                "hit": hit.tokens,
                "l1_hit": _tier_tokens(hit.tiers, n, cs, l1=True),
                "l2_hit": _tier_tokens(hit.tiers, n, cs, l1=False),
                "l1_chunks": hit.chunks_in("L1"),
                "l2_chunks": hit.chunks - hit.chunks_in("L1"),
                "read": tokens_read,
                "written": res.tokens_written,
                "skip": res.skip_prefix,
                "restored_end": restored_end,
                "fallback": max(0, hit.tokens - held),
                "compute": n - held,
                "verified": verified,
                "kv_exact": kv_ok,
                "rest_untouched": untouched,
                "ret_mask_ok": mask_ok,
                "failed_checks": failed,
            }
            rows.append(row)
            verdict = "verified" if verified else "MISMATCH: " + "; ".join(failed.values())
            _progress(
                "decode",
                f"{req.name}: hit {hit.tokens}/{n} (L1 {row['l1_chunks']} + L2 {row['l2_chunks']} chunks), "
                f"wrote {res.tokens_written}, {verdict}",
            )
    finally:
        await engine.aclose()
    rejected = sum(metrics.value("tiercache_frames_rejected_total", tier=t.name) for t in config.tiers)
    return {
        "role": "decode",
        "pid": os.getpid(),
        "requests": rows,
        "frames_rejected": rejected,
        "metrics": metrics.render(),
    }


def _child_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one demo process (``python -P -m tiercache.cli.demo prefill|decode ...``)."""
    parser = argparse.ArgumentParser(prog="python -m tiercache.cli.demo")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--workdir", required=True, type=Path, help="work dir (the default L2 lives in it)")
    parser.add_argument("--config", help="config file to use instead of the embedded default")
    parser.add_argument("--out", required=True, type=Path, help="where to write this step's JSON result")
    args = parser.parse_args(argv)
    try:
        from tiercache.config import load_config

        config = load_config(args.config) if args.config else demo_config(args.workdir)
        step = prefill if args.role == "prefill" else decode
        result = asyncio.run(step(config))
        args.out.write_text(json.dumps(result, indent=2))
    except Exception as exc:
        print(f"tiercache demo {args.role}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


# ----- the parent -------------------------------------------------------------------------------------------
def _sealed(codecs: Sequence[Any]) -> str:
    """ "encrypted (aesgcm)" or "not encrypted" for a tier's codec chain."""
    from tiercache.serde import encrypting_codecs

    found = encrypting_codecs(codecs)
    return f"encrypted ({'+'.join(found)})" if found else "not encrypted"


def check_shared(config: Config) -> None:
    """``TiercacheError`` unless some L2 tier is shared between processes (the demo's two need one)."""
    from tiercache.registry import get_registry

    registry = get_registry()
    for tier in config.tiers:
        if tier.adapter is not None:
            cls = registry.adapter_class("", target=tier.adapter)
        else:
            cls = registry.adapter_class(registry.resolve_scheme(tier.url))
        if cls.capabilities.shared:
            return
    names = ", ".join(f"{t.name} ({redact_url(t.url)})" for t in config.tiers) or "none"
    raise TiercacheError(
        f"the demo needs an L2 tier shared between processes (e.g. file://); tiers of "
        f"{config.source or 'the config'}: {names}"
    )


def _run_step(role: str, workdir: Path, config_path: str | None) -> dict[str, Any]:
    out = workdir / f"{role}.json"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "tiercache.cli.demo",
        role,
        "--workdir",
        str(workdir),
        "--out",
        str(out),
    ]
    if config_path:
        cmd += ["--config", config_path]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise TiercacheError(f"the {role} process failed (exit status {proc.returncode})")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


_COLUMNS = (
    ("request", "name", "<"),
    ("tokens", "tokens", ">"),
    ("stored", "stored", ">"),
    ("local hit", "local", ">"),
    ("L1 hit", "l1_hit", ">"),
    ("L2 hit", "l2_hit", ">"),
    ("read", "read", ">"),
    ("written", "written", ">"),
    ("compute", "compute", ">"),
    ("verified", "verified", ">"),
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The per-request table and a totals line, aligned."""

    def cell(row: dict[str, Any], key: str) -> str:
        value = row.get(key, "")
        if isinstance(value, bool):
            return "yes" if value else "NO"
        return str(value)

    totals: dict[str, Any] = {"name": "total"}
    for _, key, _ in _COLUMNS[1:]:
        values = [r.get(key) for r in rows]
        if all(isinstance(v, bool) for v in values):
            totals[key] = f"{sum(bool(v) for v in values)}/{len(values)}"
        else:
            totals[key] = sum(int(v or 0) for v in values)
    body = [[cell(r, key) for _, key, _ in _COLUMNS] for r in [*rows, totals]]
    widths = [max(len(title), *(len(line[i]) for line in body)) for i, (title, _, _) in enumerate(_COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        parts = [f"{c:{align}{w}}" for c, w, (_, _, align) in zip(cells, widths, _COLUMNS, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join(
        [line([t for t, _, _ in _COLUMNS]), rule, *(line(c) for c in body[:-1]), rule, line(body[-1])]
    )


def verdict_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The demo's verdict: OK, or FAILED naming the checks that failed, then one line per failed check of
    each request saying where it first fails (``failed_checks``)."""
    if all(r["verified"] for r in rows):
        return ["OK: every restored token is bit-exact"]
    checks = sorted({c for r in rows for c in r.get("failed_checks", {})}) or ["unknown"]
    lines = [f"FAILED ({', '.join(checks)}): restored KV differs from the prefill's"]
    for r in rows:
        for why in r.get("failed_checks", {}).values():
            lines.append(f"  {r['name']}: {why}")
    return lines


def run_demo(
    config_path: str | None = None, *, json_path: str | None = None, show_metrics: bool = False
) -> int:
    """Run prefill then decode as separate processes, print the table; 0 if every request verified, else 1."""
    from tiercache.config import load_config

    config_file = str(Path(config_path).resolve()) if config_path else None
    workdir = Path(tempfile.mkdtemp(prefix="tiercache-demo-"))
    try:
        config = load_config(config_file) if config_file else demo_config(workdir)
        check_shared(config)
        tiers = ", ".join(f"{t.name}={redact_url(t.url)} ({_sealed(t.codecs)})" for t in config.tiers)
        source = config.source or "embedded default"
        print(f"tiercache demo: {source}: L1 + {tiers}; chunk_size={config.chunk_size}", file=sys.stderr)
        started = time.perf_counter()
        pre = _run_step("prefill", workdir, config_file)
        dec = _run_step("decode", workdir, config_file)
        elapsed = time.perf_counter() - started
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stored = {r["name"]: r["stored"] for r in pre["requests"]}
    rows = [{**r, "stored": stored.get(r["name"], 0)} for r in dec["requests"]]
    ok = all(r["verified"] for r in rows)
    print(
        f"prefill pid {pre['pid']} stored {sum(stored.values())} tokens; "
        f"decode pid {dec['pid']} restored into its own blocks ({elapsed:.1f} s)"
    )
    print(format_table(rows))
    print(f"frames rejected (served as misses): {dec['frames_rejected']:.0f}")
    dropped = {tier: n for tier, n in pre.get("stores_dropped", {}).items() if n}
    if dropped:
        counts = ", ".join(f"{tier} {n}" for tier, n in dropped.items())
        print(f"prefill stores dropped: {counts} (the decode reads what those tiers held before, or misses)")
    print("\n".join(verdict_lines(rows)))
    if show_metrics:
        print()
        print(dec["metrics"], end="")
    if json_path:
        summary = {
            "ok": ok,
            "config": config_file or "embedded default",
            "chunk_size": config.chunk_size,
            "seconds": round(elapsed, 3),
            "prefill": pre,
            "decode": dec,
            "requests": rows,
            "metrics": dec["metrics"],
        }
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_child_main())
