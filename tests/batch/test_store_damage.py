"""A batch store that cannot be used, or that an earlier kvflow wrote: the Batch API says so with a
503 and everything else the gateway serves keeps working; nothing is recreated over history.
A gateway in this process (real router) in front of a simulated pod (a real process on 127.0.0.x)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sqlite3
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvflow.gateway.auth import Authenticator, owner_of, parse_keys
from kvflow.gateway.batch.states import FileRecord
from kvflow.gateway.batch.store import DB_NAME, SCHEMA_VERSION, Store, StoreUnavailable
from tests.batch.test_api import MODEL, finished, gateway, request
from tests.conftest import SimPodFactory


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only, for root too (chmod does not stop root; the immutable attribute does)."""
    path.chmod(0o555)
    immutable = False
    try:
        if os.geteuid() == 0:
            if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
                pytest.skip("running as root where chattr +i is not allowed: cannot make a directory read-only")
            immutable = True
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


def old_store(root: Path) -> None:
    """A store as a gateway wrote it before owners were stable (schema version 0) with one file."""
    store = Store(root)
    store.add_file(FileRecord("file-old", "key-0", "in.jsonl", "batch", 4, 1), b"{}\n")
    store.close()
    db = sqlite3.connect(root / DB_NAME)
    db.execute("PRAGMA user_version = 0")
    db.commit()
    db.close()


def with_a_file(root: Path) -> None:
    store = Store(root)
    store.add_file(FileRecord("file-1", "anonymous", "in.jsonl", "batch", 4, 1), b"{}\n")
    store.close()  # checkpointed: the database file holds everything


