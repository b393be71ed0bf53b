"""Who holds each pool unit. A *holder* is anything with ``kda_slot`` and ``pages`` attributes (a
running sequence, a prefix-cache checkpoint). A slot has one holder; a page may have several
(prefix sharing by reference count). When the pool compacts a region after a free, the moved
unit's holders get their ids rewritten here."""

from __future__ import annotations

from .pool import UnifiedPool


class PoolOwners:
    def __init__(self, pool: UnifiedPool):
        self.pool = pool
        self.slot_holder: dict[int, object] = {}
        self.page_holders: dict[int, list[tuple[object, int]]] = {}

    def can_allocate(self, slots: int = 0, pages: int = 0) -> bool:
        return self.pool.can_allocate(slots=slots, pages=pages)

    def alloc_slot(self, holder) -> int:
        holder.kda_slot = self.pool.alloc_slot()
        self.slot_holder[holder.kda_slot] = holder
        return holder.kda_slot

    def alloc_page(self, holder) -> int:
        page = self.pool.alloc_page()
        self.page_holders[page] = [(holder, len(holder.pages))]
        holder.pages.append(page)
        return page

    def share_page(self, holder, page: int) -> None:
        self.page_holders[page].append((holder, len(holder.pages)))
        holder.pages.append(page)

    def refcount(self, page: int) -> int:
        return len(self.page_holders[page])

    def release_slot(self, holder) -> None:
        if holder.kda_slot is None:
            return
        del self.slot_holder[holder.kda_slot]
        moved = self.pool.free_slot(holder.kda_slot)
        holder.kda_slot = None
        if moved:
            other = self.slot_holder.pop(moved[0])
            other.kda_slot = moved[1]
            self.slot_holder[moved[1]] = other

    def release_pages(self, holder, keep: int = 0) -> None:
        """Drop the holder's references to its pages beyond the first ``keep``; pages nobody holds
        any more return to the pool (newest first: they sit nearest the region's edge)."""
        for idx in range(len(holder.pages) - 1, keep - 1, -1):
            page = holder.pages[idx]
            holders = self.page_holders[page]
            holders.remove(next(h for h in holders if h[0] is holder and h[1] == idx))
            if not holders:
                del self.page_holders[page]
                moved = self.pool.free_page(page)
                if moved:
                    entries = self.page_holders.pop(moved[0])
                    for other, j in entries:
                        other.pages[j] = moved[1]
                    self.page_holders[moved[1]] = entries
        del holder.pages[keep:]

    def release(self, holder) -> None:
        self.release_slot(holder)
        self.release_pages(holder)

    def hand_over(self, src, dst, n_pages: int) -> None:
        """Give ``src``'s slot and its first ``n_pages`` pages to ``dst`` without copying bytes
        (a finished sequence becoming a checkpoint); ``src``'s other pages are released."""
        self.release_pages(src, keep=n_pages)
        if src.kda_slot is not None:
            dst.kda_slot, src.kda_slot = src.kda_slot, None
            self.slot_holder[dst.kda_slot] = dst
        for idx, page in enumerate(src.pages):
            entries = self.page_holders[page]
            entries[entries.index(next(h for h in entries if h[0] is src and h[1] == idx))] = (dst, len(dst.pages))
            dst.pages.append(page)
        src.pages = []

    def bytes_held(self, predicate) -> int:
        """Bytes of the slots and pages that at least one holder matching ``predicate`` holds."""
        lay = self.pool.layout
        slots = sum(1 for h in self.slot_holder.values() if predicate(h))
        pages = sum(1 for e in self.page_holders.values() if any(predicate(h) for h, _ in e))
        return slots * lay.slot_bytes + pages * lay.page_bytes

    def check(self) -> None:
        """Consistency of the bookkeeping with the pool (tests)."""
        assert sorted(self.slot_holder) == list(range(self.pool.num_slots))
        live = list(range(self.pool.page_capacity - self.pool.num_pages, self.pool.page_capacity))
        assert sorted(self.page_holders) == live
        for page, entries in self.page_holders.items():
            for holder, idx in entries:
                assert holder.pages[idx] == page
        for slot, holder in self.slot_holder.items():
            assert holder.kda_slot == slot
