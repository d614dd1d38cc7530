"""Deterministic tokenizers shared by the simulator and the router, and vLLM's chat rendering.

Prefix-cache affinity only works if the router turns a prompt into the same token ids as the
model server. kvflow therefore has one place that loads a tokenizer:

* a local Hugging Face tokenizer folder (``tokenizer.json`` and, for chat, the
  ``chat_template`` in ``tokenizer_config.json``), exactly what vLLM would load; or
* the built-in ``BuiltinTokenizer``: no files, stable across processes and machines
  (pieces hashed with BLAKE2b, never Python's salted ``hash``).

Chats are rendered as vLLM 0.32 renders them for a text model (``vllm/renderers/chat_utils.py``
and ``hf.py``, then transformers' ``apply_chat_template``): message content flattened to text
(parts joined by newlines, none as empty), ``developer`` turned into ``system`` when the template
does not name it (all system messages then merged into the first), the template rendered with
transformers' Jinja environment, ``continue_final_message`` cut after the last message's text,
and the text tokenized without special tokens unless the request asks for them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, cast

import jinja2.ext
import jinja2.sandbox

from kvflow.errors import InvalidRequestError

try:
    from kvflow import _native as native
except ImportError:  # installed without a C compiler: the built-in tokenizer reads words with str methods
    native = None  # type: ignore[assignment]

Message = Mapping[str, Any]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The ChatML layout, for tokenizers that ship no chat template."""


class Tokenizer(Protocol):
    name: str
    eos_token_id: int
    vocab_size: int
    max_chars_per_token: int
    chat_template: str
    special_tokens: Mapping[str, str]
    """Template variables such as ``bos_token``, as transformers passes them."""
    offload_bytes: int
    """Request bodies at least this large are tokenized in a worker thread (the gateway's
    ``tokens_off_loop``), so the event loop serves other requests meanwhile."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]: ...


# -- chat rendering (pure) ------------------------------------------------------------------------
def message_text(content: Any) -> str:
    """A message's content as a text model's template sees it (vLLM's "string" content format)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = [p if isinstance(p, str) else p.get("text", "") for p in content
             if isinstance(p, str) or (isinstance(p, Mapping) and p.get("type", "text") == "text")]
    return "\n".join(texts)


def conversation(messages: Sequence[Message], template: str) -> list[dict[str, Any]]:
    """The messages vLLM hands the template: text content, ``developer`` as ``system`` if needed."""
    conv: list[dict[str, Any]] = []
    for m in messages:
        msg = {"role": m["role"], "content": message_text(m.get("content"))}
        for key in ("name", "tool_call_id", "tool_calls", "reasoning"):
            if isinstance(m.get(key), (str, list)):
                msg[key] = m[key]
        conv.append(msg)
    if any(m["role"] == "developer" for m in conv) and "'developer'" not in template \
            and '"developer"' not in template:
        conv = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conv]
        conv = _merge_system_messages(conv)
    return conv


def _merge_system_messages(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if not systems or systems == [0]:
        return conv
    merged = {"role": "system", "content": "\n\n".join(conv[i]["content"] for i in systems if conv[i]["content"])}
    return [merged, *(m for m in conv if m["role"] != "system")]


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat(tokenizer: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, extra: Mapping[str, Any] | None = None) -> str:
    """The prompt text vLLM renders for a chat; a 400 (vLLM's message) when the template refuses."""
    template = tokenizer.chat_template
    conv = conversation(messages, template)
    if not conv:
        raise InvalidRequestError("Cannot apply chat template to an empty conversation. Provide at least one "
                                  "message.")
    if continue_final_message:
        if add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want "
                "to add a header that will prompt it to start a new assistant message instead.")
        final = conv[-1]["content"]
        conv[-1] = {**conv[-1], "content": final + _CONTINUE_TAG}
    variables = {**tokenizer.special_tokens, **(extra or {})}
    try:
        text = _compile(template).render(messages=conv, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(str(exc)) from None
    if continue_final_message:  # transformers cuts the rendered chat after the final message's text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise InvalidRequestError("continue_final_message is set but the final message does not appear in the "
                                      "chat after applying the chat template!")
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """transformers' chat-template environment: sandboxed, trimmed blocks, its helpers."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# -- tokenizers ---------------------------------------------------------------------------------------
_PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
_WORD_OR_SPACE = bytes(c for c in range(128) if chr(c).isalnum()) + b"_ "
"""ASCII word characters and the space: in text made of only these, with single spaces,
``_PIECE``'s pieces are the words (checked with ``bytes.translate``, cheaper than a regex)."""
_MISSING = itertools.repeat(0)
_SPECIAL = ("<unk>", "<s>", "</s>")


