"""One memory pool per device for both cache kinds (seed 000, design.md "Memory").

The pool is a single byte buffer. KDA *slots* (every KDA layer's recurrent + conv state of one
sequence) grow from the left end, MLA *pages* (``page_size`` tokens x every MLA layer x 576
values) grow from the right end; the free space is the middle, shared by both kinds. Their
demand follows different workload dimensions (concurrency vs context), so one shared middle
admits mixes a static split would refuse.

Both regions stay packed: freeing a unit inside a region moves the region's outermost unit into
the hole and reports the move, so the owner's id can be rewritten. Ids are *physical*: slot i
lives at byte i * slot_bytes, page p at byte base + p * page_bytes, so the model's strided
per-layer views index them directly. Live slot ids are [0, num_slots); live page ids are
[page_capacity - num_pages, page_capacity).

Static-split mode (the baseline the seeds compare against) caps each kind at a fixed share.

Past the accounted bytes sit one scratch page and one scratch slot, never allocated: the padding
rows of shape-static (CUDA-graph) decode steps read and write there, so padding can never touch a
live sequence's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model.batch import CacheHandles, KDALayerCache, MLALayerCache

ALIGN = 256  # unit sizes are padded to this many bytes (vector loads, TMA-friendly)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class PoolLayout:
    """Byte sizes of the two units and where each layer's piece sits inside a unit."""

    slot_bytes: int
    page_bytes: int
    page_size: int
    recurrent_bytes: int  # per KDA layer
    conv_bytes: int  # per KDA layer
    latent_bytes: int  # per MLA layer per page

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: torch.dtype, page_size: int = 64) -> "PoolLayout":
        elt = torch.tensor([], dtype=dtype).element_size()
        H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        rec = H * D * D * 4
        conv = 3 * H * D * (W - 1) * elt
        lat = page_size * cfg.mla_cache_width * elt
        slot = _align(cfg.num_kda_layers * (rec + conv)) if cfg.num_kda_layers else 0
        page = _align(cfg.num_mla_layers * lat) if cfg.num_mla_layers else 0
        return cls(slot, page, page_size, rec, conv, lat)


class PoolFull(Exception):
    """No room for the unit asked for (the scheduler evicts, preempts or waits)."""


