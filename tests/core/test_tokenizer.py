"""The built-in tokenizer is deterministic across processes, prompts tokenise like vLLM, and a
Hugging Face tokenizer's remembered chunks give the whole text's ids."""

import functools
import random
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import hypothesis
import pytest
from hypothesis import strategies as st

import kvflow.tokenizer
from kvflow.tokenizer import (
    BuiltinTokenizer, HFTokenizer, load_tokenizer, native, prompt_token_ids, split_at_spaces,
)

TINY_LLAMA = Path(__file__).resolve().parents[1] / "golden" / "tiny-llama-tokenizer"


def test_same_text_same_ids_in_another_process():
    text = "The quick brown fox, again: the quick brown fox!"
    here = BuiltinTokenizer().encode(text)
    code = f"from kvflow.tokenizer import BuiltinTokenizer; print(BuiltinTokenizer().encode({text!r}))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert str(here) == there.strip()


def test_decode_round_trips_encoded_text():
    tok = BuiltinTokenizer()
    text = "Hello,  world!\nHow are you?"
    assert tok.decode(tok.encode(text)) == text


def test_pieces_convert_back_to_the_ids_they_came_from():
    tok = BuiltinTokenizer()
    ids = tok.encode("Hello,  world!\nHow are you?")
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids  # BOS included


def test_bos_is_added_only_when_asked():
    tok = BuiltinTokenizer()
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False) == tok.encode("hi")[1:]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": [5, 6, 7]}, [5, 6, 7]),
        ({"prompt": [[5, 6]]}, [5, 6]),
        ({"prompt": ["hi"]}, "encode:hi"),
        ({"prompt": "hi"}, "encode:hi"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
    ],
    ids=["ids", "batch-of-ids", "batch-of-text", "text", "chat"],
)
def test_prompt_token_ids(body, expected):
    tok = BuiltinTokenizer()
    ids = prompt_token_ids(tok, body)
    if expected == "encode:hi":
        assert ids == tok.encode("hi")
    elif expected == "chat":
        assert ids == tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    else:
        assert ids == expected


def test_missing_tokenizer_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def word_tables() -> list[str]:
    """The built-in tokenizer's word memos: ``kvflow._native.WordIds`` (when built) and a dict."""
    return ["dict"] if native is None else ["native", "dict"]


def builtin(words: str, **attrs: int) -> BuiltinTokenizer:
    """A built-in tokenizer whose word memo is ``words``: "dict" is the one a process without
    ``kvflow._native`` builds."""
    with mock.patch.object(kvflow.tokenizer, "native", None if words == "dict" else native):
        tok = BuiltinTokenizer()
    for name, value in attrs.items():
        setattr(tok, name, value)
    return tok


@pytest.mark.parametrize("words", word_tables())
@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(text=st.text(alphabet=st.sampled_from(["a", "b", "é", "1", "_", " ", ".", ",", "\n", "\t", "ß", "中"]),
                               max_size=40))
def test_builtin_fast_path_gives_the_same_pieces_as_the_regex(words: str, text: str) -> None:
    from kvflow.tokenizer import _PIECE

    fast, chunked, reference = builtin(words), builtin(words, CHUNK=4), BuiltinTokenizer()
    # CHUNK=4: plain text cut every few characters: every cut is exercised
    expected = reference.convert_tokens_to_ids(_PIECE.findall(text))
    for tok in (fast, chunked):
        assert tok.encode(text, add_special_tokens=False) == expected  # every piece new
        assert tok.encode(text, add_special_tokens=False) == expected  # every piece (and chunk) remembered
        head = text[: len(text) // 2]  # a prefix of a text seen before reuses its chunks
        assert tok.encode(head, add_special_tokens=False) == reference.convert_tokens_to_ids(_PIECE.findall(head))


@pytest.mark.parametrize("words", word_tables())
def test_long_words_and_forgotten_words_get_the_regexs_ids(words: str) -> None:
    """Words longer than a ``WordIds`` slot keeps are looked up in Python each time; a full memo
    forgets every word and learns them again."""
    from kvflow.tokenizer import _PIECE

    rng = random.Random(7)
    vocab = [f"w{i}" for i in range(300)] + ["x" * n for n in (17, 18, 19, 40)] + ["_a_", "Z9"]
    tok, reference = builtin(words, MAX_KNOWN=50, CHUNK=64), BuiltinTokenizer()
    for _ in range(20):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randrange(1, 400)))
        text = rng.choice(["", " "]) + text + rng.choice(["", " "])
        expected = reference.convert_tokens_to_ids(_PIECE.findall(text))
        assert tok.encode(text, add_special_tokens=False) == expected
        assert tok.memo_sizes["words"] <= 50 and tok.memo_sizes["pieces"] <= 50


