"""Where batches live: one SQLite database plus one file per uploaded or produced JSONL file.

    <batch dir>/batches.db        files, batches, and one row per input line while a batch runs
    <batch dir>/files/<file id>   the bytes of each file

Every decision that several gateway replicas could race on is one SQLite write transaction
(``BEGIN IMMEDIATE``), so replicas sharing the directory agree without talking to each other:

* a replica **claims** lines by writing its name and a lease deadline on them; it renews the
  lease while it runs them, and a line whose lease ran out (its replica died) can be claimed
  again;
* a result is **recorded** only by the replica that still holds the line's claim, in the same
  transaction that counts it; a line therefore has exactly one result, even if a replica that
  stalled past its lease finishes it late;
* validating, cancelling and finalizing a batch are taken with a lease on the batch row.

``Store`` is blocking (sqlite3) and is used from one thread; ``AsyncStore`` runs its methods on
that thread so the event loop never waits on the disk.

Opening checks the database before anything is written to it: one that is not SQLite, is
damaged (``PRAGMA quick_check``), was written by a newer kvflow, or is empty (0 bytes) beside
stored files is refused with ``StoreUnavailable`` naming the problem, never recreated over the
history; the gateway then answers the Batch API with that 503 and serves everything else.

Schema versions (``PRAGMA user_version``): 0, owners were API keys' names, and unnamed keys were
named by their place in the keys file; 1, owners are ``ApiKey.owner`` (the operator's name for
the key, or a digest of the key). Opening a version-0 store renames the owners it knows.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from kvflow.errors import InvalidRequestError, KvflowError, NotFoundError
from kvflow.gateway.batch.lines import LineError, error_line
from kvflow.gateway.batch.states import BatchRecord, FileRecord, Status, sources

PENDING, CLAIMED, DONE = 0, 1, 2
DB_NAME = "batches.db"
SCHEMA_VERSION = 1


class StoreUnavailable(KvflowError):
    """The batch store cannot be used (read-only, damaged, full): the Batch API answers 503."""

    status = 503
    type = "ServiceUnavailableError"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, metadata TEXT, output_file_id TEXT, error_file_id TEXT, errors TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    stamps TEXT NOT NULL DEFAULT '{}', holder TEXT, lease_until REAL, expired INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, state INTEGER NOT NULL,
    holder TEXT, lease_until REAL, not_before REAL NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0,
    request BLOB, ok INTEGER, result BLOB, done_by TEXT,
    PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_todo ON lines (batch_id, state, idx);
CREATE INDEX IF NOT EXISTS lines_held ON lines (holder) WHERE state = 1;
"""

_BATCH_COLUMNS = ("id, owner, endpoint, input_file_id, completion_window, status, created_at, expires_at, metadata,"
                  " output_file_id, error_file_id, errors, total, completed, failed, stamps")


@dataclass(frozen=True, slots=True)
class NewLine:
    """A line as validation stores it: a request to run, or its result already (malformed)."""

    index: int
    custom_id: str | None
    request: bytes | None
    result: bytes | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    batch_id: str
    index: int
    custom_id: str | None
    request: bytes
    attempts: int


