"""The routing benchmark's harness: workloads, an open-loop load generator, simulated pods,
the routers under test (kvflow and its peers), a discrete-event oracle, and the report.

``bench/bench_routing.py`` (``kvflow bench routing``) drives it; ``docs/router.md`` explains
the workloads, the oracle and the plots. Pure parts (workloads, oracle, report) take no I/O;
``loadgen``, ``pods`` and ``routers`` talk to processes.
"""
