"""The tests of the Kubernetes stand-in (``testbed/kube/``, which says what it emulates).

Files:

``test_apiserver.py`` ``test_kubelet.py`` ``test_kubectl.py`` ``test_kopf_e2e.py``   the tests
``sample_operator.py`` + ``sample_crd.yaml``   a small kopf operator for the end-to-end tests
``conftest.py``    the ``kube_cluster`` / ``kube_apiserver`` fixtures
"""
