"""Apache Beam RunInference through kvflow: a DirectRunner pipeline against a running gateway, and
the model-manager variant that starts, restarts and stops its own local stack."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

beam = pytest.importorskip("apache_beam", reason="apache-beam is not installed (pip install 'kvflow[beam]')")

from apache_beam.ml.inference.base import PredictionResult, RunInference  # noqa: E402
from apache_beam.testing.util import assert_that  # noqa: E402

from kvflow.beam import KvflowChatModelHandler, KvflowCompletionsModelHandler, StackOptions  # noqa: E402
from kvflow.beam.stack import LocalStack, stop_local_stacks  # noqa: E402
from kvflow.local.procs import ProcessGroup, free_port, kvflow_argv  # noqa: E402
from tests.conftest import SimPodFactory  # noqa: E402

MODEL = "sim-model"


def collect(results: list[PredictionResult]) -> None:
    """assert_that's matcher: every element answered, in OpenAI's response objects."""
    assert len(results) == 12
    for r in results:
        assert r.model_id == MODEL and r.inference.model == MODEL
        assert r.inference.usage.completion_tokens == 5


def test_a_directrunner_pipeline_runs_inference_through_the_gateway(sim_pods: SimPodFactory,
                                                                     tmp_path: Path) -> None:
    pods = sim_pods(2, "--model", MODEL, "--profile", "fast")
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", MODEL,
                                           *[a for p in pods for a in ("--endpoint", p.id)]),
                    ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        handler = KvflowCompletionsModelHandler(base_url=f"http://127.0.0.1:{port}", max_batch_size=4)
        with beam.Pipeline("DirectRunner") as p:
            results = (p | beam.Create([f"prompt number {i}" for i in range(12)])
                       | RunInference(handler, inference_args={"max_tokens": 5}))
            assert_that(results, collect)
            texts = results | beam.Map(lambda r: (r.example, r.inference.choices[0].text))
            assert_that(texts | beam.combiners.Count.Globally(), lambda n: n == [12] or pytest.fail(str(n)))


def test_the_chat_handler_takes_beams_message_objects_and_mappings(sim_pods: SimPodFactory, tmp_path: Path) -> None:
    from apache_beam.ml.inference.vllm_inference import OpenAIChatMessage

    (pod,) = sim_pods(1, "--model", MODEL, "--profile", "fast")
    port = free_port()
    conversations = [[OpenAIChatMessage("user", f"hello {i}")] for i in range(3)]
    conversations.append([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])  # type: ignore[list-item]
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", MODEL, "--endpoint", pod.id),
                    ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        # OpenAI's spelling of the base URL (the SDK's, docs/batch.md's); the model: the gateway's first
        handler = KvflowChatModelHandler(base_url=f"http://127.0.0.1:{port}/v1/")
        with beam.Pipeline("DirectRunner") as p:
            results = p | beam.Create(conversations) | RunInference(handler, inference_args={"max_tokens": 3})
            assert_that(results | beam.Map(lambda r: (r.inference.object, r.inference.usage.completion_tokens)),
                        lambda got: got == [("chat.completion", 3)] * 4 or pytest.fail(str(got)))


def test_without_base_url_each_worker_starts_a_local_stack_and_it_is_stopped(tmp_path: Path) -> None:
    options = StackOptions(sim_profile="fast", log_dir=str(tmp_path / "stack"))
    handler = KvflowCompletionsModelHandler(stack=options)
    try:
        with beam.Pipeline("DirectRunner") as p:
            results = (p | beam.Create([f"prompt number {i}" for i in range(12)])
                       | RunInference(handler, inference_args={"max_tokens": 5}))
            assert_that(results, collect)
        logs = sorted(path.name for path in (tmp_path / "stack").glob("*.log"))
        assert logs == ["decode-0.log", "gateway.log"]
    finally:
        stop_local_stacks()
    assert [pid for pid in started_pids(tmp_path / "stack") if alive(pid)] == []


def test_a_stuck_local_stack_is_restarted(tmp_path: Path) -> None:
    stack = LocalStack(StackOptions(sim_profile="fast", probe_timeout=3, log_dir=str(tmp_path / "stack")))
    try:
        handler = KvflowCompletionsModelHandler(stack=stack.options, timeout=2)
        assert not stack.recover()  # healthy: left alone
        first_url = stack.base_url
        stuck = stack.pids
        for pid in stuck:
            os.kill(pid, signal.SIGSTOP)  # every process hangs: nothing answers, nothing exits
        started = time.monotonic()
        [result] = handler.run_inference(["hello"], stack, {"max_tokens": 2})
        assert result.inference.usage.completion_tokens == 2
        assert stack.restarts == 1 and stack.base_url != first_url
        assert time.monotonic() - started < 60
        for pid in stuck:
            assert not alive(pid)
    finally:
        stack.stop()


def started_pids(log_dir: Path) -> list[int]:
    """Processes whose command line mentions the stack's log directory (the gateway's --router-config)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(log_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(("given", "root"), [
    ("http://gw:8080", "http://gw:8080"), ("http://gw:8080/", "http://gw:8080"),
    ("http://gw:8080/v1", "http://gw:8080"), ("http://gw:8080/v1/", "http://gw:8080"),
    ("https://gw.example.com/kvflow/v1", "https://gw.example.com/kvflow"),
], ids=["root", "root-slash", "v1", "v1-slash", "under-a-path"])
def test_the_handler_takes_the_gateway_root_or_openais_v1_base_url(given: str, root: str) -> None:
    from kvflow.beam.handlers import gateway_root

    assert gateway_root(given) == root
