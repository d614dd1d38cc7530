"""The built-in tokenizer is deterministic across processes, and prompts tokenise like vLLM."""

import subprocess
import sys

import hypothesis
import pytest
from hypothesis import strategies as st

from kvflow.tokenizer import BuiltinTokenizer, load_tokenizer, prompt_token_ids


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


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(alphabet=st.sampled_from(["a", "b", "é", "1", "_", " ", ".", ",", "\n", "\t", "ß", "中"]),
                          max_size=40))
def test_builtin_fast_path_gives_the_same_pieces_as_the_regex(text: str) -> None:
    from kvflow.tokenizer import _PIECE, BuiltinTokenizer

    fast, chunked, reference = BuiltinTokenizer(), BuiltinTokenizer(), BuiltinTokenizer()
    chunked.CHUNK = 4  # plain text cut every few characters: every cut is exercised
    expected = [reference._piece_id(p) for p in _PIECE.findall(text)]
    for tok in (fast, chunked):
        assert tok.encode(text, add_special_tokens=False) == expected  # every piece new
        assert tok.encode(text, add_special_tokens=False) == expected  # every piece (and chunk) remembered
        head = text[: len(text) // 2]  # a prefix of a text seen before reuses its chunks
        assert tok.encode(head, add_special_tokens=False) == [reference._piece_id(p) for p in _PIECE.findall(head)]
