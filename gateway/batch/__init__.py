"""The OpenAI Batch API on the gateway: ``/v1/files`` and ``/v1/batches``, run from idle capacity.

Pure parts: ``lines`` (input, output and error line formats), ``states`` (a batch's state
machine and the OpenAI objects), ``forms`` (multipart uploads). I/O: ``store`` (SQLite plus
files, claims and leases shared by replicas), ``runner`` (claims lines and feeds them to the
pods through the batch band of flow control), ``execute`` (one line through the gateway's
forwarding path), ``routes`` (HTTP), ``service`` (wiring them into a running gateway).
docs/batch.md describes the whole.
"""
