"""Deterministic 'generation': output tokens drawn from a small vocabulary of whole words.

Each word encodes to exactly one token with the served tokenizer, so token ids, text and usage
counts agree with each other (and with what the router would tokenize). The draw uses the
request's own ``random.Random`` (seeded from the request's ``seed`` or the server's ``--seed``).

Log-probabilities are shaped like a small random model's (vLLM serving the tiny test model): the
chosen token near -7.5 with a rank far down the vocabulary, alternatives ranked 1..k just above
it. They are a function of (token, position) only, so a stream and a plain answer agree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvflow.sim.request import SimRequest
from kvflow.tokenizer import Tokenizer

_WORDS = (  # noqa: SIM905 - a word list reads better as prose
    "the of and to in is that it for on was with as by at from this be are or an have not they which one "
    "you were all we her she there can would their has more if will about up out time so what when some "
    "them only other new also could into most over after two first may used well any these people way "
    "because than each made many where through between work life world system data model cache token "
    "block router engine request server stream batch queue prefix decode prefill memory latency ready "
    "fast light river stone cloud garden window"
).split()


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int


class Sampler:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        pairs: dict[int, str] = {}
        for word in _WORDS:
            piece = " " + word
            ids = tokenizer.encode(piece, add_special_tokens=False)
            if len(ids) == 1 and ids[0] != tokenizer.eos_token_id:
                pairs.setdefault(ids[0], tokenizer.decode(ids) or piece)
        if not pairs:  # a tokenizer with no single-token words: decode ids one by one
            for token_id in range(100, 100 + len(_WORDS)):
                pairs[token_id] = tokenizer.decode([token_id])
        self.vocab: list[tuple[int, str]] = sorted(pairs.items())

    def sample(self, rng: random.Random) -> tuple[int, str]:
        return self.vocab[int(rng.random() * len(self.vocab))]

    def __call__(self, req: SimRequest) -> tuple[int, str]:
        forced = req.forced_output
        if forced is not None and len(req.output_ids) < len(forced):
            token_id = forced[len(req.output_ids)]
            return token_id, self._tokenizer.decode([token_id])
        return self.sample(req.rng)

    def logprobs(self, token_id: int, position: int, k: int) -> list[Logprob]:
        """The chosen token first, then the top ``k`` others, as vLLM's engine returns them."""
        rng = random.Random(token_id * 1_000_003 + position)
        chosen = Logprob(token_id, -rng.uniform(6.5, 8.2), rng.randint(k + 1, k + 2000))
        others = [t for t, _ in self.vocab if t != token_id]
        picks = rng.sample(others, min(k, len(others)))
        top = -rng.uniform(6.0, 6.5)
        return [chosen, *(Logprob(t, top - 0.05 * i, i + 1) for i, t in enumerate(picks))]
