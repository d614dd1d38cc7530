"""``--kv-transfer nixl``: P/D KV transfers of real bytes between simulator pods over NIXL (UCX).

Prefill side (``exports``): a finished ``do_remote_decode`` request's prompt blocks get
deterministic content derived from its token ids (``layout``) and stay pinned under a lease; the
answer names this pod's engine id and side-channel address, the ``kv_transfer_params`` vLLM's
NixlConnector returns. The blocks are freed by the decode pod's done notification, or when the
lease runs out (``--kv-pin-timeout``).

Decode side: a handshake over the side channel once per prefill engine (``peers``,
``side_channel``), then READs of the blocks into the pod's own, verified block by block
(``pulls``), and a done notification (``notifications``). From the moment a ``do_remote_prefill``
request arrives until its pull ends, heartbeats renew its blocks' lease on the prefill pod
(``heartbeats``), as vLLM 0.32 does. Every failure falls back to local prefill, counted by reason.

Modules:

    transfer       NixlTransfer, NixlOptions: the parts put together (the simulator's KVTransfer)
    exports        prefill side: pinned blocks, their leases, incoming notifications
    pulls          decode side: plan, READ, verify, notify, fall back
    heartbeats     decode side: tracked requests and the lease-renewal task
    peers          decode side: handshakes and the peers they leave, cached per engine
    notifications  vLLM's done and heartbeat messages
    side_channel   vLLM's ZMQ handshake (metadata exchange)
    agent          the NIXL agent, its one thread and its progress policy
    layout         the KV buffer's shape, descriptors and block content (pure)
    metrics        vllm:nixl_* and kvflow_sim:nixl_* metrics

docs/pd.md describes the protocol, the failure table and the measurements.
"""

from kvflow.sim.nixl.transfer import NixlOptions, NixlTransfer

__all__ = ["NixlOptions", "NixlTransfer"]