class UnifiedPool:
    def __init__(self, cfg: ModelConfig, total_bytes: int, dtype: torch.dtype, device=None, page_size: int = 64,
                 kda_fraction: float | None = None):
        """``kda_fraction`` set: static split, slots limited to that share of the bytes, pages to the rest."""
        self.cfg, self.dtype = cfg, dtype
        self.layout = lay = PoolLayout.for_model(cfg, dtype, page_size)
        self.total_bytes = total_bytes - total_bytes % ALIGN
        if self.total_bytes < max(lay.slot_bytes, 1) + max(lay.page_bytes, 1):
            raise ValueError(f"a pool of {total_bytes} bytes cannot hold one KDA slot ({lay.slot_bytes} B) "
                             f"and one MLA page ({lay.page_bytes} B)")
        if kda_fraction is not None:
            if not 0.0 < kda_fraction < 1.0:
                raise ValueError(f"kda_fraction must be in (0, 1), got {kda_fraction}")
            self.slot_limit_bytes = int(self.total_bytes * kda_fraction)
            self.page_limit_bytes = self.total_bytes - self.slot_limit_bytes
        else:
            self.slot_limit_bytes = self.page_limit_bytes = self.total_bytes
        self.slot_capacity = self.total_bytes // lay.slot_bytes if lay.slot_bytes else 0
        self.page_capacity = self.total_bytes // lay.page_bytes if lay.page_bytes else 0
        self.page_base = self.total_bytes - self.page_capacity * lay.page_bytes
        # Scratch units: page id page_capacity (right after the accounted bytes), then the first
        # slot id whose physical offset lies past that page.
        self.scratch_page = self.page_capacity
        self.scratch_slot = -(-(self.total_bytes + lay.page_bytes) // lay.slot_bytes) if lay.slot_bytes else 0
        end = (self.scratch_slot + 1) * lay.slot_bytes if lay.slot_bytes else self.total_bytes + lay.page_bytes
        self.buffer = torch.zeros(end, dtype=torch.uint8, device=device)
        self.num_slots = 0
        self.num_pages = 0
        self.handles = self._views()

    # ---- accounting -----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.num_slots * self.layout.slot_bytes + self.num_pages * self.layout.page_bytes

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def can_allocate(self, slots: int = 0, pages: int = 0) -> bool:
        lay = self.layout
        s_bytes = (self.num_slots + slots) * lay.slot_bytes
        p_bytes = (self.num_pages + pages) * lay.page_bytes
        return (s_bytes + p_bytes <= self.total_bytes and s_bytes <= self.slot_limit_bytes
                and p_bytes <= self.page_limit_bytes)

    def fits_alone(self, slots: int, pages: int) -> bool:
        """Whether this much could ever fit, in an otherwise empty pool."""
        lay = self.layout
        s, p = slots * lay.slot_bytes, pages * lay.page_bytes
        return s + p <= self.total_bytes and s <= self.slot_limit_bytes and p <= self.page_limit_bytes

    # ---- allocation -----------------------------------------------------------------------
    def alloc_slot(self) -> int:
        if not self.can_allocate(slots=1):
            raise PoolFull("no room for a KDA slot")
        self.num_slots += 1
        return self.num_slots - 1

    def alloc_page(self) -> int:
        if not self.can_allocate(pages=1):
            raise PoolFull("no room for an MLA page")
        self.num_pages += 1
        return self.page_capacity - self.num_pages

    def free_slot(self, slot: int) -> tuple[int, int] | None:
        """Frees ``slot``; returns (old_id, new_id) of the unit moved into the hole, if any."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated (live: 0..{self.num_slots - 1})")
        last = self.num_slots - 1
        self.num_slots -= 1
        if slot == last:
            return None
        self._copy_unit(self._slot_offset(last), self._slot_offset(slot), self.layout.slot_bytes)
        return last, slot

    def free_page(self, page: int) -> tuple[int, int] | None:
        lo = self.page_capacity - self.num_pages
        if not lo <= page < self.page_capacity:
            raise ValueError(f"page {page} is not allocated (live: {lo}..{self.page_capacity - 1})")
        self.num_pages -= 1
        if page == lo:
            return None
        self._copy_unit(self._page_offset(lo), self._page_offset(page), self.layout.page_bytes)
        return lo, page

    def copy_slot(self, src: int, dst: int) -> None:
        """Whole-slot copy (forks for n > 1, prefix-cache checkpoints)."""
        self._copy_unit(self._slot_offset(src), self._slot_offset(dst), self.layout.slot_bytes)

    def copy_page(self, src: int, dst: int) -> None:
        self._copy_unit(self._page_offset(src), self._page_offset(dst), self.layout.page_bytes)

    def slot_bytes_of(self, slot: int) -> torch.Tensor:
        return self.buffer[self._slot_offset(slot): self._slot_offset(slot) + self.layout.slot_bytes]

    def page_bytes_of(self, page: int) -> torch.Tensor:
        return self.buffer[self._page_offset(page): self._page_offset(page) + self.layout.page_bytes]

    # ---- internals ------------------------------------------------------------------------
    def _slot_offset(self, slot: int) -> int:
        return slot * self.layout.slot_bytes

    def _page_offset(self, page: int) -> int:
        return self.page_base + page * self.layout.page_bytes

    def _copy_unit(self, src: int, dst: int, n: int) -> None:
        self.buffer[dst:dst + n].copy_(self.buffer[src:src + n])  # units never overlap

    def _views(self) -> CacheHandles:
        """Per-layer strided views over the one buffer, indexed by slot / page id."""
        cfg, lay = self.cfg, self.layout
        H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        f32 = self.buffer.view(torch.float32)
        act = self.buffer.view(self.dtype)
        fsz, asz = 4, act.element_size()
        nslots = self.scratch_slot + 1  # ids past slot_capacity other than the scratch one are never used
        kda = []
        for i in range(cfg.num_kda_layers):
            rec_off = i * lay.recurrent_bytes
            conv_off = cfg.num_kda_layers * lay.recurrent_bytes + i * lay.conv_bytes
            kda.append(KDALayerCache(
                recurrent=f32.as_strided((nslots, H, D, D), (lay.slot_bytes // fsz, D * D, D, 1), rec_off // fsz),
                conv=act.as_strided((nslots, 3 * H * D, W - 1), (lay.slot_bytes // asz, W - 1, 1), conv_off // asz),
            ))
        mla = []
        width = cfg.mla_cache_width
        for j in range(cfg.num_mla_layers):
            off = self.page_base + j * lay.latent_bytes
            mla.append(MLALayerCache(act.as_strided(
                (self.page_capacity + 1, lay.page_size, width), (lay.page_bytes // asz, width, 1), off // asz)))
        return CacheHandles(kda=kda, mla=mla, page_size=lay.page_size)

    def stats(self) -> dict:
        return dict(total_bytes=self.total_bytes, used_bytes=self.used_bytes, kda_slots=self.num_slots,
                    mla_pages=self.num_pages, kda_bytes=self.num_slots * self.layout.slot_bytes,
                    mla_bytes=self.num_pages * self.layout.page_bytes)


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    for u, mult in units.items():
        if s.lower().endswith(u):
            num = s[: -len(u)].strip()
            try:
                return int(math.floor(float(num) * mult))
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"cannot read a byte size from {text!r} (examples: 2GiB, 512MiB, 1.5GB)") from None
