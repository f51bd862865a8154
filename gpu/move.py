"""One gather or scatter between paged KV and KV objects, validated once and passed as one value.

A ``Move`` holds what every implementation of a move needs (the torch reference, the Triton kernels, the
staged GPU<->L1 pipeline): the layout, the slot mapping, the spans, the objects, the per-span skips of a
scatter, the layers moved and how the slots are checked. Build it with ``Move.gather`` or ``Move.scatter``
(spans, skips and object shapes are checked there, once) and pass it to ``tiercache.gpu.dispatch``'s
``gather``/``scatter`` with the KV caches. A move may be run again (the same slot-mapping tensor, its values
possibly changed, into the same objects): what the kernel path prepares on the first run (launch arguments,
staging views, the flag buffer) is kept on the move, so a repeated run costs one launch and, unless trusted,
one wait for the kernel's slot flags. A move is run by one caller at a time.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiercache.gpu.layouts import PagedLayout, check_spans, fp8_payload_nbytes, object_spec, span_skips

if TYPE_CHECKING:
    import torch

__all__ = ["Checks", "Move"]


class Checks(enum.Enum):
    """How a move's slots are checked (a gather refuses slots < 0, every move slots past the paged KV).

    DEVICE: the move kernel flags bad slots per span (the reference checks them itself); the call waits for
    the flags. HOST: on the caller's CPU copy of the slot mapping (``host_slots``), or on a CPU slot mapping
    itself. NONE (``trusted``): the caller vouches for every slot; nothing waits (kernel paths only: the
    reference always checks). The kernels never touch a bad slot, whatever the mode."""

    DEVICE = "device"
    HOST = "host"
    NONE = "none"


@functools.lru_cache(maxsize=1024)
def _object_shape(layout: PagedLayout, tokens: int, first_layer: int, end_layer: int) -> tuple[int, ...]:
    """The shape of the object of ``tokens`` tokens holding layers ``[first_layer, end_layer)`` (cached: a
    move is built per request, from a handful of layouts and chunk sizes)."""
    spec = object_spec(layout, tokens)
    if end_layer - first_layer != layout.num_layers:
        spec = spec.with_layers(first_layer, end_layer)
    return tuple(spec.shape)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (cached)."""
    return str(dtype).removeprefix("torch.")


