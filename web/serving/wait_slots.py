"""How many long polls each key holds in an API process (``web/api/long_poll.py`` says why)."""

from __future__ import annotations

import threading


class WaitSlots:
    """How many long polls each key holds in this API process, at most ``per_key`` at once."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, owner: str) -> bool:
        with self._lock:
            if self._held.get(owner, 0) >= self.per_key:
                return False
            self._held[owner] = self._held.get(owner, 0) + 1
            return True

    def give_back(self, owner: str) -> None:
        with self._lock:
            self._held[owner] -= 1
            if not self._held[owner]:
                del self._held[owner]
