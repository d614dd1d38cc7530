"""kvflow: a Kubernetes-native control plane for distributed LLM inference on vLLM.

The shared core lives here (API types, block hashing, tokenizers, errors, OpenAI schemas);
the components are subpackages whose code sits in the repository's top-level folders:

    kvflow.sim       -> sim/       a vLLM-compatible model-server simulator
    kvflow.router    -> router/    the endpoint picker (scheduler, KV events, Envoy ext_proc)
    kvflow.gateway   -> gateway/   the OpenAI-compatible front door and P/D orchestrator
    kvflow.operator  -> operator/  the kopf operator, renderers for Kubernetes objects
    kvflow.beam      -> beam/      Apache Beam RunInference handlers (the ``beam`` extra)

Components depend on the core, never the reverse.
"""

__version__ = "0.1.0"
