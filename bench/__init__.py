"""pallasopt's benchmark scripts (run from the repository root; not installed).

* ``python -m bench`` -- quick sweep; ``python -m bench.kernels`` -- full sweep;
* ``python -m bench.plot`` -- PNG from the JSONL results.

`bench.harness` holds the measuring machinery and documents the case
interface each ``bench/cases_<family>.py`` implements; `bench.workloads` the
shared parameter trees.
"""
