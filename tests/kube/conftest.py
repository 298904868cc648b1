"""The emulator's fixtures for the tests in this folder (see ``fixtures.py``)."""

from testbed.kube.fixtures import kube_apiserver, kube_cluster

__all__ = ["kube_apiserver", "kube_cluster"]
