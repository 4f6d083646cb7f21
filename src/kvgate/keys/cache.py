"""A bounded LRU of key lookups by key hash, emptied whole when the store's generation moves.

It keeps misses too, in an LRU of their own (a tenth of the bound): a flood of random keys is
answered from memory after the first try of each, cannot grow the cache past its bound, and
cannot push the known keys out (their LRU is apart). Every operation is O(1) (an
``OrderedDict``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

from kvgate.keys.records import KeyRecord

_V = TypeVar("_V")


class LookupCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, KeyRecord] = OrderedDict()
        self.max_misses = max_entries // 10 if max_entries > 0 else 0
        self._misses: OrderedDict[str, None] = OrderedDict()
        # Bumped by every clear: a lookup that read the store before a clear must not put
        # what it read (maybe stale) into the emptied cache.
        self.epoch = 0
        self._generation: int | None = None

    def __len__(self) -> int:
        return len(self._entries) + len(self._misses)

    def get(self, key_hash: str) -> tuple[bool, KeyRecord | None]:
        """(cached, record): (True, None) is a cached miss, (False, None) not cached."""
        found = self._entries.get(key_hash)
        if found is not None:
            self._entries.move_to_end(key_hash)
            return True, found
        if key_hash in self._misses:
            self._misses.move_to_end(key_hash)
            return True, None
        return False, None

    def put(self, key_hash: str, record: KeyRecord | None, epoch: int) -> None:
        """Remember what the store said (``None``: no such key) if nothing was cleared since
        the lookup began (``epoch`` as read then)."""
        if epoch != self.epoch or self.max_entries <= 0:
            return
        if record is None:
            _remember(self._misses, key_hash, None, self.max_misses)
        else:
            _remember(self._entries, key_hash, record, self.max_entries - self.max_misses)

    def clear(self) -> None:
        self._entries.clear()
        self._misses.clear()
        self.epoch += 1

    def observe_generation(self, generation: int | None) -> bool:
        """The store's generation as just read (None: it could not be read). Empties the
        cache when it changed, or when it is unknown (a change may have been missed).
        Returns whether it emptied."""
        changed = generation is None or generation != self._generation
        self._generation = generation
        if changed:
            self.clear()
        return changed


def _remember(entries: OrderedDict[str, _V], key: str, value: _V, bound: int) -> None:
    if bound <= 0:
        return
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > bound:
        entries.popitem(last=False)
