"""Each key's recent use of the GPU batch, for admission (:func:`engine.capacity.next_admission`):
the tokens its requests computed (prompt tokens at admission, one per row per decode step), decayed
exponentially with a half-life, so a key that used much lately waits behind one that used little.

Why recent use rather than the rows each key holds at this instant: a key whose whole-batch job
just ended holds 0 rows, as does the key that waited all along; the tie went to the older job, so
the bulk key's next job went first, again and again (issue #56). Its tokens of the last seconds
say who waited. A decayed counter (the classic per-flow "recent usage" of fair schedulers) rather
than start-time fair queuing's virtual clock: the engine knows a request's cost only as it runs
(rows end early, a prompt is found cached), and a counter charged as it runs needs no estimate.

One per engine, shared by its schedulers (a GPU worker opens one per session): a key's use
outlives the session it ran in. The clock is injectable for tests."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

# Below this a key's use is forgotten (its entry removed): the map holds the keys of recent work only.
FORGET_BELOW = 1e-3


class TenantUsage:
    def __init__(self, half_life_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.half_life_s, self.clock = half_life_s, clock
        self._used: dict[Hashable, tuple[float, float]] = {}  # tenant -> (usage, when it was last decayed)

    def charge(self, tenant: Hashable, tokens: float) -> None:
        """``tenant``'s requests computed ``tokens`` more tokens now."""
        if tokens > 0:
            now = self.clock()
            if tenant not in self._used:  # a new key (rare): forget those whose use decayed away
                for other in list(self._used):
                    self._decayed(other, now)
            self._used[tenant] = (self._decayed(tenant, now) + tokens, now)

    def charge_rows(self, tenants: Iterable[Hashable]) -> None:
        """One decode step: a token for each row (its tenant listed once per row)."""
        for tenant, count in Counter(tenants).items():
            self.charge(tenant, count)

    def usage(self, tenant: Hashable) -> float:
        """``tenant``'s decayed token count now (0 for a key with no recent work)."""
        return self._decayed(tenant, self.clock())

    def _decayed(self, tenant: Hashable, now: float) -> float:
        used, at = self._used.get(tenant, (0.0, now))
        value = used * math.exp2(-max(0.0, now - at) / self.half_life_s) if self.half_life_s > 0 else 0.0
        if value < FORGET_BELOW:
            self._used.pop(tenant, None)
            return 0.0
        return value

    def __len__(self) -> int:
        return len(self._used)
