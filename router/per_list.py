"""``PerList``: a value computed from the pool's list of views, kept while that list comes back.

The datastore hands every scheduling cycle the same list of (frozen) views until a scrape or the
pod set changes it, and then a new list: lists are replaced, never changed in place. So what a
plugin derives from the views alone (which serve a model, which are healthy, where each one sits,
which row holds its load counter) is computed once per list, not once per request; for a thousand
pods that is a tenth of a millisecond or more each time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PerList(Generic[T]):
    """``compute(views)``, kept for the last list of views it was called with (by identity; a
    list of another length is computed again, should a caller have changed one in place)."""

    __slots__ = ("_compute", "_last")

    def __init__(self, compute: Callable[[Sequence[Any]], T]) -> None:
        self._compute = compute
        self._last: tuple[Sequence[Any], int, T] | None = None

    def __call__(self, views: Sequence[Any]) -> T:
        last = self._last
        if last is None or last[0] is not views or last[1] != len(views):
            last = self._last = (views, len(views), self._compute(views))
        return last[2]
