"""pallasopt's benchmark scripts (run from the repository root; not installed).

* ``python -m bench`` -- quick sweep; ``python -m bench.kernels`` -- full sweep;
* ``python -m bench.plot`` -- PNG from the JSONL results.

`bench.harness` documents the case interface each
``bench/cases_<family>.py`` implements and runs the cases; `bench.timing`
measures one configuration and the ceilings; `bench.records` keeps the
records, their provenance and the table; `bench.workloads` the shared
parameter trees and their random data.
"""
