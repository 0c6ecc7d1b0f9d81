"""A Kubernetes API server for tests, over real HTTP, built on kmock.

kubectl, helm, the `kubernetes` client and kopf talk to it through the kubeconfig it writes.
It runs as a subprocess:

    python -m tests.kubeapi --port 0 --kubeconfig PATH [--crd FILE ...] [--history N]

and prints its URL (`http://127.0.0.1:PORT`) as the first stdout line. From pytest, use
`harness.running_apiserver(tmp_path, crds=[...])` and `harness.kubectl(server, ...)`.

Modules: `server` (kmock handler: parsing, routing, content negotiation), `store` (objects,
resourceVersions, generation, finalizers, garbage collection, watch history), `watch` (streams),
`schema` (CRD pruning and validation), `metadata` (name/label/annotation checks), `patch`
(merge, JSON and strategic-merge patches), `selectors`, `table` (`kubectl get` columns),
`discovery`, `resources` (built-in kinds, CRD -> served types), `protobuf` (what kubectl's
generators post), `openapi` (`/openapi/v2` from the CRDs' schemas, JSON or protobuf), `faults`
(the `/_test/` admin API), `errors` (Status objects), `harness`.

Not simulated: controllers (Deployments, Jobs and JobSets never get pods or status unless a test
writes it), admission webhooks, RBAC (every token is accepted), CEL `x-kubernetes-validations`,
CRD defaults and version conversion, field managers (server-side apply is a merge patch),
`dryRun`, pagination (`limit` returns everything), `/scale`, `/log`, `/openapi/v3` and the
built-in kinds' OpenAPI schemas (clients skip validating them), and namespace termination
(deleting a namespace deletes its objects at once).
"""
