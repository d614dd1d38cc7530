"""Compatibility name for ``operator_emulator`` (tests/router/test_k8s.py imports it by this name)."""

from operator_emulator import AuditEntry, Cluster

__all__ = ["AuditEntry", "Cluster"]
