"""What the tests (``tests/``) and the benchmarks (``bench/``) both stand on.

Neither imports the other through this package: ``bench/`` never imports ``tests/``, and
``tests/`` imports ``bench`` only in ``tests/bench/``. Not shipped in the wheel (pyproject
packages only ``gradientmail*``); imported from a checkout.

Files:

``s3servers.py``   real S3 servers on loopback (SeaweedFS, moto): context managers, and
                   ``python -m testbed.s3servers -- CMD`` (what ``scripts/test.sh`` runs)
``s3env.py``       which S3 servers the tests use, from ``GRADIENTMAIL_S3_ENDPOINT``
``stub_s3.py``     a scripted misbehaving S3 on loopback, for fault injection
``processes.py``   child processes in their own process groups, stopped group and all
``loop_thread.py`` an asyncio service on a daemon thread of its own
``kube/``          the Kubernetes stand-in: emulated API server, local kubelet, kubectl and
                   helm binaries, pytest fixtures; ``python -m testbed.kube``
``rbac.py``        the operator's calls as RBAC requests, and an RBAC evaluator
``audit.py``       an API server stand-in that records who asked for what
"""
