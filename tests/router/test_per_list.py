"""PerList: what is derived from the pool's list of views is computed once per list."""

from __future__ import annotations

from kvflow.router.per_list import PerList


def test_a_value_is_computed_once_per_list_and_again_for_another_list() -> None:
    calls: list[list[int]] = []

    def total(views: list[int]) -> int:
        calls.append(list(views))
        return sum(views)

    per_list = PerList(total)
    pool = [1, 2, 3]
    assert per_list(pool) == per_list(pool) == 6
    assert per_list([1, 2, 3]) == 6  # an equal list, but another one: computed again
    assert len(calls) == 2
    pool.append(4)  # a list changed in place (the datastore never does) is noticed by its length
    assert per_list(pool) == 10 and len(calls) == 3