@pytest.mark.skipif(native is None, reason="kvflow._native is not built")
def test_a_word_table_holds_ascii_words_as_a_dict_would() -> None:
    table = native.WordIds(4)
    table["alpha"], table["beta"], table[""] = 7, 8, 9
    assert (table.get("alpha"), table.get("beta"), table.get(""), table.get("gamma"), table.get("gamma", 0)) == (
        7, 8, 9, None, 0)
    table["alpha"] = 70  # a word set again keeps one place
    assert (len(table), table.get("alpha")) == (3, 70)
    table["x" * 18], table["x" * 19] = 1, 2  # a word longer than a slot's bytes is not kept
    assert (len(table), table.get("x" * 18), table.get("x" * 19)) == (4, 1, None)
    table["delta"] = 4  # the table was full: it forgot every word first
    assert (len(table), table.get("alpha"), table.get("delta")) == (1, None, 4)
    assert table.plain_words("delta w w_1 ") == (["delta", 0, 0, 0], [1, 2, 3])
    assert table.plain_words(" delta delta") == (["", 4, 4], [])
    assert [table.plain_words(t) for t in ("a  b", "a.b", "naïve", "a\nb", "a\tb")] == [None] * 5
    table.clear()
    assert (len(table), table.get("delta")) == (0, None)
    for bad_word, bad_id, error in (("naïve", 1, TypeError), (b"x", 1, TypeError), ("x", 0, ValueError),
                                    ("x", 1 << 32, ValueError), ("x", "1", TypeError)):
        with pytest.raises(error):
            table[bad_word] = bad_id  # type: ignore[index,assignment]
    with pytest.raises(ValueError):
        native.WordIds(0)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(alphabet=st.sampled_from(["a", "b", "é", "1", " ", ".", "\n", "\t", "中"]), max_size=60),
                  st.integers(min_value=1, max_value=8))
def test_a_text_is_cut_only_before_a_single_space_between_words(text: str, size: int) -> None:
    pieces = split_at_spaces(text, size)
    assert "".join(pieces) == text and (all(pieces) or text == "")
    for left, right in zip(pieces, pieces[1:]):
        assert len(left) >= size
        assert right[0] == " " and not left[-1].isspace() and len(right) > 1 and not right[1].isspace()


@functools.cache
def rust_tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY_LLAMA / "tokenizer.json"))


def rust_ids(text: str, special: bool) -> list[int]:
    """The ids the model's own ``tokenizer.json`` gives ``text`` whole (Hugging Face ``tokenizers``)."""
    return list(rust_tokenizer().encode(text, add_special_tokens=special).ids)


def test_a_long_text_tokenizes_in_remembered_chunks_to_the_whole_texts_ids() -> None:
    tok = load_tokenizer(TINY_LLAMA)
    assert isinstance(tok, HFTokenizer) and tok.chunked
    rng = random.Random(3)
    words = ["the", "cache", "prefix", "w123", "Don't", "3.14", "naïve", "日本語", "<|im_start|>", "(x)", "a\nb"]
    system = " ".join(rng.choice(words) for _ in range(2000))
    for turn in range(3):
        text = f"{system} {' '.join(rng.choice(words) for _ in range(300))}"
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == rust_ids(text, special)
        if turn == 0:
            remembered = len(tok.remembered_chunks())
    assert remembered >= 4 and len(tok.remembered_chunks()) < 3 * remembered  # later turns added only their own chunks


def test_chunks_are_not_used_where_an_added_token_takes_the_spaces_around_it(tmp_path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    rust = Tokenizer.from_file(str(TINY_LLAMA / "tokenizer.json"))
    rust.add_special_tokens([AddedToken("<mask>", rstrip=True)])
    rust.save(str(tmp_path / "tokenizer.json"))
    assert not load_tokenizer(tmp_path).chunked


def test_chunks_are_not_used_where_the_normalizer_prepends_to_every_text(tmp_path: Path) -> None:
    """Llama 2's converted tokenizers prepend "▁" to a text and replace its spaces: a chunk would
    get one more "▁" than the same text inside the whole. The check on the sample text finds it."""
    from tokenizers import Tokenizer, normalizers

    rust = Tokenizer.from_file(str(TINY_LLAMA / "tokenizer.json"))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert not tok.chunked
    text = "word " * 2000
    assert tok.encode(text) == rust.encode(text).ids


def test_the_least_recently_used_chunks_are_forgotten_first() -> None:
    tok = load_tokenizer(TINY_LLAMA)
    assert isinstance(tok, HFTokenizer)
    old, dropped, new = "alpha beta gamma delta", "kappa lambda sigma omega", "one two three four five six"
    chunks = {text: set(split_at_spaces(text, 8)) for text in (old, dropped, new)}
    tok.CHUNK, tok.MAX_CHUNKS = 8, len(chunks[old]) + len(chunks[new])
    for text in (old, dropped, old, new):  # ``old`` was used after ``dropped``
        assert tok.encode(text, add_special_tokens=False) == rust_ids(text, False)
    assert set(tok.remembered_chunks()) == chunks[old] | chunks[new]


def test_threads_tokenizing_at_once_get_the_whole_texts_ids() -> None:
    from concurrent.futures import ThreadPoolExecutor

    tok = load_tokenizer(TINY_LLAMA)
    assert isinstance(tok, HFTokenizer)
    tok.MAX_CHUNKS = 8  # chunks are forgotten while other threads read them
    rng = random.Random(5)
    texts = [" ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(800, 2000))) for _ in range(40)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: tok.encode(t, add_special_tokens=False), texts * 3))
    assert got == [rust_ids(t, False) for t in texts * 3]
