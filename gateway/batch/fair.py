"""Fair shares between the keys that own batches: pure, no I/O.

A key's 30,000-line batch must not make another key's 10 lines wait behind it. The runner
therefore claims lines for every owner with work in one survey (``shares``: the room split
evenly, what one owner cannot use going to the others) and starts them round-robin across
owners (``OwnerQueue``): with two owners waiting, every other line a pool starts is the
second owner's, whatever the sizes of their batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class OwnerQueue(Generic[T]):
    """A queue per owner, taken from in turn: ``popleft`` gives the next owner's oldest item."""

    __slots__ = ("_queues", "_size")

    def __init__(self) -> None:
        self._queues: dict[str, deque[T]] = {}
        """Owners in the order they are served next (a dict keeps insertion order)."""
        self._size = 0

    def append(self, owner: str, item: T) -> None:
        self._queues.setdefault(owner, deque()).append(item)
        self._size += 1

    def popleft(self) -> T:
        """The oldest item of the owner whose turn it is; that owner goes to the back."""
        owner = next(iter(self._queues))
        queue = self._queues.pop(owner)
        item = queue.popleft()
        if queue:
            self._queues[owner] = queue
        self._size -= 1
        return item

    def remove(self, drop: Callable[[T], bool]) -> list[T]:
        """Take out every item ``drop`` says so of (a cancelled batch's lines); them, oldest first."""
        removed: list[T] = []
        for owner in list(self._queues):
            queue = self._queues[owner]
            removed += [x for x in queue if drop(x)]
            kept = deque(x for x in queue if not drop(x))
            if kept:
                self._queues[owner] = kept
            else:
                del self._queues[owner]
        self._size -= len(removed)
        return removed

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        for queue in self._queues.values():
            yield from queue


def shares(room: int, owners: int) -> list[int]:
    """``room`` lines split as evenly as possible between ``owners`` (the first get the remainder)."""
    if owners <= 0:
        return []
    base, extra = divmod(max(0, room), owners)
    return [base + (1 if i < extra else 0) for i in range(owners)]
