"""The router's block keys: a prompt's prefix fingerprints, all at once or chained on from any block."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.router import fingerprint
from kvflow.router.fingerprint import MASK, Fingerprinter, event_keys, request_keys

BLOCK = 16


@pytest.fixture(autouse=True, params=["native", "numpy"])
def native(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case twice: with ``kvflow._native`` (when built) and with numpy alone."""
    if request.param == "numpy":
        monkeypatch.setattr(fingerprint, "native", None)
    elif fingerprint.native is None:
        pytest.skip("kvflow._native is not built")


def stepwise(f: Fingerprinter, tokens: list[int], keys: list[object] | None = None) -> list[int]:
    """The definition, one block at a time: fp_i = fp_{i-1} * K + m_i."""
    mixes = f.block_mixes(np.array(tokens, np.int64), keys).tolist()  # type: ignore[arg-type]
    out, fp = [], f.root
    for m in mixes:
        fp = (fp * f.multiplier + m) & MASK
        out.append(fp)
    return out


@pytest.mark.parametrize("blocks", [0, 1, 6, 7, 40])
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "lora-and-salt"])
def test_a_prompt_at_once_equals_the_chain_block_by_block(blocks: int, keyed: bool) -> None:
    """Prompts of a few blocks are fingerprinted in plain Python, longer ones with numpy: the
    same keys either way."""
    f = Fingerprinter(BLOCK)
    rng = random.Random(blocks)
    tokens = [rng.randrange(-5, 128256) for _ in range(BLOCK * blocks + 7)]
    first, later = request_keys("sql", "t") if keyed else (None, None)
    fingerprints = f.prompt(tokens, first, later).all()
    keys = [first, *[later] * (blocks - 1)][:blocks] if keyed else None
    assert len(fingerprints) == blocks and fingerprints == stepwise(f, tokens, keys)


@pytest.mark.parametrize("start", [1, 7, 39])
def test_blocks_chained_on_a_parent_get_the_prompts_fingerprints(start: int) -> None:
    """What a ``BlockStored`` event with a parent gives: the same keys, whatever the depth."""
    f = Fingerprinter(BLOCK)
    tokens = list(range(1000, 1000 + BLOCK * 40))
    whole = f.prompt(tokens).all()
    values = np.array(tokens[start * BLOCK :], np.int64)
    assert f.chain(whole[start - 1], f.block_mixes(values)).tolist() == whole[start:]


@pytest.mark.parametrize("blocks", [1, 2, 8, 9, 40])
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "lora-and-salt"])
def test_an_events_blocks_get_the_prompts_fingerprints_short_or_long(blocks: int, keyed: bool) -> None:
    """Short events are fingerprinted in plain Python, long ones with numpy: the same keys."""
    f = Fingerprinter(BLOCK)
    rng = random.Random(blocks)
    tokens = [rng.randrange(-5, 1 << 40) for _ in range(BLOCK * (blocks + 1))]  # odd ids take the same path
    first, later = request_keys("sql", "t") if keyed else (None, None)
    whole = f.fingerprints(np.array(tokens, np.int64), first, later).tolist()
    keys = [later] * blocks if keyed else None
    assert f.stored(whole[0], tokens[BLOCK:], keys) == whole[1:]
    assert f.stored(f.root, tokens[:BLOCK], [first] if keyed else None) == whole[:1]


def test_every_fingerprint_depends_on_every_block_before_it() -> None:
    f = Fingerprinter(BLOCK)
    tokens = list(range(BLOCK * 8))
    base = f.prompt(tokens).all()
    for block in range(8):
        changed = list(tokens)
        changed[block * BLOCK + 3] += 1
        other = f.prompt(changed).all()
        assert other[:block] == base[:block] and all(a != b for a, b in zip(other[block:], base[block:]))
    swapped = tokens[BLOCK : 2 * BLOCK] + tokens[:BLOCK] + tokens[2 * BLOCK :]
    assert f.prompt(swapped).all()[1:] != base[1:]  # order matters, not just the set of blocks


