"""Build a tiny random-weight Llama and a locally trained tokenizer.

Run as a file with the vLLM venv's python (it imports torch, transformers and
tokenizers, which the main kvflow venv does not have):

    python kvflow/local/tinymodel_build.py OUT_DIR

No hub is reachable, so both the tokenizer and the weights are made here. The
result is deterministic for a given Python stdlib: the training corpus is a
sorted, fixed list of stdlib source files, and every seed is fixed.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys
import sysconfig

VOCAB_SIZE = 2048
SEED = 0
CORPUS_FILES = 120
SPECIAL_TOKENS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]

# ChatML: simple, and the assistant turn ends with <|im_end|>, which is also EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_paths() -> list[str]:
    """A fixed, sorted slice of the stdlib sources: text that is on every machine."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    return [str(p) for p in files[:CORPUS_FILES]]


def build_tokenizer(out: pathlib.Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_paths(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    # vLLM's completions endpoint adds BOS like a Llama tokenizer does.
    tok.post_processor = TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<|end_of_text|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2) + "\n"
    )
    return tok.get_vocab_size()


def build_model(out: pathlib.Path, vocab_size: int) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.token_to_id("<|begin_of_text|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|end_of_text|>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    random.seed(SEED)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # training order must not depend on threads
    out = pathlib.Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)
    build_model(out, vocab_size)
    print(f"tiny-llama written to {out} (vocab {vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
