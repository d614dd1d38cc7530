"""kvflow's Kubernetes operator (kopf), installed as ``kvflow.operator``.

The folder is ``kube_operator/`` because a top-level ``operator/`` package would shadow the
standard library's ``operator`` whenever the repository root is on ``sys.path``. Pure decisions
and renderers (``spec``, ``plan``, ``names``, ``args``, ``objects``, ``render*``, ``volumes``,
``status``, ``health``, ``lifecycle``) sit in the middle; ``reconcile``, ``handlers``, ``kube``,
``election``, ``scrape``, ``run`` and ``cli`` are its I/O edge.
"""