def test_a_prompt_over_a_million_tokens_fingerprints_like_any_other() -> None:
    f = Fingerprinter(BLOCK)
    rng = random.Random(1)
    tokens = [rng.randrange(128256) for _ in range((1 << 20) + BLOCK * 5 + 3)]
    fingerprints = f.prompt(tokens).all()
    assert len(fingerprints) == (1 << 16) + 5
    assert fingerprints[-3:] == stepwise(f, tokens)[-3:]


def test_each_router_has_its_own_constants() -> None:
    tokens = list(range(BLOCK * 4))
    one, two = Fingerprinter(BLOCK), Fingerprinter(BLOCK)
    assert not set(one.prompt(tokens).all()) & set(two.prompt(tokens).all())
    assert Fingerprinter(BLOCK, secret=b"k" * 32).prompt(tokens).all() == Fingerprinter(
        BLOCK, secret=b"k" * 32).prompt(tokens).all()
    # ...but the debug digest of what the blocks are keyed on is the same in every router.
    assert one.prompt(tokens, *request_keys("ad", "salt")).digest() == two.prompt(
        tokens, *request_keys("ad", "salt")).digest() != one.prompt(tokens).digest()


@pytest.mark.parametrize(
    ("lora", "salt", "event_lora", "event_extra"),
    [
        (None, "tenant-1", None, [["tenant-1"], None, None, None]),
        ("sql", None, "sql", [["sql"]] * 4),
        ("sql", "tenant-1", "sql", [["sql", "tenant-1"], ["sql"], ["sql"], ["sql"]]),
        ("sql", None, "sql", None),  # vLLM before extra_keys: the LoRA name alone keys every block
    ],
    ids=["salt", "lora", "lora-and-salt", "lora-without-extra-keys"],
)
def test_a_request_is_keyed_as_vllm_events_key_its_blocks(
    lora: str | None, salt: str | None, event_lora: str | None, event_extra: list[object] | None
) -> None:
    f = Fingerprinter(BLOCK)
    tokens = list(range(BLOCK * 4))
    request = f.prompt(tokens, *request_keys(lora, salt)).all()
    from_event = f.chain(f.root, f.block_mixes(np.array(tokens, np.int64), event_keys(event_lora, event_extra, 4)))
    assert request == from_event.tolist()
    assert not set(request) & set(f.prompt(tokens).all())  # and differs from the plain prompt's


def test_a_lora_name_is_not_mistaken_for_a_cache_salt() -> None:
    """Events carry extra keys untagged: a LoRA "x" and a salt "x" both read ("x",) on block 0."""
    f = Fingerprinter(BLOCK)
    tokens = list(range(BLOCK * 2))
    assert f.prompt(tokens, *request_keys("x", None)).all()[0] != f.prompt(tokens, *request_keys(None, "x")).all()[0]


def test_media_keys_match_no_event() -> None:
    """The router cannot compute vLLM's multimodal identifiers: its own digests key every block."""
    f = Fingerprinter(BLOCK)
    tokens = list(range(BLOCK * 3))
    with_media = f.prompt(tokens, *request_keys(None, None, ("d1",))).all()
    event_shapes = [None, [["d1"]] * 3, [[["d1", 0]]] + [None] * 2]
    for extra in event_shapes:
        keys = event_keys(None, extra, 3)
        assert f.chain(f.root, f.block_mixes(np.array(tokens, np.int64), keys)).tolist()[0] != with_media[0]
    assert f.prompt(tokens, *request_keys(None, None, ("d1",))).all() == with_media  # same media, same keys
    assert f.prompt(tokens, *request_keys(None, None, ("d2",))).all()[0] != with_media[0]


def test_only_full_blocks_have_fingerprints() -> None:
    f = Fingerprinter(BLOCK)
    assert f.prompt(list(range(BLOCK - 1))).all() == []
    assert len(f.prompt(list(range(BLOCK * 2 + 1)))) == 2


def test_token_ids_that_are_not_integers_are_a_bad_request() -> None:
    with pytest.raises(InvalidRequestError, match="integers"):
        Fingerprinter(BLOCK).prompt([1.5] * 32).all()  # type: ignore[list-item]