def damage_truncated(root: Path) -> None:
    with_a_file(root)
    data = (root / DB_NAME).read_bytes()
    (root / DB_NAME).write_bytes(data[: len(data) // 3])
    for suffix in ("-wal", "-shm"):
        (root / (DB_NAME + suffix)).unlink(missing_ok=True)


def damage_overwritten(root: Path) -> None:
    with_a_file(root)
    for suffix in ("", "-wal", "-shm"):
        (root / (DB_NAME + suffix)).unlink(missing_ok=True)
    (root / DB_NAME).write_bytes(b"this is not a database\n" * 1000)


def damage_emptied(root: Path) -> None:
    with_a_file(root)
    for suffix in ("-wal", "-shm"):
        (root / (DB_NAME + suffix)).unlink(missing_ok=True)
    (root / DB_NAME).write_bytes(b"")


@pytest.mark.parametrize(("damage", "message"), [
    (damage_truncated, "damaged|malformed|not a database"),
    (damage_overwritten, "not a database"),
    (damage_emptied, r"empty \(0 bytes\) but .* holds files"),
], ids=["truncated", "overwritten", "emptied"])
def test_a_damaged_store_is_refused_naming_the_problem(tmp_path: Path, damage: Callable[[Path], None],
                                                       message: str) -> None:
    damage(tmp_path)
    before = (tmp_path / DB_NAME).read_bytes()
    with pytest.raises(StoreUnavailable, match=message) as info:
        Store(tmp_path)
    assert info.value.status == 503
    assert (tmp_path / DB_NAME).read_bytes() == before  # nothing written over what is left


def test_an_empty_database_with_no_files_is_a_new_store(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_bytes(b"")
    Store(tmp_path).add_file(FileRecord("file-1", "anonymous", "in.jsonl", "batch", 4, 1), b"{}\n")
    assert Store(tmp_path).get_file("anonymous", "file-1").bytes == 4


def test_a_store_from_a_newer_kvflow_is_refused(tmp_path: Path) -> None:
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreUnavailable, match="newer than"):
        Store(tmp_path)


def test_opening_an_old_store_moves_positional_owners_to_the_keys_stable_owners(tmp_path: Path) -> None:
    old_store(tmp_path)
    auth = Authenticator(parse_keys("sk-alice\nsk-bob\n"))
    store = Store(tmp_path, auth.renamed_owners())
    assert store.get_file(owner_of("sk-alice"), "file-old").id == "file-old"
    with pytest.raises(Exception, match="No such File"):
        store.get_file("key-0", "file-old")
    # migrated once: a later open with another key file renames nothing
    assert Store(tmp_path, {"key-0": "someone-else"}).get_file(owner_of("sk-alice"), "file-old")


def test_unnamed_keys_own_by_a_digest_and_named_keys_by_their_name() -> None:
    keys = parse_keys("keys:\n  - {key: sk-a, name: team-a}\n  - {key: sk-b}\n")
    owners = {k.name: k.owner for k in keys.values()}
    assert owners == {"team-a": "team-a", "key-1": owner_of("sk-b")}
    assert "sk-b" not in owner_of("sk-b") and owner_of("sk-b") == owner_of("sk-b") != owner_of("sk-c")


def get(url: str, **headers: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def damage_unwritable(root: Path) -> None:
    Store(root).close()


@pytest.mark.parametrize(("damage", "message"), [
    (damage_truncated, "damaged|malformed|not a database"),
    (damage_emptied, "empty"),
    (damage_unwritable, "readonly|read-only|unable to open|cannot be"),
], ids=["truncated", "emptied", "read-only"])
async def test_a_gateway_over_a_damaged_store_serves_all_but_the_batch_api(sim_pods: SimPodFactory, tmp_path: Path,
                                                                          damage: Callable[[Path], None],
                                                                          message: str) -> None:
    root = tmp_path / "batches"
    root.mkdir()
    damage(root)
    guard = read_only(root) if damage is damage_unwritable else contextlib.nullcontext()
    with guard:
        running = await gateway(sim_pods(1, "--model", MODEL, "--profile", "instant"), tmp_path)
        base = f"http://127.0.0.1:{running.port}"
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        try:
            health, _ = await asyncio.to_thread(get, base + "/health")
            answer = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            status, body = await asyncio.to_thread(get, base + "/v1/files")
            again, _ = await asyncio.to_thread(get, base + "/v1/batches")
        finally:
            await running.close()
    assert health == 200 and answer.usage is not None and answer.usage.completion_tokens == 2
    assert status == again == 503, body
    assert body["error"]["type"] == "ServiceUnavailableError" and body["error"]["code"] == 503
    assert "the Batch API is unavailable" in body["error"]["message"]
    assert re.search(message, body["error"]["message"]), body


async def test_uploads_are_bounded_in_lines_and_in_what_a_key_stores(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    running = await gateway(sim_pods(1, "--model", MODEL, "--profile", "instant"), tmp_path,
                            batch={"max_file_lines": 3, "owner_quota_bytes": 500})
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError, match="more than 3 lines"):
            await client.files.create(file=("in.jsonl", "\n".join(request(f"r{i}") for i in range(4)).encode()),
                                      purpose="batch")
        first = await client.files.create(file=("in.jsonl", "\n".join(request(f"r{i}") for i in range(3)).encode()),
                                          purpose="batch")
        with pytest.raises(openai.BadRequestError, match="quota of 500"):
            await client.files.create(file=("in.jsonl", "\n".join(request(f"r{i}") for i in range(3)).encode()),
                                      purpose="batch")
        await client.files.delete(first.id)
        assert (await client.files.create(file=("in.jsonl", request("r").encode()), purpose="batch")).bytes > 0
    finally:
        await running.close()


async def test_a_large_result_file_streams_back_whole(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    running = await gateway(sim_pods(1, "--model", MODEL, "--profile", "instant"), tmp_path,
                            max_body_bytes=16 * 1024 * 1024)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="k", max_retries=0)
    try:
        data = "\n".join(request(f"r{i}", "x" * 3000, max_tokens=1) for i in range(1500)).encode()  # ~4.6 MB
        upload = await client.files.create(file=("in.jsonl", data), purpose="batch")
        content = (await client.files.content(upload.id)).content
        batch = await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")).id, timeout=120)
        output = (await client.files.content(batch.output_file_id)).text.splitlines()  # type: ignore[arg-type]
    finally:
        await running.close()
    assert content == data and len(content) > 4 * 1024 * 1024
    assert [json.loads(x)["custom_id"] for x in output] == [f"r{i}" for i in range(1500)]
