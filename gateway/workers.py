"""``--workers N``: N gateway processes sharing one port (SO_REUSEPORT), like uvicorn's workers.

One Python process uses one core; the kernel spreads new client connections over the workers.
Each worker is a whole gateway with its own router (its own in-flight counts, prefix index and
scrapes) and its own flow-control limits, so ``max_inflight``/``max_queue`` hold per worker.
This supervisor only starts, watches and stops them: control plane, so it may block.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

WORKER_ENV = "KVFLOW_GATEWAY_WORKER"


def is_worker() -> bool:
    return WORKER_ENV in os.environ


def supervise(argv: Sequence[str], workers: int, grace: float) -> int:
    """Run ``kvflow gateway ARGV`` ``workers`` times; when one exits, stop the rest. A stopped
    worker drains for up to ``grace`` seconds (``--shutdown-grace``): it is killed only after."""
    children = [
        subprocess.Popen([sys.executable, "-m", "kvflow", "gateway", *argv], env={**os.environ, WORKER_ENV: str(i)})
        for i in range(workers)
    ]
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while all(child.poll() is None for child in children):
        time.sleep(0.2)
    for child in children:
        if child.poll() is not None and not stopping:
            code = code or child.returncode or 1  # a worker died on its own: take the others down too
    stop(signal.SIGTERM, None)
    for child in children:
        try:
            child.wait(timeout=grace + 5)  # its own drain ends first
        except subprocess.TimeoutExpired:
            child.kill()
    return 0 if stopping else code