class BuiltinTokenizer:
    """Words, punctuation runs and whitespace, each mapped to a stable id by BLAKE2b.

    Decoding knows every piece this process has encoded (and the output vocabulary the
    simulator samples from), which is all a simulator needs.
    """

    name = "kvflow-builtin"
    bos_token_id = 1
    eos_token_id = 2
    chat_template = CHATML
    special_tokens: Mapping[str, str] = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    max_chars_per_token = 1 << 20  # pieces are unbounded words: no character bound applies
    offload_bytes = 64 * 1024
    """Pure Python holds the GIL: a thread only cuts a long prompt's work into the interpreter's
    switch intervals, which pays only for prompts too long to tokenize in one go."""

    MAX_KNOWN = 1 << 16
    """Pieces whose ids are remembered (a plain dict: a lookup costs a tenth of a BLAKE2b)."""
    CHUNK = 2048
    """Plain text is tokenized in chunks of about this many characters, cut before a space."""
    MAX_CHUNKS = 4096
    """Chunks whose ids are remembered (about 20 MB at most): prompts that share a prefix share
    its chunks, so a long system prompt seen before costs a dict lookup per chunk instead of one
    per word (``bench/bench_tokenize.py`` measures it on the routing benchmark's prompts)."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self._pieces: dict[int, str] = dict(enumerate(_SPECIAL))
        self._ids: dict[str, int] = {}
        self._spaced: dict[str, int] | native.WordIds = {} if native is None else native.WordIds(self.MAX_KNOWN)
        """Word -> the id of " " + word (a hit builds no string): with ``kvflow._native``, a table
        that looks up a chunk's words in its bytes, building no string per word either."""
        self._chunks: dict[str, list[int]] = {}

    def _piece_id(self, piece: str) -> int:
        digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
        token_id = len(_SPECIAL) + int.from_bytes(digest, "little") % (self.vocab_size - len(_SPECIAL))
        self._pieces.setdefault(token_id, piece)
        if len(self._ids) >= self.MAX_KNOWN:
            self._ids.clear()  # cheaper than LRU bookkeeping on every hit; common pieces come back at once
        self._ids[piece] = token_id
        return token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        first = [self.bos_token_id] if add_special_tokens else []
        ids = self._plain_ids(text, first) if text and text[0] != " " else None
        if ids is None:
            known, new = self._ids.get, self._piece_id
            first += [known(p) or new(p) for p in _PIECE.findall(text)]
            ids = first
        return ids

    def _plain_ids(self, text: str, ids: list[int]) -> list[int] | None:
        """``ids`` extended by the ids of text made of words and single spaces (most prompts),
        else None (``ids`` as it came).

        Such text splits at its spaces (" word" for every word after the first), so it can be cut
        before any space and tokenized piece by piece. The cuts are ``split_at_spaces``' (the
        Hugging Face tokenizer's too), so prompts sharing a prefix share its chunks. (Extending
        the caller's list spares a copy of a long prompt's ids.)"""
        start = len(ids)
        chunks = self._chunks
        for chunk in split_at_spaces(text, self.CHUNK):
            got = chunks.get(chunk)
            if got is None:
                got = self._words(chunk)
                if got is None:
                    del ids[start:]
                    return None
                if len(chunks) >= self.MAX_CHUNKS:
                    chunks.clear()
                chunks[chunk] = got
            ids += got
        return ids

    def _words(self, chunk: str) -> list[int] | None:
        """A plain chunk's ids (None if it is not plain): its first word as is, unless the chunk
        starts with the space before it; every later word as " word". A ``WordIds`` reads the
        chunk once, in C; a dict looks the words up by ``map`` after ``str`` methods checked it."""
        words: list[str] | None = None
        if isinstance(self._spaced, dict):
            if not chunk.isascii() or chunk.encode().translate(None, _WORD_OR_SPACE) or "  " in chunk:
                return None
            words = chunk.split(" ")
            ids: list[Any] = list(map(self._spaced.get, words, _MISSING))  # ids are never 0: 0 is a miss
            ids[0] = words[0]  # the first word itself, as ``plain_words`` gives it
            missing = [i for i in range(1, len(ids)) if not ids[i]] if 0 in ids else []
        else:
            looked = self._spaced.plain_words(chunk)
            if looked is None:
                return None
            ids, missing = looked
        first = ids[0]
        ids[0] = (self._ids.get(first) or self._piece_id(first)) if first else 0
        if missing:  # words not seen yet (or forgotten)
            words = words or chunk.split(" ")
            for i in missing:
                ids[i] = self._spaced_id(words[i])
        return ids if first else ids[1:]

    def _spaced_id(self, word: str) -> int:
        """The id of the piece ``" " + word`` (remembered by the word, so a hit builds no string)."""
        token_id = self._piece_id(" " + word)
        if len(self._spaced) >= self.MAX_KNOWN:
            self._spaced.clear()
        self._spaced[word] = token_id
        return token_id

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        first = len(_SPECIAL) if skip_special_tokens else 0
        return "".join(self._pieces.get(t, "") for t in token_ids if t >= first)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self._pieces.get(t, "") for t in token_ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int]:
        """The id of each piece (a special token's own id): the ids ``encode`` gives a text
        whose pieces these are, and the inverse of ``convert_ids_to_tokens``."""
        known, new = self._ids.get, self._piece_id
        return [_SPECIAL.index(t) if t in _SPECIAL else known(t) or new(t) for t in tokens]

    @property
    def memo_sizes(self) -> dict[str, int]:
        """How many piece ids, word ids (``" " + word``, by the word) and chunks' ids are
        remembered now. Each memo is forgotten whole when full, so none passes its bound:
        ``MAX_KNOWN`` pieces, ``MAX_KNOWN`` words, ``MAX_CHUNKS`` chunks."""
        return {"pieces": len(self._ids), "words": len(self._spaced), "chunks": len(self._chunks)}


