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
    raw = native.fingerprints(tokens, f.token_mix, f.multiplier, f.root, f.key_mix(first), f.key_mix(later))  # type: ignore[arg-type]
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


def reference_runs(table: BlockTable, asked: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """One key at a time (``_Slots.find``): the leading keys found, and (i, record) where the
    records' holder mix changes."""
    records: list[int] = []
    for h in asked:
        if (r := table._index.find(h)) < 0:
            break
        records.append(r)
    mix = table._mix
    return len(records), [(i, r) for i, r in enumerate(records) if i == 0 or mix[r] != mix[records[i - 1]]]


@pytest.mark.parametrize("seed", range(4))
def test_find_prefix_runs_equals_the_lookup_one_key_at_a_time(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """In C and in numpy (the fallback), up to the first miss, with the places the holders change."""
    rng = random.Random(seed)
    table = BlockTable(refresh=False)
    pods = [block_table.EndpointId(f"10.0.0.{i}:8000") for i in range(3)]
    held = [rng.getrandbits(64) for _ in range(3000)] + [i << 40 for i in range(300)] + [0, (1 << 64) - 1]
    table.add(pods[0], held)  # long probe runs too (keys equal in low bits)
    table.add(pods[1], held[:1000] + held[2000:2500])
    table.add(pods[2], held[500:1500])
    table.remove(pods[0], held[::7])  # backward shifts moved records up
    kept = [h for i, h in enumerate(held) if i % 7]
    for asked in (kept, kept[:100] + [held[0]] + kept[100:200], [held[7]] + kept, [], kept[-1:], held[1:800]):
        keys = np.array(asked, np.uint64)
        want = reference_runs(table, asked)
        index = table._index
        assert native.find_prefix_runs(index.slots, index.keys, table._mix, keys, index.mul, index.shift) == want
        with monkeypatch.context() as numpy_only:
            numpy_only.setattr(block_table, "native", None)
            assert index.prefix_runs(keys, table._mix) == want
    assert table._index.prefix_runs(np.array(kept, np.uint64), table._mix)[0] == len(kept)
    assert len(reference_runs(table, held[1:800])[1]) > 3  # the holders do change along it


@pytest.mark.parametrize("seed", range(3))
def test_probe_slots_equals_the_probe_one_key_at_a_time(seed: int) -> None:
    """The slot holding each key's record, or the free slot where it goes, and the key's home."""
    rng = random.Random(seed)
    table = BlockTable(refresh=False)
    held = [rng.getrandbits(64) for _ in range(2000)] + [i << 40 for i in range(300)] + [0, (1 << 64) - 1]
    table.add(block_table.EndpointId("10.0.0.1:8000"), held)
    table.remove(block_table.EndpointId("10.0.0.1:8000"), held[::5])
    asked = held[:500] + [rng.getrandbits(64) for _ in range(500)] + [i << 40 for i in range(300, 400)] + held[:3]
    index = table._index
    homes, slots = native.probe_slots(index.slots, index.keys, asked, index.mul, index.shift)
    assert slots == [index.probe(h) for h in asked]
    assert homes == [index.home(h) for h in asked]
    assert native.probe_slots(index.slots, index.keys, [], index.mul, index.shift) == ([], [])


def test_probe_slots_refuses_what_is_not_a_key_or_a_table_with_room() -> None:
    keys, slots = array("Q", [5, 6]), array("i", [-1] * 1024)
    index = _Slots(keys, 1024)
    with pytest.raises(OverflowError):
        native.probe_slots(slots, keys, [1 << 64], index.mul, index.shift)
    with pytest.raises(TypeError):
        native.probe_slots(slots, keys, [5.0], index.mul, index.shift)
    with pytest.raises(ValueError, match="power of two"):
        native.probe_slots(array("i", [-1] * 1000), keys, [5], 1, 54)
    full = array("i", [1] * 1024)  # every slot taken, none by the key: no slot to put it in
    with pytest.raises(ValueError, match="no free slot"):
        native.probe_slots(full, keys, [5], index.mul, index.shift)


def test_find_prefix_runs_refuses_a_table_that_is_not_one_and_never_reads_past_the_keys() -> None:
    keys, mixes, asked = array("Q", [5, 6]), array("I", [0, 0]), np.array([5], np.uint64)
    slots = array("i", [-1] * 1024)
    with pytest.raises(ValueError, match="power of two"):
        native.find_prefix_runs(array("i", [-1] * 1000), keys, mixes, asked, 1, 54)
    with pytest.raises(ValueError, match="shift"):
        native.find_prefix_runs(slots, keys, mixes, asked, 1, 53)
    with pytest.raises(ValueError, match="mixes"):
        native.find_prefix_runs(slots, keys, array("I", [0]), asked, 1, 54)
    index = _Slots(keys, 1024)
    home = (5 * index.mul % (1 << 64)) >> index.shift
    index.slots[home] = 9  # a record the keys do not have: a miss, not a read past their end
    assert native.find_prefix_runs(index.slots, keys, mixes, asked, index.mul, index.shift) == (0, [])
    full = array("i", [1] * 1024)  # every slot taken, none by the key: a miss, not an endless probe
    assert native.find_prefix_runs(full, keys, mixes, asked, index.mul, index.shift) == (0, [])


def test_tie_break_is_the_python_draw() -> None:
    """SplitMix64's k-th output, both arguments taken mod 2**64 as the Python form's masks take them."""
    from kvflow.router.framework import splitmix64_draw

    rng = random.Random(9)
    for _ in range(2000):
        seed = rng.choice([rng.getrandbits(32), rng.getrandbits(64), -rng.getrandbits(40), rng.getrandbits(80), 0])
        k = rng.choice([0, 1, rng.randrange(10_000), (1 << 64) - 1])
        assert native.tie_break(seed, k) == splitmix64_draw(seed, k)
    with pytest.raises(TypeError):
        native.tie_break(1.5, 2)
    with pytest.raises(TypeError):
        native.tie_break(1)
