"""The decode pod's P/D routing sidecar (llm-d's routing sidecar), a deployable of its own.

When Envoy and the endpoint picker route, Envoy sends a request to the decode pod the picker
chose, on the sidecar's port; the sidecar runs the prefill step on the pod ``x-prefiller-host-port``
names (if it is on its allow-list) and hands the request to the vLLM next to it. ``server``
holds it; ``kvflow gateway --sidecar --upstream HOST:PORT`` starts it (the command the operator
renders), reading the gateway's configuration file (its ``sidecar`` section, HTTP limits, timeouts).

Allowed dependency: it is built on the gateway's HTTP edge (``kvflow.gateway`` httpserver, proxy,
body, pd, config, allowlist, server): the same server, limits and trust-boundary checks. The
gateway imports it only from its CLI entry (``kvflow.gateway.cli``). Both are import-linter
contracts in pyproject.toml.
"""
