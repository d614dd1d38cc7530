"""Deterministic tokenizers shared by the simulator and the router.

Prefix-cache affinity only works if the router turns a prompt into the same token ids as the
model server. kvflow therefore has one place that loads a tokenizer:

* a local Hugging Face tokenizer folder (``tokenizer.json`` and, for chat, the
  ``chat_template`` in ``tokenizer_config.json``), exactly what vLLM would load; or
* the built-in ``BuiltinTokenizer``: no files, stable across processes and machines
  (pieces hashed with BLAKE2b, never Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import jinja2.sandbox

Message = Mapping[str, Any]


class Tokenizer(Protocol):
    name: str
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str: ...


def message_text(message: Message) -> str:
    """The text of a chat message whose content is a string or a list of text parts."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def chatml(messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """The ChatML layout, for tokenizers that ship no chat template."""
    text = "".join(f"<|im_start|>{m.get('role', 'user')}\n{message_text(m)}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


_PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
_SPECIAL = ("<unk>", "<s>", "</s>")


class BuiltinTokenizer:
    """Words, punctuation runs and whitespace, each mapped to a stable id by BLAKE2b.

    Decoding knows every piece this process has encoded (and the output vocabulary the
    simulator samples from), which is all a simulator needs.
    """

    name = "kvflow-builtin"
    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self._pieces: dict[int, str] = dict(enumerate(_SPECIAL))

    @lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per process, pieces repeat a lot
    def _piece_id(self, piece: str) -> int:
        digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
        token_id = len(_SPECIAL) + int.from_bytes(digest, "little") % (self.vocab_size - len(_SPECIAL))
        self._pieces.setdefault(token_id, piece)
        return token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [self._piece_id(p) for p in _PIECE.findall(text)]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self._pieces.get(t, "") for t in token_ids if t >= len(_SPECIAL))

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        return chatml(messages, add_generation_prompt=add_generation_prompt)


class HFTokenizer:
    """A local Hugging Face tokenizer folder, loaded with the ``tokenizers`` library."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        folder = Path(folder)
        self.name = folder.name
        self._tok = _RustTokenizer.from_file(str(folder / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size()
        config = _read_json(folder / "tokenizer_config.json")
        self._template_source = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id = eos if eos is not None else 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        if not self._template_source:
            return chatml(messages, add_generation_prompt=add_generation_prompt)
        template = _compile_template(self._template_source)
        return str(
            template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer in a local folder, or the built-in one when ``path`` is empty."""
    if not path:
        return BuiltinTokenizer()
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return HFTokenizer(folder)


def prompt_token_ids(tokenizer: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    """The token ids vLLM would compute for an OpenAI completions or chat request body."""
    if "messages" in body:
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        prompt = prompt[0] if prompt else ""
        if isinstance(prompt, list):
            return list(prompt)
    return tokenizer.encode(str(prompt))
