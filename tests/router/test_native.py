"""``kvflow._native``: the router's per-decision loops in C compute what their numpy forms compute.

numpy (``Fingerprinter.fingerprints``, ``_Slots.find_many``) is the specification and the
fallback where no C compiler built the module; every case here runs both and compares.
"""

from __future__ import annotations

import random
import shutil
import sysconfig
from array import array

import numpy as np
import pytest

from kvflow.blockbytes import as_int64
from kvflow.router import block_table, fingerprint
from kvflow.router.block_table import BlockTable, _Slots
from kvflow.router.fingerprint import Fingerprinter, request_keys

native = pytest.importorskip("kvflow._native") if fingerprint.native is None else fingerprint.native
BLOCK = 16


def test_the_module_is_built_wherever_a_c_compiler_is() -> None:
    """``pip install`` builds it (``setup.py``); only a machine without a compiler goes without."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine")
    assert fingerprint.native is not None and block_table.native is not None


def numpy_fingerprints(f: Fingerprinter, tokens: list[int], first: object, later: object) -> list[int] | None:
    values = as_int64(tokens)
    return None if values is None else f.fingerprints(values, first, later).tolist()  # type: ignore[arg-type]


def native_fingerprints(f: Fingerprinter, tokens: object, first: object, later: object) -> list[int] | None:
    raw = native.fingerprints(tokens, f._token_mix_bytes, f._k, f.root, f.key_mix(first), f.key_mix(later))  # type: ignore[arg-type]
    return None if raw is None else np.frombuffer(raw, np.uint64).tolist()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "lora-and-salt"])
def test_fingerprints_equal_numpys_for_any_prompt(seed: int, keyed: bool) -> None:
    rng = random.Random(seed)
    f = Fingerprinter(rng.choice([1, 16, 32, 128]))
    n = rng.choice([0, 1, f.block_size - 1, f.block_size, 7 * f.block_size + 3, 400 * f.block_size])
    tokens = [rng.choice([rng.randrange(128256), rng.randrange(-(1 << 63), 1 << 63), -1, 0, (1 << 63) - 1])
              for _ in range(n)]
    first, later = request_keys("sql", "t") if keyed else (None, None)
    want = numpy_fingerprints(f, tokens, first, later)
    assert native_fingerprints(f, tokens, first, later) == want
    assert native_fingerprints(f, tuple(tokens), first, later) == want  # any sequence
    assert f.prompt(tokens, first, later).all() == want  # what the router runs
    assert len(want or []) == n // f.block_size


@pytest.mark.parametrize("bad", [1.5, "7", None, 1 << 63, -(1 << 63) - 1], ids=repr)
@pytest.mark.parametrize("where", [0, 20, 37], ids=["first-block", "second-block", "partial-block"])
def test_a_token_that_is_not_an_int64_is_refused_wherever_it_is(bad: object, where: int) -> None:
    """As ``as_int64`` refuses it: the last partial block is checked too, though not hashed."""
    f = Fingerprinter(BLOCK)
    tokens: list[object] = list(range(38))
    tokens[where] = bad
    assert as_int64(tokens) is None  # type: ignore[arg-type]
    assert native_fingerprints(f, tokens, None, None) is None


def test_integers_of_other_types_are_left_to_numpy_and_count_by_their_value() -> None:
    """The C loop reads plain ints only (converting another object could run Python code); the
    router then converts the tokens as ``struct.pack`` does: numpy integers and bools by value."""
    f = Fingerprinter(BLOCK)
    tokens = [np.int64(5), True, np.uint16(7), *range(29)]
    assert native_fingerprints(f, tokens, None, None) is None
    assert f.prompt(tokens).all() == numpy_fingerprints(f, [5, 1, 7, *range(29)], None, None)  # type: ignore[arg-type]


def test_fingerprints_refuses_a_mix_that_is_not_whole_uint64s() -> None:
    with pytest.raises(ValueError, match="token_mix"):
        native.fingerprints([1, 2, 3], b"\x01" * 12, 3, 1, 0, 0)
    with pytest.raises(TypeError):
        native.fingerprints(7, b"\x01" * 8, 3, 1, 0, 0)


def lookups(table: BlockTable, asked: list[int]) -> tuple[list[int], list[int]]:
    """(native ``find_prefix``, numpy ``find_many`` cut at its first miss) for ``asked``."""
    index, keys = table._index, np.array(asked, np.uint64)
    raw = native.find_prefix(index.slots, index.keys, keys, index.mul, index.shift)
    found = index.find_many(keys).tolist()
    return np.frombuffer(raw, np.int32).tolist(), found[: found.index(-1)] if -1 in found else found


@pytest.mark.parametrize("seed", range(4))
def test_find_prefix_equals_numpys_lookup_up_to_the_first_miss(seed: int) -> None:
    rng = random.Random(seed)
    table = BlockTable(refresh=False)
    held = [rng.getrandbits(64) for _ in range(3000)] + [i << 40 for i in range(300)] + [0, (1 << 64) - 1]
    table.add(block_table.EndpointId("10.0.0.1:8000"), held)  # long probe runs too (keys equal in low bits)
    table.remove(block_table.EndpointId("10.0.0.1:8000"), held[::7])  # backward shifts moved records up
    kept = [h for i, h in enumerate(held) if i % 7]
    for asked in (kept, kept[:100] + [held[0]] + kept[100:200], [held[7]] + kept, [], kept[-1:]):
        native_records, numpy_records = lookups(table, asked)
        assert native_records == numpy_records
    assert len(lookups(table, kept)[0]) == len(kept)


def test_find_prefix_refuses_a_table_that_is_not_one_and_never_reads_past_the_keys() -> None:
    keys = array("Q", [5, 6])
    slots = array("i", [-1] * 1024)
    with pytest.raises(ValueError, match="power of two"):
        native.find_prefix(array("i", [-1] * 1000), keys, np.array([5], np.uint64), 1, 54)
    with pytest.raises(ValueError, match="shift"):
        native.find_prefix(slots, keys, np.array([5], np.uint64), 1, 53)
    index = _Slots(keys, 1024)
    home = (5 * index.mul % (1 << 64)) >> index.shift
    index.slots[home] = 9  # a record the keys do not have: a miss, not a read past their end
    assert native.find_prefix(index.slots, keys, np.array([5], np.uint64), index.mul, index.shift) == b""
    full = array("i", [1] * 1024)  # every slot taken, none by the key: a miss, not an endless probe
    assert native.find_prefix(full, keys, np.array([5], np.uint64), index.mul, index.shift) == b""
