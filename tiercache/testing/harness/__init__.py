"""Test support that the repository's tests and benchmarks share, imported by name from anywhere.

Processes started and stopped by PID (``processes``: ports, launchers, the node server, loading a script as
a module), the moto S3 server (``s3``), redis-server and Mooncake (``backends``), the fault-injecting TCP
proxy (``fault_proxy``), the GPU move cases (``moves``) and the long-running harnesses the benchmarks run and
the tests run briefly (``fuzz``, ``soak``, ``restore_stress``, ``fault_matrix``).

It lives in the installed package beside the conformance kit, not under ``tests/`` or ``benchmarks/``, so
that both import it as ``tiercache.testing.harness.*`` (from any directory, with no path set up) and a
third-party adapter package can start the same servers. Importing this package imports nothing else: each
module loads its own dependencies (torch, pytest, boto3) and starts nothing until called.
"""