@dataclass(frozen=True, slots=True)
class Result:
    batch_id: str
    index: int
    ok: bool
    line: bytes


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class Store:
    def __init__(self, root: Path, renamed: dict[str, str] | None = None) -> None:
        """Open (or create) the store at ``root``; ``renamed`` maps version-0 owners to today's.
        StoreUnavailable when it cannot be used as it is."""
        self.root = root
        self.files_dir = root / "files"
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            self._refuse_empty_over_files(root / DB_NAME)
            # autocommit mode: transactions are explicit (BEGIN IMMEDIATE takes the write lock up front,
            # so two replicas never deadlock upgrading a read to a write)
            self.db = sqlite3.connect(root / DB_NAME, timeout=30.0, isolation_level=None, check_same_thread=False)
        except OSError as exc:
            raise StoreUnavailable(f"the batch store {root} cannot be opened: {exc.strerror or exc}") from None
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the batch store {root / DB_NAME} cannot be opened: {exc}") from None
        try:
            self._check()
            self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # a new database gives finished batches' space back
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA journal_size_limit=67108864")  # the WAL shrinks back to 64 MiB after a burst
            self.db.execute("PRAGMA synchronous=NORMAL")  # a committed result survives a killed process
            self.db.executescript(_SCHEMA)
            self._migrate(renamed or {})
        except sqlite3.Error as exc:
            self.db.close()
            raise StoreUnavailable(f"the batch store {root / DB_NAME} cannot be used: {exc}") from None
        except StoreUnavailable:
            self.db.close()
            raise

    def _refuse_empty_over_files(self, path: Path) -> None:
        """A 0-byte database beside stored files lost its history: say so rather than start over."""
        if path.exists() and path.stat().st_size == 0 and any(self.files_dir.iterdir()):
            raise StoreUnavailable(f"the batch store {path} is empty (0 bytes) but {self.files_dir} holds files:"
                                   " its batches' history is gone; restore it, or move it away to start a new one")

    def _check(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreUnavailable(f"the batch store {self.root / DB_NAME} has schema version {version}, newer than"
                                   f" this kvflow's {SCHEMA_VERSION}")
        problems = [row[0] for row in self.db.execute("PRAGMA quick_check(3)").fetchall()]
        if problems != ["ok"]:
            raise StoreUnavailable(f"the batch store {self.root / DB_NAME} is damaged: {'; '.join(problems)}")

    def _migrate(self, renamed: dict[str, str]) -> None:
        with self._tx() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
                return  # another replica did it
            for old, new in renamed.items():
                for table in ("files", "batches"):
                    db.execute(f"UPDATE {table} SET owner = ? WHERE owner = ?", (new, old))
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- files ---------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, rec: FileRecord, data: bytes) -> None:
        _write_atomically(self.file_path(rec.id), [data])
        with self._tx() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                       (rec.id, rec.owner, rec.filename, rec.purpose, rec.bytes, rec.created_at))

    def get_file(self, owner: str, file_id: str) -> FileRecord:
        row = self.db.execute("SELECT id, owner, filename, purpose, bytes, created_at FROM files"
                              " WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        if row is None:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id")
        return FileRecord(*row)

    def read_file(self, owner: str, file_id: str) -> bytes:
        self.get_file(owner, file_id)
        return self.file_path(file_id).read_bytes()

    def owned_path(self, owner: str, file_id: str) -> Path:
        """Where the bytes of a file ``owner`` has are (NotFoundError for anyone else's)."""
        self.get_file(owner, file_id)
        return self.file_path(file_id)

    def stored_bytes(self, owner: str) -> int:
        """What ``owner``'s files take: uploads and batch results."""
        return int(self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner = ?",
                                   (owner,)).fetchone()[0])

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int,
                   newest_first: bool) -> tuple[list[FileRecord], bool]:
        sql = "SELECT id, owner, filename, purpose, bytes, created_at FROM files WHERE owner = ?"
        args: list[Any] = [owner]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        sql, args = self._page(sql, args, "files", after, newest_first)
        rows = self.db.execute(sql, [*args, limit + 1]).fetchall()
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> None:
        with self._tx() as db:
            if db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount == 0:
                raise NotFoundError(f"No such File object: {file_id}", param="file_id")
        self.file_path(file_id).unlink(missing_ok=True)

    # --- batches: the API side -----------------------------------------------------------

    def add_batch(self, rec: BatchRecord) -> None:
        with self._tx() as db:
            if db.execute("SELECT 1 FROM files WHERE id = ? AND owner = ? AND purpose = 'batch'",
                          (rec.input_file_id, rec.owner)).fetchone() is None:
                raise NotFoundError(f"No such batch input file: {rec.input_file_id} (upload it with"
                                    " purpose 'batch')", param="input_file_id")
            db.execute(f"INSERT INTO batches ({_BATCH_COLUMNS}) VALUES ({', '.join('?' * 16)})", _batch_row(rec))

    def get_batch(self, owner: str | None, batch_id: str) -> BatchRecord:
        sql, args = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        row = self.db.execute(sql, args).fetchone()
        if row is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        return _batch(row)

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        sql, args = self._page(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE owner = ?", [owner], "batches",
                               after, True)
        rows = self.db.execute(sql, [*args, limit + 1]).fetchall()
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, owner: str, batch_id: str, now: int) -> BatchRecord:
        with self._tx():
            rec = self.get_batch(owner, batch_id)
            if rec.status is Status.CANCELLING or rec.status is Status.CANCELLED:
                return rec
            if rec.status not in sources(Status.CANCELLING):
                raise InvalidRequestError(f"Cannot cancel a batch with status '{rec.status}'.", param="batch_id")
            self._move(rec, Status.CANCELLING, now)
        return self.get_batch(owner, batch_id)

    @staticmethod
    def _page(sql: str, args: list[Any], table: str, after: str | None, newest_first: bool) -> tuple[str, list[Any]]:
        cmp, order = ("<", "DESC") if newest_first else (">", "ASC")
        if after:
            sql += f" AND rowid {cmp} (SELECT rowid FROM {table} WHERE id = ?)"
            args = [*args, after]
        return sql + f" ORDER BY rowid {order} LIMIT ?", args

    # --- batches: the runner side --------------------------------------------------------

    def active(self) -> list[BatchRecord]:
        """Batches some replica still has work on, oldest first."""
        done = tuple(s.value for s in Status if s.terminal)
        rows = self.db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status NOT IN (?, ?, ?, ?)"
                               " ORDER BY rowid", done).fetchall()
        return [_batch(r) for r in rows]

    def lease_batch(self, batch_id: str, holder: str, until: float, now: float) -> bool:
        """Take (or keep) the batch's lease for a one-replica phase: validating or finalizing."""
        with self._tx() as db:
            return db.execute(
                "UPDATE batches SET holder = ?, lease_until = ? WHERE id = ?"
                " AND (holder IS NULL OR holder = ? OR lease_until < ?)",
                (holder, until, batch_id, holder, now)).rowcount == 1

    def start(self, batch_id: str, holder: str, lines: Sequence[NewLine], now: int) -> bool:
        """validating -> in_progress with the batch's lines; False if another replica did it."""
        with self._tx() as db:
            rec = self.get_batch(None, batch_id)
            if rec.status is not Status.VALIDATING or not self._holds(batch_id, holder):
                return False
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, state, request, ok, result) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(batch_id, ln.index, ln.custom_id, DONE if ln.result is not None else PENDING, ln.request,
                  0 if ln.result is not None else None, ln.result) for ln in lines])
            failed = sum(1 for ln in lines if ln.result is not None)
            db.execute("UPDATE batches SET total = ?, failed = ?, holder = NULL WHERE id = ?",
                       (len(lines), failed, batch_id))
            self._move(rec, Status.IN_PROGRESS, now)
            return True

    def fail(self, batch_id: str, errors: list[dict[str, Any]], now: int) -> None:
        with self._tx() as db:
            rec = self.get_batch(None, batch_id)
            if rec.status is Status.VALIDATING:
                db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))
                self._move(rec, Status.FAILED, now)

    def claim(self, batch_id: str, holder: str, n: int, until: float, now: float) -> list[Claimed]:
        """Up to ``n`` runnable lines of an in-progress batch, claimed for ``holder`` until ``until``."""
        with self._tx() as db:
            status = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if status is None or status[0] != Status.IN_PROGRESS:
                return []
            rows: list[Any] = []
            for where in ("state = 1 AND lease_until < :now", "state = 0 AND not_before <= :now"):
                if len(rows) >= n:
                    break
                rows += db.execute(
                    "UPDATE lines SET state = 1, holder = :h, lease_until = :until, attempts = attempts + 1"
                    " WHERE batch_id = :b AND idx IN (SELECT idx FROM lines WHERE batch_id = :b AND"
                    f" {where} ORDER BY idx LIMIT :n) RETURNING idx, custom_id, request, attempts",
                    {"h": holder, "until": until, "b": batch_id, "now": now, "n": n - len(rows)}).fetchall()
        return sorted((Claimed(batch_id, *row) for row in rows), key=lambda c: c.index)

    def renew(self, holder: str, until: float) -> None:
        with self._tx() as db:
            db.execute("UPDATE lines SET lease_until = ? WHERE holder = ? AND state = 1", (until, holder))
            db.execute("UPDATE batches SET lease_until = ? WHERE holder = ?", (until, holder))

    def record(self, holder: str, results: Sequence[Result]) -> int:
        """Store results of lines ``holder`` still holds; the others (lease lost) are dropped."""
        kept: dict[str, list[int]] = {}
        with self._tx() as db:
            for r in results:
                changed = db.execute(
                    "UPDATE lines SET state = 2, ok = ?, result = ?, holder = NULL, request = NULL, done_by = ?"
                    " WHERE batch_id = ? AND idx = ? AND state = 1 AND holder = ?",
                    (int(r.ok), r.line, holder, r.batch_id, r.index, holder)).rowcount
                if changed:
                    counts = kept.setdefault(r.batch_id, [0, 0])
                    counts[0 if r.ok else 1] += 1
            for batch_id, (ok, failed) in kept.items():
                db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ? WHERE id = ?",
                           (ok, failed, batch_id))
        return sum(ok + failed for ok, failed in kept.values())

    def release(self, batch_id: str, index: int, holder: str, not_before: float) -> None:
        """Give a claimed line back to run later (its pods were unreachable)."""
        with self._tx() as db:
            db.execute("UPDATE lines SET state = 0, holder = NULL, not_before = ? WHERE batch_id = ? AND idx = ?"
                       " AND state = 1 AND holder = ?", (not_before, batch_id, index, holder))

    def release_lines(self, batch_id: str, holder: str, indexes: Sequence[int]) -> None:
        """Give back claimed lines that never started (their batch is being cancelled)."""
        with self._tx() as db:
            db.executemany("UPDATE lines SET state = 0, holder = NULL WHERE batch_id = ? AND idx = ? AND state = 1"
                           " AND holder = ?", [(batch_id, i, holder) for i in indexes])

    def release_all(self, holder: str) -> int:
        """A replica starting again under the same name: its old claims run nowhere now."""
        with self._tx() as db:
            db.execute("UPDATE batches SET holder = NULL WHERE holder = ?", (holder,))
            return db.execute("UPDATE lines SET state = 0, holder = NULL WHERE holder = ? AND state = 1",
                              (holder,)).rowcount

    def any_unfinished(self, batch_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM lines WHERE batch_id = ? AND state < 2 LIMIT 1",
                               (batch_id,)).fetchone() is not None

    def any_running(self, batch_id: str, now: float) -> bool:
        """Whether some replica holds a live claim on a line of the batch."""
        return self.db.execute("SELECT 1 FROM lines WHERE batch_id = ? AND state = 1 AND lease_until >= ? LIMIT 1",
                               (batch_id, now)).fetchone() is not None

    def expire(self, batch_id: str, now: int) -> None:
        """in_progress -> finalizing past ``expires_at``: unrun lines become ``batch_expired`` errors."""
        error = LineError("batch_expired", "This request could not be executed before the completion window expired.")
        with self._tx() as db:
            rec = self.get_batch(None, batch_id)
            if rec.status is not Status.IN_PROGRESS:
                return
            rows = db.execute("SELECT idx, custom_id FROM lines WHERE batch_id = ? AND state < 2",
                              (batch_id,)).fetchall()
            db.executemany("UPDATE lines SET state = 2, ok = 0, result = ?, holder = NULL, request = NULL"
                           " WHERE batch_id = ? AND idx = ?",
                           [(error_line(batch_id, idx, cid, error), batch_id, idx) for idx, cid in rows])
            db.execute("UPDATE batches SET failed = failed + ?, expired = 1 WHERE id = ?", (len(rows), batch_id))
            self._move(rec, Status.FINALIZING, now)

    def to_finalizing(self, batch_id: str, now: int) -> bool:
        """in_progress -> finalizing once every line has its result."""
        with self._tx() as db:
            rec = self.get_batch(None, batch_id)
            if rec.status is not Status.IN_PROGRESS:
                return False
            if db.execute("SELECT 1 FROM lines WHERE batch_id = ? AND state < 2 LIMIT 1", (batch_id,)).fetchone():
                return False
            self._move(rec, Status.FINALIZING, now)
            return True

    def finalize(self, batch_id: str, holder: str, now: int) -> BatchRecord | None:
        """Write the output and error files of a finalizing or cancelling batch and close it.

        The files are written (and fsynced) before the transaction that names them commits, under
        names fixed by the batch id: a replica that dies half-way leaves the batch as it was, and
        whoever finalizes it next writes the same files again.
        """
        rec = self.get_batch(None, batch_id)
        if rec.status is Status.CANCELLING:
            target = Status.CANCELLED
        elif rec.status is Status.FINALIZING:
            expired = self.db.execute("SELECT expired FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
            target = Status.EXPIRED if expired else Status.COMPLETED
        else:
            return None
        stem = batch_id.removeprefix("batch_")
        ids = {"output": f"file-{stem}-output", "error": f"file-{stem}-errors"}
        sizes = {kind: self._write_results(batch_id, ids[kind], ok=(kind == "output")) for kind in ids}
        with self._tx() as db:
            current = self.get_batch(None, batch_id)
            if current.status is not rec.status or not self._holds(batch_id, holder):
                return None
            kept = {kind: ids[kind] if sizes[kind] else None for kind in ids}
            for kind, size in sizes.items():
                if size:
                    db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                               (ids[kind], rec.owner, f"{batch_id}_{kind}.jsonl", "batch_output", size, now))
            db.execute("UPDATE batches SET output_file_id = ?, error_file_id = ?, holder = NULL WHERE id = ?",
                       (kept["output"], kept["error"], batch_id))
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            self._move(current, target, now)
        for kind, size in sizes.items():
            if not size:
                self.file_path(ids[kind]).unlink(missing_ok=True)
        self.db.execute("PRAGMA incremental_vacuum")  # the lines' pages back to the disk
        return self.get_batch(None, batch_id)

    def _write_results(self, batch_id: str, file_id: str, *, ok: bool) -> int:
        cursor = self.db.execute("SELECT result FROM lines WHERE batch_id = ? AND state = 2 AND ok = ?"
                                 " ORDER BY idx", (batch_id, int(ok)))
        return _write_atomically(self.file_path(file_id), (row[0] + b"\n" for row in cursor))

    def _holds(self, batch_id: str, holder: str) -> bool:
        row = self.db.execute("SELECT holder FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row is not None and row[0] == holder

    def _move(self, rec: BatchRecord, to: Status, now: int) -> None:
        moved = rec.moved(to, now)
        self.db.execute("UPDATE batches SET status = ?, stamps = ? WHERE id = ? AND status = ?",
                        (to.value, json.dumps(moved.stamps), rec.id, rec.status.value))

    # --- for tests and operators -----------------------------------------------------------

    def line_owners(self, batch_id: str) -> dict[str, int]:
        rows = self.db.execute("SELECT done_by, COUNT(*) FROM lines WHERE batch_id = ? AND state = 2"
                               " GROUP BY done_by", (batch_id,)).fetchall()
        return {str(who): n for who, n in rows}


def _write_atomically(path: Path, chunks: Any) -> int:
    tmp = path.with_name(path.name + ".tmp")
    size = 0
    with tmp.open("wb") as f:
        for chunk in chunks:
            f.write(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return size


def _batch_row(rec: BatchRecord) -> tuple[Any, ...]:
    return (rec.id, rec.owner, rec.endpoint, rec.input_file_id, rec.completion_window, rec.status.value,
            rec.created_at, rec.expires_at, json.dumps(rec.metadata) if rec.metadata is not None else None,
            rec.output_file_id, rec.error_file_id, json.dumps(rec.errors) if rec.errors else None,
            rec.total, rec.completed, rec.failed, json.dumps(rec.stamps))


def _batch(row: Sequence[Any]) -> BatchRecord:
    (id_, owner, endpoint, input_file_id, window, status, created_at, expires_at, metadata, output_file_id,
     error_file_id, errors, total, completed, failed, stamps) = row
    return BatchRecord(id_, owner, endpoint, input_file_id, window, Status(status), created_at, expires_at,
                       json.loads(metadata) if metadata else None, output_file_id, error_file_id,
                       json.loads(errors) if errors else None, total, completed, failed, json.loads(stamps))


P = ParamSpec("P")
T = TypeVar("T")


class AsyncStore:
    """``Store``'s methods, awaited: each runs on the store's one thread."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-batch-db")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def close(self) -> None:
        await self.run(self.store.close)
        self._thread.shutdown(wait=True)


__all__ = ["AsyncStore", "Claimed", "NewLine", "Result", "Store", "StoreUnavailable", "new_id", "PENDING", "CLAIMED",
           "DONE", "SCHEMA_VERSION"]
