"""The Batch API's settings (``batch:`` in a gateway config file; ``--batch-dir`` on the command line)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvflow.gateway.flow import BandLimits

_BAND = BandLimits()


class BatchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    dir: str = ".kvflow/batches"
    """SQLite database and files; replicas that share it share the batches (one host or one volume)."""
    replica: str | None = None
    """This replica's name on the lines it claims; default ``HOST:PORT`` (plus the worker index).
    A replica started again under the same name takes back its own claims at once; others wait
    for the claims' leases to run out."""
    lease_s: float = Field(30.0, gt=0)
    """How long a claim on lines lasts without renewal (renewed every third of it)."""
    poll_s: float = Field(0.5, gt=0)
    """How often a replica looks in the database for other replicas' batches and cancellations."""
    max_attempts: int = Field(5, ge=1)
    """Tries per line while no pod can be reached (502/503), with back-off; then the line fails."""
    max_file_lines: int = Field(50_000, ge=1)
    """Lines an uploaded batch file may have (OpenAI's limit). Its bytes are bounded by the
    gateway's ``max_body_bytes``; together they bound what validating a batch costs in memory and
    in database rows."""
    owner_quota_bytes: int = Field(10 * 1024**3, ge=1)
    """Disk one owner's files may take (uploads and results); an upload past it is refused."""
    per_pod: int = Field(_BAND.per_pod, ge=1)
    first_cap: int = Field(_BAND.first_cap, ge=1)
    busy_per_pod: int = Field(_BAND.busy_per_pod, ge=0)
    max_waiting: int = Field(_BAND.max_waiting, ge=0)
    idle_waiting: int = Field(_BAND.idle_waiting, ge=0)
    max_kv_usage: float = Field(_BAND.max_kv_usage, gt=0, le=1)
    quiet_s: float = Field(_BAND.quiet_s, ge=0)

    def limits(self) -> BandLimits:
        return BandLimits(per_pod=self.per_pod, first_cap=self.first_cap, busy_per_pod=self.busy_per_pod, max_waiting=self.max_waiting,
                          idle_waiting=self.idle_waiting, max_kv_usage=self.max_kv_usage,
                          quiet_s=self.quiet_s)
