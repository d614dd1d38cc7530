"""Which tokenizer a router uses, and when it must refuse to start without the model's own.

Precise prefix routing compares the block hashes of the router's tokens with the hashes the
engines publish in their KV events. With real vLLM those come from the served model's
tokenizer; kvflow's built-in tokenizer matches only kvflow's simulator. A router that watches a
Kubernetes pool (as the operator deploys it, in front of real engines) and subscribes to KV
events therefore needs a tokenizer named explicitly: a Hugging Face tokenizer folder, or
``builtin`` for simulator pods. Without one it would start and silently never match a prefix.
Routers given their endpoints by hand keep the built-in default (what ``kvflow up`` runs).
"""

from __future__ import annotations

from kvflow.router.config import RouterConfig
from kvflow.tokenizer import Tokenizer, load_tokenizer

BUILTIN = "builtin"
PRECISE_SCORER = "precise-prefix-cache-scorer"


class TokenizerRequired(ValueError):
    """Precise prefix routing on a Kubernetes pool without a tokenizer: refused at start-up."""


def needs_model_tokenizer(config: RouterConfig) -> bool:
    """Does this router match prompt hashes against engines' KV events in a cluster?"""
    if not config.kv_events_enabled or config.kubernetes is None:
        return False
    return any(config.plugins[ref.plugin_ref].type == PRECISE_SCORER
               for profile in config.profiles.values() for ref in profile.plugins)


def choose_tokenizer(config: RouterConfig, setting: str | None, *, who: str) -> Tokenizer:
    """``setting`` is a tokenizer folder, ``builtin``, or None (unset)."""
    if setting == BUILTIN:
        return load_tokenizer(None)
    if setting:
        return load_tokenizer(setting)
    if needs_model_tokenizer(config):
        raise TokenizerRequired(
            f"{who}: precise prefix routing matches the prompt's block hashes against the engines' KV "
            "events, which vLLM computes with the served model's tokenizer: give the model's tokenizer "
            "folder (--tokenizer DIR), or --tokenizer builtin for kvflow sim engines")
    return load_tokenizer(None)