class Move:
    """A validated gather (objects written) or scatter (paged KV written); see the module docstring."""

    __slots__ = (
        "checks",
        "fp8",
        "host_slots",
        "layers",
        "layout",
        "objects",
        "prepared",
        "skips",
        "slot_mapping",
        "spans",
    )

    def __init__(
        self,
        layout: PagedLayout,
        slot_mapping: torch.Tensor,
        spans: tuple[tuple[int, int], ...],
        objects: tuple[torch.Tensor, ...],
        skips: tuple[int, ...] | None,
        layers: range,
        checks: Checks,
        host_slots: torch.Tensor | None,
        fp8: bool = False,
    ) -> None:
        """Prefer ``Move.gather`` / ``Move.scatter`` (or their ``_fp8`` forms), which validate; this stores
        the fields as given."""
        self.layout = layout
        self.slot_mapping = slot_mapping
        self.spans = spans
        self.objects = objects
        self.skips = skips
        self.layers = layers
        self.checks = checks
        self.host_slots = host_slots
        self.fp8 = fp8
        self.prepared: dict[Any, Any] = {}  # what the kernel paths prepared on a first run, by KV caches

    @classmethod
    def gather(
        cls,
        layout: PagedLayout,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        out: Sequence[torch.Tensor],
        *,
        layers: range | None = None,
        trusted: bool = False,
        host_slots: torch.Tensor | None = None,
    ) -> Move:
        """Copy the KV of tokens ``slot_mapping[start:end]`` of ``layers`` (all by default) into ``out[i]``
        (``object_spec`` shape, with only those layers). ``ValueError`` for bad spans, shapes or dtypes."""
        return cls._build(layout, slot_mapping, spans, out, None, layers, trusted, host_slots, False)

    @classmethod
    def scatter(
        cls,
        layout: PagedLayout,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        objects: Sequence[torch.Tensor],
        skip_prefix: int | Sequence[int] = 0,
        *,
        layers: range | None = None,
        trusted: bool = False,
        host_slots: torch.Tensor | None = None,
    ) -> Move:
        """Write object i's tokens into the paged KV at ``slot_mapping[start:end]``, leaving the first
        ``skip_prefix`` tokens of a span (an int for the first span, or one per span) and slots < 0 alone."""
        return cls._build(
            layout, slot_mapping, spans, objects, skip_prefix, layers, trusted, host_slots, False
        )

    @classmethod
    def gather_fp8(
        cls,
        layout: PagedLayout,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        payloads: Sequence[torch.Tensor],
        *,
        trusted: bool = False,
        host_slots: torch.Tensor | None = None,
    ) -> Move:
        """Quantize span i's KV (every layer) into ``payloads[i]``: its ``Fp8Codec("channel")`` payload
        (contiguous uint8, ``fp8_payload_nbytes`` bytes); a run raises ``ValueError`` for non-finite KV."""
        return cls._build(layout, slot_mapping, spans, payloads, None, None, trusted, host_slots, True)

    @classmethod
    def scatter_fp8(
        cls,
        layout: PagedLayout,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        payloads: Sequence[torch.Tensor],
        skip_prefix: int | Sequence[int] = 0,
        *,
        trusted: bool = False,
        host_slots: torch.Tensor | None = None,
    ) -> Move:
        """Dequantize ``payloads[i]`` (``gather_fp8``'s bytes) and write it like ``Move.scatter``."""
        return cls._build(layout, slot_mapping, spans, payloads, skip_prefix, None, trusted, host_slots, True)

    @classmethod
    def _build(
        cls,
        layout: PagedLayout,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        objects: Sequence[torch.Tensor],
        skip_prefix: int | Sequence[int] | None,
        layers: range | None,
        trusted: bool,
        host_slots: torch.Tensor | None,
        fp8: bool,
    ) -> Move:
        if fp8 and layout.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"fp8 moves encode bfloat16, float16 or float32 KV, not {layout.dtype}")
        layers = range(layout.num_layers) if layers is None else layers
        if len(layers) == 0 or not 0 <= layers.start < layers.stop <= layout.num_layers or layers.step != 1:
            raise ValueError(f"layers {layers} out of range for {layout.num_layers} layers")
        span_list = check_spans(spans, int(slot_mapping.shape[0]), len(objects))
        skips = None if skip_prefix is None else tuple(span_skips(skip_prefix, span_list))
        what = "payloads" if fp8 else "out" if skip_prefix is None else "objects"
        for i, ((s, e), obj) in enumerate(zip(span_list, objects, strict=True)):
            if fp8:
                n = fp8_payload_nbytes(layout, e - s)
                if str(obj.dtype) != "torch.uint8" or obj.numel() != n or not obj.is_contiguous():
                    raise ValueError(f"{what}[{i}] must be a contiguous uint8 tensor of {n} bytes")
                continue
            shape = _object_shape(layout, e - s, layers.start, layers.stop)
            if tuple(obj.shape) != shape:
                raise ValueError(
                    f"{what}[{i}] has shape {tuple(obj.shape)}, expected {shape} for {e - s} tokens"
                )
            if _dtype_name(obj.dtype) != layout.dtype:
                raise ValueError(f"{what}[{i}] has dtype {obj.dtype}, layout dtype is {layout.dtype}")
        if host_slots is not None and (
            host_slots.device.type != "cpu" or tuple(host_slots.shape) != tuple(slot_mapping.shape)
        ):
            raise ValueError(
                f"host_slots must be a CPU tensor shaped like slot_mapping {tuple(slot_mapping.shape)}, "
                f"got {tuple(host_slots.shape)} on {host_slots.device}"
            )
        if trusted:
            checks = Checks.NONE
        elif host_slots is not None or slot_mapping.device.type == "cpu":
            checks = Checks.HOST
        else:
            checks = Checks.DEVICE
        return cls(
            layout, slot_mapping, tuple(span_list), tuple(objects), skips, layers, checks, host_slots, fp8
        )

    def with_objects(self, objects: Sequence[torch.Tensor]) -> Move:
        """This move into / out of other objects of the same shapes (a pipeline's staging views); not
        checked again."""
        return Move(
            self.layout,
            self.slot_mapping,
            self.spans,
            tuple(objects),
            self.skips,
            self.layers,
            self.checks,
            self.host_slots,
            self.fp8,
        )

    @property
    def is_scatter(self) -> bool:
        """True for a scatter (objects -> paged KV), False for a gather."""
        return self.skips is not None

    @property
    def span_skips(self) -> tuple[int, ...]:
        """The skips of every span (zeros for a gather)."""
        return self.skips if self.skips is not None else (0,) * len(self.spans)

    @property
    def tokens_past_skips(self) -> int:
        """Tokens past the skips: what a scatter writes when no slot is < 0 (a trusted scatter's count)."""
        return sum(max(0, e - s - k) for (s, e), k in zip(self.spans, self.span_skips, strict=True))

    def __repr__(self) -> str:
        kind = ("scatter" if self.is_scatter else "gather") + ("_fp8" if self.fp8 else "")
        return f"Move.{kind}({len(self.spans)} spans, layers {self.layers}, checks {self.checks.value})"
