"""The NIXL benchmark's baselines measure real copies, and the benchmark runs end to end.

``bench/bench_nixl.py`` compares NIXL READs with a raw ``process_vm_readv`` of the same blocks
(the kernel copy under UCX's CMA transport) and with a same-process memcpy; a baseline that
copied the wrong bytes, or nothing, would make every ratio in docs/pd.md meaningless.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_nixl import cma_reader, pool_like  # bench/ is on pytest's pythonpath

from kvflow.sim.nixl.layout import KVLayout

BENCH = Path(__file__).parents[2] / "bench"


def test_the_cma_baseline_copies_the_same_run_of_blocks_in_every_region() -> None:
    layout = KVLayout(num_blocks=8)
    source, target = pool_like(layout), pool_like(layout)
    source[:] = np.arange(source.size, dtype=np.uint64).reshape(source.shape)
    bases = [int(source[r].ctypes.data) for r in range(layout.num_regions)]

    cma_reader(os.getpid(), target, bases, layout, 2, 3)()

    assert np.array_equal(target[:, 2:5], source[:, 2:5])
    assert not target[:, :2].any() and not target[:, 5:].any()  # nothing outside the run


def test_the_cma_baseline_fails_loudly_on_an_unreadable_address() -> None:
    layout = KVLayout(num_blocks=2)
    target = pool_like(layout)
    read = cma_reader(os.getpid(), target, [8] * layout.num_regions, layout, 0, 1)  # page zero: unmapped
    with pytest.raises(OSError, match="process_vm_readv moved"):
        read()


def test_the_benchmark_prints_a_row_per_block_count() -> None:
    pytest.importorskip("nixl")
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_nixl.py"), "--shapes", "tiny", "--repeat", "1", "--stat", "min"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[3].strip() for row in rows] == ["1", "8", "32", "128", "2048"]
    assert "caches data-cold" in out
