"""The OpenAI requests the conformance suite sends to both servers, one class of request each.

Standard library only: tests/golden/capture/capture_openai.py imports this table with the vLLM
venv's python to record real vLLM's answers (tests/golden/vllm_openai_cases.json), and
test_openai_cases.py sends the same requests to the simulator (and to real vLLM with
KVFLOW_REAL_VLLM=1) and compares what facts.py extracts from each answer.

Success cases set ``ignore_eos`` where the token counts are compared: the tiny model's weights are
random, so without it an early end-of-sequence token would make counts differ by chance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL = "tiny-llama"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None
    """The JSON body; None sends a GET (or ``raw`` as the body)."""
    raw: bytes | None = None
    method: str | None = None

    @property
    def http_method(self) -> str:
        if self.method:
            return self.method
        return "GET" if self.body is None and self.raw is None else "POST"


def _cmpl(name: str, **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True, **fields}
    return Case(name, CMPL, {k: v for k, v in body.items() if v is not _DROP})


def _chat(name: str, **fields: Any) -> Case:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 3,
            "ignore_eos": True, **fields}
    return Case(name, CHAT, {k: v for k, v in body.items() if v is not _DROP})


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


_DROP: Any = _Drop()
"""A field value that removes the field from the default body."""

TEXTS = ["Once upon a time", "def main():", "Lorem ipsum dolor"]

COMPLETIONS = [
    # several choices and several prompts
    _cmpl("cmpl-n2", n=2),
    _cmpl("cmpl-n3-seed", n=3, seed=11),
    _cmpl("cmpl-best-of-ignored", best_of=3),
    _cmpl("cmpl-prompt-list", prompt=TEXTS[:2]),
    _cmpl("cmpl-prompt-list-n2", prompt=TEXTS, n=2),
    _cmpl("cmpl-token-ids", prompt=[5, 6, 7, 8, 9]),
    _cmpl("cmpl-token-id-lists", prompt=[[5, 6, 7], [10, 11, 12, 13]]),
    _cmpl("cmpl-one-item-list", prompt=["Hello there"]),
    _cmpl("cmpl-return-token-ids", return_token_ids=True),
    _cmpl("cmpl-return-token-ids-list", prompt=TEXTS[:2], n=2, return_token_ids=True),
    # defaults and limits
    _cmpl("cmpl-default-max-tokens", max_tokens=_DROP),
    _cmpl("cmpl-null-max-tokens", max_tokens=None),
    _cmpl("cmpl-missing-model", model=_DROP),
    _cmpl("cmpl-null-model", model=None),
    _cmpl("cmpl-max-tokens-clamped", max_tokens=510, prompt=list(range(100, 110))),
    _cmpl("cmpl-max-tokens-equals-context", max_tokens=512, prompt=[7]),
    _cmpl("cmpl-max-tokens-over-context", max_tokens=513),
    _cmpl("cmpl-prompt-fills-context-less-one", prompt=list(range(100, 611)), max_tokens=5),
    _cmpl("cmpl-prompt-fills-context", prompt=list(range(100, 612)), max_tokens=5),
    _cmpl("cmpl-prompt-over-context", prompt=list(range(100, 613)), max_tokens=5),
    _cmpl("cmpl-min-tokens", min_tokens=3),
    _cmpl("cmpl-min-tokens-over-max", min_tokens=4),
    _cmpl("cmpl-min-tokens-negative", min_tokens=-1),
    _cmpl("cmpl-max-tokens-zero", max_tokens=0),
    _cmpl("cmpl-max-tokens-negative", max_tokens=-1),
    _cmpl("cmpl-max-tokens-float", max_tokens=2.0),
    _cmpl("cmpl-max-tokens-fraction", max_tokens=2.5),
    _cmpl("cmpl-max-tokens-string", max_tokens="3"),
    _cmpl("cmpl-max-tokens-bool", max_tokens=True),
    # echo and logprobs
    _cmpl("cmpl-echo", echo=True),
    _cmpl("cmpl-echo-zero-tokens", echo=True, max_tokens=0),
    _cmpl("cmpl-echo-token-ids", echo=True, prompt=[5, 6, 7]),
    _cmpl("cmpl-echo-return-token-ids", echo=True, return_token_ids=True),
    _cmpl("cmpl-logprobs-0", logprobs=0),
    _cmpl("cmpl-logprobs-2", logprobs=2),
    _cmpl("cmpl-logprobs-20", logprobs=20),
    _cmpl("cmpl-logprobs-21", logprobs=21),
    _cmpl("cmpl-logprobs-minus-1", logprobs=-1),
    _cmpl("cmpl-logprobs-minus-2", logprobs=-2),
    _cmpl("cmpl-logprobs-string", logprobs="2"),
    _cmpl("cmpl-logprobs-echo", logprobs=1, echo=True),
    _cmpl("cmpl-prompt-logprobs", prompt_logprobs=1),
    _cmpl("cmpl-prompt-logprobs-0", prompt_logprobs=0),
    _cmpl("cmpl-prompt-logprobs-21", prompt_logprobs=21),
    _cmpl("cmpl-prompt-logprobs-negative", prompt_logprobs=-3),
    _cmpl("cmpl-prompt-logprobs-stream", prompt_logprobs=1, stream=True),
    # sampling parameter ranges (SamplingParams._verify_args)
    _cmpl("cmpl-n0", n=0),
    _cmpl("cmpl-n-negative", n=-2),
    _cmpl("cmpl-n-string", n="2"),
    _cmpl("cmpl-n-null", n=None),
    _cmpl("cmpl-n2-greedy", n=2, temperature=0),
    _cmpl("cmpl-temperature-negative", temperature=-0.5),
    _cmpl("cmpl-temperature-high", temperature=2.5),
    _cmpl("cmpl-temperature-two", temperature=2.0),
    _cmpl("cmpl-temperature-tiny", temperature=0.001),
    _cmpl("cmpl-top-p-zero", top_p=0),
    _cmpl("cmpl-top-p-high", top_p=1.5),
    _cmpl("cmpl-top-p-half", top_p=0.5),
    _cmpl("cmpl-top-k-minus-2", top_k=-2),
    _cmpl("cmpl-top-k-minus-1", top_k=-1),
    _cmpl("cmpl-top-k-float", top_k=2.5),
    _cmpl("cmpl-min-p-high", min_p=1.5),
    _cmpl("cmpl-presence-penalty-high", presence_penalty=2.5),
    _cmpl("cmpl-frequency-penalty-low", frequency_penalty=-2.5),
    _cmpl("cmpl-repetition-penalty-zero", repetition_penalty=0),
    _cmpl("cmpl-seed-huge", seed=2**70),
    _cmpl("cmpl-seed-minus-1", seed=-1),
    _cmpl("cmpl-logit-bias-bad-key", logit_bias={"abc": 1.0}),
    _cmpl("cmpl-logit-bias-oov", logit_bias={"999999": 1.0}),
    _cmpl("cmpl-logit-bias", logit_bias={"5": 1.0}),
    _cmpl("cmpl-stop-token-ids-oov", stop_token_ids=[999999]),
    _cmpl("cmpl-allowed-token-ids-empty", allowed_token_ids=[]),
    _cmpl("cmpl-allowed-token-ids-oov", allowed_token_ids=[999999]),
    _cmpl("cmpl-bad-words-empty", bad_words=[""]),
    _cmpl("cmpl-cache-salt-empty", cache_salt=""),
    _cmpl("cmpl-cache-salt-slash", cache_salt="a/b"),
    _cmpl("cmpl-truncate-prompt-tokens", truncate_prompt_tokens=2),
    _cmpl("cmpl-truncate-prompt-tokens-over", truncate_prompt_tokens=600),
    _cmpl("cmpl-stream-interval-zero", stream_interval=0, stream=True),
    _cmpl("cmpl-priority", priority=1),
    _cmpl("cmpl-use-beam-search", use_beam_search=True),
    _cmpl("cmpl-suffix", suffix="tail"),
    _cmpl("cmpl-response-format-no-schema", response_format={"type": "json_schema"}),
    _cmpl("cmpl-unknown-extension", vendor_field={"a": 1}),
    # stop strings
    _cmpl("cmpl-stop-empty-string", stop=[""]),
    _cmpl("cmpl-stop-five", stop=["a", "b", "c", "d", "e"]),
    _cmpl("cmpl-stop-not-string", stop=[1]),
    _cmpl("cmpl-stop-null", stop=None),
    _cmpl("cmpl-stop-string", stop="zzzzzz"),
    # prompts vLLM refuses
    _cmpl("cmpl-prompt-empty", prompt=""),
    _cmpl("cmpl-prompt-empty-list", prompt=[]),
    _cmpl("cmpl-prompt-empty-inner-list", prompt=[[]]),
    _cmpl("cmpl-prompt-empty-string-in-list", prompt=["", "x"]),
    _cmpl("cmpl-prompt-oov", prompt=[999999]),
    _cmpl("cmpl-prompt-negative-id", prompt=[-1]),
    _cmpl("cmpl-prompt-mixed", prompt=[1, "a"]),
    _cmpl("cmpl-prompt-number", prompt=3),
    _cmpl("cmpl-prompt-missing", prompt=_DROP),
    _cmpl("cmpl-prompt-text-too-long", prompt="hello " * 1200),
    # streaming
    _cmpl("cmpl-stream", stream=True),
    _cmpl("cmpl-stream-usage", stream=True, stream_options={"include_usage": True}),
    _cmpl("cmpl-stream-continuous-usage", stream=True,
          stream_options={"include_usage": True, "continuous_usage_stats": True}),
    _cmpl("cmpl-stream-continuous-without-usage", stream=True, stream_options={"continuous_usage_stats": True}),
    _cmpl("cmpl-stream-options-without-stream", stream_options={"include_usage": True}),
    _cmpl("cmpl-stream-options-empty-without-stream", stream_options={}),
    _cmpl("cmpl-stream-options-bad-type", stream=True, stream_options={"include_usage": "yes"}),
    _cmpl("cmpl-stream-n2", stream=True, n=2, max_tokens=4, stream_options={"include_usage": True}),
    _cmpl("cmpl-stream-prompt-list", stream=True, prompt=TEXTS[:2], stream_options={"include_usage": True}),
    _cmpl("cmpl-stream-echo", stream=True, echo=True),
    _cmpl("cmpl-stream-logprobs", stream=True, logprobs=1),
    _cmpl("cmpl-stream-return-token-ids", stream=True, return_token_ids=True),
    _cmpl("cmpl-stream-string", stream="yes"),
    _cmpl("cmpl-stream-beam-search", stream=True, use_beam_search=True),
    # refusals the engine makes after a stream has started: an error event in a 200 stream
    _cmpl("cmpl-stream-prompt-oov", stream=True, prompt=[999999]),
    _cmpl("cmpl-stream-logprobs-21", stream=True, logprobs=21),
    _cmpl("cmpl-stream-prompt-empty-inner-list", stream=True, prompt=[[]]),
    _cmpl("cmpl-stream-temperature-high", stream=True, temperature=3),
    _cmpl("cmpl-prompt-list-second-oov", prompt=[[5, 6], [999999]]),
    _cmpl("cmpl-prompt-embeds", prompt=_DROP, prompt_embeds="AAAA"),
    _cmpl("cmpl-suffix-echo", suffix="tail", echo=True),
    _cmpl("cmpl-prompt-list-too-many", prompt=["x"] * 1025, max_tokens=1),
    _cmpl("cmpl-vllm-xargs-bad", vllm_xargs={"a": {"b": 1}}),
    _cmpl("cmpl-logprob-token-ids-without-logprobs", logprob_token_ids=[5]),
    _cmpl("cmpl-include-stop-str", stop="zzzz", include_stop_str_in_output=True),
    # two faults in one request: vLLM's order of checks decides which is reported
    _cmpl("order-beam-stream-before-model", model="nope", stream=True, use_beam_search=True),
    _cmpl("order-model-before-prompt", model="nope", prompt=""),
    _cmpl("order-schema-before-model", model="nope", max_tokens="many"),
    _cmpl("order-model-before-sampling", model="nope", temperature=5),
    _cmpl("order-prompt-before-sampling", prompt=list(range(100, 613)), temperature=5),
    _cmpl("order-context-before-prompt", max_tokens=600, prompt=list(range(100, 613))),
    _cmpl("order-sampling-before-engine", temperature=5, logprobs=21, prompt=[999999]),
    _cmpl("order-engine-logprobs-before-prompt", logprobs=21, prompt=[999999]),
    _chat("order-chat-tools-before-template", tool_choice="required", tools=[{"type": "function",
          "function": {"name": "f"}}], messages=[]),
    _chat("order-chat-template-before-sampling", messages=[], temperature=5),
]

_SYS = {"role": "system", "content": "You are terse."}
_USER = {"role": "user", "content": "Say hello"}
_ASSISTANT = {"role": "assistant", "content": "Hello"}

CHATS = [
    _chat("chat-n2", n=2),
    _chat("chat-n2-greedy", n=2, temperature=0),
    _chat("chat-best-of", best_of=2),
    _chat("chat-missing-model", model=_DROP),
    _chat("chat-default-max-tokens", max_tokens=_DROP, messages=[{"role": "user", "content": "x " * 240}]),
    _chat("chat-max-completion-tokens", max_tokens=_DROP, max_completion_tokens=2),
    _chat("chat-max-completion-tokens-wins", max_tokens=5, max_completion_tokens=2),
    _chat("chat-max-completion-tokens-zero", max_tokens=_DROP, max_completion_tokens=0),
    _chat("chat-max-completion-tokens-over", max_tokens=_DROP, max_completion_tokens=600),
    _chat("chat-max-tokens-zero", max_tokens=0),
    _chat("chat-min-tokens-over-default", max_tokens=_DROP, min_tokens=600),
    # prompts: the tokens the template makes are compared exactly (return_token_ids)
    _chat("chat-tokens", return_token_ids=True),
    _chat("chat-system-user-assistant", return_token_ids=True, messages=[_SYS, _USER, _ASSISTANT, _USER]),
    _chat("chat-developer-role", return_token_ids=True, messages=[{"role": "developer", "content": "Be brief."},
                                                                    _USER]),
    _chat("chat-developer-after-system", return_token_ids=True,
          messages=[_SYS, _USER, {"role": "developer", "content": "Be brief."}, _USER]),
    _chat("chat-custom-role", return_token_ids=True, messages=[{"role": "narrator", "content": "Once"}, _USER]),
    _chat("chat-tool-role", return_token_ids=True, messages=[_USER, {"role": "tool", "content": "42",
                                                                       "tool_call_id": "c1"}]),
    _chat("chat-content-parts", return_token_ids=True,
          messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]),
    _chat("chat-content-parts-empty", return_token_ids=True, messages=[{"role": "user", "content": []}]),
    _chat("chat-no-content", return_token_ids=True, messages=[_USER, {"role": "assistant"}]),
    _chat("chat-null-content", return_token_ids=True, messages=[_USER, {"role": "assistant", "content": None}]),
    _chat("chat-name-field", return_token_ids=True, messages=[{**_USER, "name": "ann"}]),
    _chat("chat-no-generation-prompt", return_token_ids=True, add_generation_prompt=False),
    _chat("chat-continue-final", return_token_ids=True, add_generation_prompt=False, continue_final_message=True,
          messages=[_USER, {"role": "assistant", "content": "Hello, my"}]),
    _chat("chat-continue-final-and-generation", continue_final_message=True,
          messages=[_USER, {"role": "assistant", "content": "Hello"}]),
    _chat("chat-echo", echo=True, add_generation_prompt=False, messages=[_USER, _ASSISTANT]),
    _chat("chat-echo-other-role", echo=True),
    _chat("chat-stream-echo", echo=True, stream=True, add_generation_prompt=False, messages=[_USER, _ASSISTANT]),
    _chat("chat-add-special-tokens", return_token_ids=True, add_special_tokens=True),
    _chat("chat-prompt-too-long", messages=[{"role": "user", "content": "hello " * 600}]),
    # logprobs
    _chat("chat-logprobs", logprobs=True),
    _chat("chat-top-logprobs", logprobs=True, top_logprobs=3),
    _chat("chat-top-logprobs-null", logprobs=True, top_logprobs=None),
    _chat("chat-top-logprobs-without-logprobs", top_logprobs=2),
    _chat("chat-top-logprobs-21", logprobs=True, top_logprobs=21),
    _chat("chat-top-logprobs-negative", logprobs=True, top_logprobs=-2),
    _chat("chat-logprobs-int", logprobs=2),
    _chat("chat-prompt-logprobs", prompt_logprobs=1),
    _chat("chat-stream-logprobs", logprobs=True, top_logprobs=1, stream=True),
    # sampling ranges and other refusals
    _chat("chat-n0", n=0),
    _chat("chat-temperature-high", temperature=3),
    _chat("chat-top-p-zero", top_p=0.0),
    _chat("chat-stop-empty", stop=[""]),
    _chat("chat-stream-options-without-stream", stream_options={"include_usage": True}),
    _chat("chat-tools-empty", tools=[]),
    _chat("chat-tool-choice-without-tools", tool_choice="auto"),
    _chat("chat-cache-salt-empty", cache_salt=""),
    _chat("chat-messages-empty", messages=[]),
    _chat("chat-messages-missing", messages=_DROP),
    _chat("chat-messages-string", messages="hi"),
    _chat("chat-message-no-role", messages=[{"content": "hi"}]),
    _chat("chat-message-content-number", messages=[{"role": "user", "content": 5}]),
    _chat("chat-message-not-object", messages=["hi"]),
    _chat("chat-unknown-model", model="nope"),
    _chat("chat-user-null-content", messages=[{"role": "user", "content": None}]),
    _chat("chat-part-without-text", messages=[{"role": "user", "content": [{"type": "text"}]}]),
    _chat("chat-part-unknown-type", messages=[{"role": "user", "content": [{"type": "video", "x": 1}]}]),
    _chat("chat-parts-as-strings", return_token_ids=True, messages=[{"role": "user", "content": ["Say", "hi"]}]),
    _chat("chat-name-not-string", messages=[{"role": "user", "content": "hi", "name": 5}]),
    _chat("chat-role-number", messages=[{"role": 5, "content": "hi"}]),
    _chat("chat-template-in-request", chat_template="{{ messages }}"),
    _chat("chat-tool-choice-auto", tools=[{"type": "function", "function": {"name": "f"}}]),
    _chat("chat-tool-choice-required", tool_choice="required",
          tools=[{"type": "function", "function": {"name": "f"}}]),
    _chat("chat-tool-choice-none", tool_choice="none", tools=[{"type": "function", "function": {"name": "f"}}]),
    _chat("chat-reasoning-effort-bad", reasoning_effort="extreme"),
    _chat("chat-stream-top-logprobs-21", stream=True, logprobs=True, top_logprobs=21),
    _chat("chat-documents", return_token_ids=True, documents=[{"title": "t", "text": "x"}]),
    _chat("chat-template-kwargs", return_token_ids=True, chat_template_kwargs={"foo": 1}),
    # streaming
    _chat("chat-stream", stream=True),
    _chat("chat-stream-usage", stream=True, stream_options={"include_usage": True}),
    _chat("chat-stream-continuous-usage", stream=True,
          stream_options={"include_usage": True, "continuous_usage_stats": True}),
    _chat("chat-stream-n2", stream=True, n=2, max_tokens=4, stream_options={"include_usage": True}),
    _chat("chat-stream-return-token-ids", stream=True, return_token_ids=True),
    _chat("chat-stream-no-generation-prompt", stream=True, add_generation_prompt=False),
]

OTHER = [
    Case("tokenize-prompt", "/tokenize", {"model": MODEL, "prompt": "Hello world"}),
    Case("tokenize-no-model", "/tokenize", {"prompt": "Hello world"}),
    Case("tokenize-no-special", "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}),
    Case("tokenize-token-strs", "/tokenize", {"prompt": "Hello world", "return_token_strs": True}),
    Case("tokenize-messages", "/tokenize", {"messages": [_SYS, _USER]}),
    Case("tokenize-messages-developer", "/tokenize", {"messages": [{"role": "developer", "content": "Be brief."},
                                                                    _USER]}),
    Case("tokenize-messages-no-generation-prompt", "/tokenize", {"messages": [_USER],
                                                                  "add_generation_prompt": False}),
    Case("tokenize-messages-continue", "/tokenize",
         {"messages": [_USER, _ASSISTANT], "continue_final_message": True, "add_generation_prompt": False}),
    Case("tokenize-messages-both", "/tokenize", {"messages": [_USER, _ASSISTANT], "continue_final_message": True}),
    Case("tokenize-unknown-model", "/tokenize", {"model": "nope", "prompt": "x"}),
    Case("tokenize-empty", "/tokenize", {}),
    Case("tokenize-prompt-number", "/tokenize", {"prompt": 5}),
    Case("tokenize-long", "/tokenize", {"prompt": "hello " * 1000}),
    Case("detokenize", "/detokenize", {"model": MODEL, "tokens": [1, 277, 80, 336]}),
    Case("detokenize-no-model", "/detokenize", {"tokens": [277, 80, 336]}),
    Case("detokenize-empty", "/detokenize", {"tokens": []}),
    Case("detokenize-oov", "/detokenize", {"tokens": [999999]}),
    Case("detokenize-negative", "/detokenize", {"tokens": [-1]}),
    Case("detokenize-missing", "/detokenize", {}),
    Case("detokenize-unknown-model", "/detokenize", {"model": "nope", "tokens": [5]}),
    Case("ping-get", "/ping"),
    Case("ping-post", "/ping", method="POST"),
    Case("load-idle", "/load"),
    Case("health", "/health"),
    Case("version", "/version"),
    Case("models", "/v1/models"),
    Case("not-json", CMPL, raw=b"{bad"),
    Case("not-object", CMPL, raw=b"[1, 2]"),
    Case("chat-not-json", CHAT, raw=b"nope"),
    Case("get-completions", CMPL, method="GET"),
]

CASES: list[Case] = [*COMPLETIONS, *CHATS, *OTHER]
assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"
