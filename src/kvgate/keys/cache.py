"""A bounded LRU of key lookups by key hash, emptied whole when the store's generation moves.

It keeps misses too: a flood of random keys is answered from memory after the first try of
each, and cannot grow the cache past its bound (the least recently used entry goes). Every
operation is O(1) (an ``OrderedDict``).
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.keys.records import KeyRecord


class LookupCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, KeyRecord | None] = OrderedDict()
        # Bumped by every clear: a lookup that read the store before a clear must not put
        # what it read (maybe stale) into the emptied cache.
        self.epoch = 0
        self._generation: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key_hash: str) -> tuple[bool, KeyRecord | None]:
        """(cached, record): (True, None) is a cached miss, (False, None) not cached."""
        try:
            found = self._entries[key_hash]
        except KeyError:
            return False, None
        self._entries.move_to_end(key_hash)
        return True, found

    def put(self, key_hash: str, record: KeyRecord | None, epoch: int) -> None:
        """Remember what the store said (``None``: no such key) if nothing was cleared since
        the lookup began (``epoch`` as read then)."""
        if epoch != self.epoch or self.max_entries <= 0:
            return
        self._entries[key_hash] = record
        self._entries.move_to_end(key_hash)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
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
