"""The nemesis (issue 18): kill -9, races, hostile input, hostile identifiers
and file faults against real `cdc apply` runs, each trial compared with the
state one clean run leaves.  ``python -m tests.nemesis --help`` runs it long;
``tests/test_nemesis.py`` runs a small sample of every kind in CI.

Modules: ``workload`` (the seeded archive), ``state`` (what a run leaves,
read with pyiceberg), ``runner`` (CLI subprocesses, kill points, state
folders), ``kills``, ``races``, ``hostile``, ``identifiers``, ``faults``
(one kind each), ``__main__`` (the long-run command)."""