class HFTokenizer:
    """A local Hugging Face tokenizer folder, loaded with the ``tokenizers`` library.

    Long texts are tokenized in chunks that are remembered, so a prompt that shares a long
    prefix with an earlier one (a system prompt, a conversation's earlier turns) costs the
    tokenizer only its new text: a 40 KB prompt takes a BPE tokenizer tens of milliseconds here,
    holding the GIL. Chunks are cut, from the start, at the first single space between two
    non-space characters after every ``CHUNK`` characters, so prompts sharing a prefix share its
    chunks. Such a space begins a pre-token in the usual pre-tokenizers (byte-level BPE's
    regex, Metaspace, whitespace splits), so the chunks' ids joined are the text's ids; whether
    that holds for this tokenizer is checked when it is loaded (``chunks_are_exact``), and a
    tokenizer for which it does not is always given the whole text.
    """

    CHUNK = 2048
    """Characters a remembered chunk spans at least (texts shorter than two are not cut)."""
    MAX_CHUNKS = 4096
    """Chunks remembered, least recently used forgotten first, as 4-byte ids (~40 MB at most for
    2 KB chunks of short tokens)."""
    offload_bytes = 4096
    """The tokenizer's Rust code encodes outside the GIL (``encode_batch``; ``encode`` holds it),
    so in a worker thread a new text's milliseconds leave the event loop free."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        folder = Path(folder)
        self.name = folder.name
        self._tok = _RustTokenizer.from_file(str(folder / "tokenizer.json"))
        vocab = self._tok.get_vocab()
        self.vocab_size = self._tok.get_vocab_size()
        self.max_chars_per_token = max((len(t) for t in vocab), default=1)  # vLLM's bound for text length
        config = _read_json(folder / "tokenizer_config.json")
        self.chat_template = config.get("chat_template") or CHATML
        self.special_tokens: Mapping[str, str] = {k: text for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (text := _token_text(config.get(k)))}
        eos = self._tok.token_to_id(self.special_tokens.get("eos_token", ""))
        self.eos_token_id = eos if eos is not None else 0
        self._chunks: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._around = _specials_around(self._tok)
        self.chunked = chunks_are_exact(self._tok)
        """Long texts are tokenized in remembered chunks (the check passed)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self.chunked and len(text) >= 2 * self.CHUNK:
            if not add_special_tokens:
                return self._chunked_ids(text)
            if self._around is not None:
                prefix, suffix = self._around
                return [*prefix, *self._chunked_ids(text), *suffix]
        # encode_batch, not encode: it lets go of the GIL while it encodes (see offload_bytes)
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def _chunked_ids(self, text: str) -> list[int]:
        pieces = split_at_spaces(text, self.CHUNK)
        known = self._chunks
        with self._lock:  # worker threads tokenize at once (the gateway's tokens_off_loop)
            found = [known.get(piece) for piece in pieces]
            for piece, hit in zip(pieces, found):
                if hit is not None:
                    known.move_to_end(piece)  # least recently used first (cheap beside tokenizing a chunk)
        missing = list(dict.fromkeys(p for p, f in zip(pieces, found) if f is None))
        if missing:  # one call for all of them: the tokenizer's per-call cost is paid once
            fresh = {p: array("I", e.ids) for p, e in zip(missing, self._tok.encode_batch(missing, add_special_tokens=False))}
            with self._lock:
                known.update(fresh)
                while len(known) > self.MAX_CHUNKS:
                    known.popitem(last=False)
            found = [f if f is not None else fresh[p] for p, f in zip(pieces, found)]
        ids: list[int] = []
        for chunk in found:
            ids += chunk  # type: ignore[arg-type]
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def remembered_chunks(self) -> list[str]:
        """The texts of the chunks whose ids are remembered now, least recently used first (a
        snapshot: at most ``MAX_CHUNKS`` of them)."""
        with self._lock:
            return list(self._chunks)


def split_at_spaces(text: str, size: int) -> list[str]:
    """``text`` cut, from the start, before the first single space between two non-space
    characters after every ``size`` characters (the pieces joined are ``text``)."""
    pieces: list[str] = []
    start, last = 0, len(text) - 1
    while True:
        cut = text.find(" ", start + size)
        while 0 < cut < last and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.find(" ", cut + 1)
        if not 0 < cut < last:
            pieces.append(text[start:])
            return pieces
        pieces.append(text[start:cut])
        start = cut


_SAMPLE_WORDS = (
    "The quick brown fox jumps over the lazy dog. Don't we'll they're I'm it's you've. 12345 678 3.14159 "
    "-42 1,000,000 $9.99 50% #tag @user e-mail user@example.com https://example.com/path?q=1&x=2 "
    "naïve café résumé Ünïcödé 日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية 🙂 👍🏽 "
    "(parentheses) [brackets] {braces} <angle> \"quotes\" 'single' `code` a_b c-d e/f g\\h ... ?! ;: "
    "def f(x): return x**2 ## Heading **bold** _it_ ~~s~~ | table | w12345 w7 x9y8 ABCdef CamelCase"
).split(" ")


def chunks_are_exact(tok: Any, size: int = 24) -> bool:
    """Whether a text cut by ``split_at_spaces`` tokenizes, piece by piece, to the text's ids.

    Refused outright where an added token may take the spaces around it (``lstrip``, ``rstrip``,
    ``single_word``) or truncation or padding is on; otherwise checked on a sample text with
    words, numbers, punctuation, several scripts, line breaks, runs of spaces and the added
    tokens, cut at every opportunity."""
    added = tok.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip or t.single_word for t in added) or tok.truncation or tok.padding:
        return False
    words = [*_SAMPLE_WORDS, *(t.content for t in added)]
    rng = random.Random(0)
    parts = []
    for i in range(600):
        parts.append(rng.choice(words))
        parts.append(rng.choice((" ", " ", " ", " ", "\n", "  ", " \n", "\t", "")) if i % 7 == 6 else " ")
    text = "".join(parts)
    for start in (0, 1, 5):
        sample = text[start:]
        whole = tok.encode(sample, add_special_tokens=False).ids
        pieces = tok.encode_batch(split_at_spaces(sample, size), add_special_tokens=False)
        if [i for e in pieces for i in e.ids] != whole:
            return False
    return True


def _specials_around(tok: Any) -> tuple[list[int], list[int]] | None:
    """The special tokens the tokenizer puts before and after a text (BOS, EOS), if it puts the
    same ones around every text; None otherwise (then ``add_special_tokens`` texts go whole)."""
    found = set()
    for text in ("a", "The end.", "x y z 1 2 3"):
        bare, full = tok.encode(text, add_special_tokens=False).ids, tok.encode(text, add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if at is None or not bare:
            return None
        found.add((tuple(full[:at]), tuple(full[at + len(bare):])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return cast("str | None", token.get("content"))
    return cast("str | None", token)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer in a local folder, or the built-in one when ``path`` is empty."""
    if not path:
        return BuiltinTokenizer()
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return HFTokenizer(folder)


def chat_token_ids(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    """The prompt token ids vLLM computes for a chat request body (or a /tokenize chat body)."""
    extra: dict[str, Any] = {}
    if isinstance(body.get("chat_template_kwargs"), Mapping):
        extra.update({k: v for k, v in body["chat_template_kwargs"].items() if k not in ("chat_template", "tokenize")})
    if isinstance(body.get("documents"), list):
        extra["documents"] = body["documents"]
    if isinstance(body.get("tools"), list) and body["tools"]:
        extra["tools"] = body["tools"]  # as vLLM hands them to the template (it may render them)
    text = render_chat(tokenizer, body["messages"], add_generation_prompt=body.get("add_generation_prompt", True),
                       continue_final_message=bool(body.get("continue_final_message")), extra=extra)
    return tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))


def prompt_token_ids(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    """The token ids vLLM would compute for an OpenAI request body (a prompt list: its first)."""
    if "messages" in body:
        return chat_token_ids(tokenizer, body)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        prompt = prompt[0] if prompt else ""
        if isinstance(prompt, list):
            return list(prompt)
    return tokenizer.encode(str(prompt), add_special_tokens=body.get("add_special_tokens", True) is not False)
