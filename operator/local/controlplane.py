"""The operator on this machine: its own Manager (controller/manager.py) over the in-memory API
(memory_api.py), with the JobSet stand-in (jobset.py) and the process kubelet (kubelet.py) doing what JobSet,
the Job controller, the scheduler and the kubelet do on a cluster.

- `feed` is kopf's part (controller/handlers.py): the in-memory API's watches fill the Manager's indices
  (jobs; the JobSets labelled as a job's; its pre-flight batch Jobs) and put the job's key in its work queue
  on every change, as the operator's event handlers do (a JobSet that loses its job label leaves as DELETED,
  as from a label-selected watch); ConfigMap events go to the Manager, which queues a hand-edited one's job.
- `MemoryHost` is the kubelet's API (kubelet.PodHost) over the in-memory API, called from the kubelet's
  threads and run on the event loop that owns the API.
- `ControlPlane` starts them all, with the operator's config and its Event poster, and stops them all: the
  Manager's workers, the stand-in, and every process (SIGTERM, SIGKILL after a grace period). Its control key
  (controller/control.py) is a fresh one per run, held in memory only: nothing outlives the run that would need
  the same tokens again.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from ..api import names
from ..controller import control, preflight
from ..controller.events import EventPoster
from ..controller.kube import BATCH_JOBS, CONFIGMAPS, JOBS, JOBSETS, PODS, SECRETS, ApiError, Obj
from ..controller.manager import Manager
from ..controller.metrics_reader import MetricsReader
from ..controller.reconcile import OperatorConfig
from ..controller.stats import Stats
from .jobset import JobSetStandIn
from .kubelet import Kubelet
from .memory_api import MemoryApi
from .pods import free_port

NODE = "this-machine"  # the one node every pod is bound to
Key = tuple[str, str]


def _key(obj: Obj) -> Key:
    return obj["metadata"]["namespace"], obj["metadata"]["name"]


def feed(api: MemoryApi, manager: Manager) -> tuple[dict[Key, list[Obj]], dict[Key, list[Obj]], dict[Key, list[Obj]]]:
    """Watch the in-memory API for the Manager as kopf's handlers do; the jobs, JobSets and pre-flight indices."""
    jobs: dict[Key, list[Obj]] = {}
    jobsets: dict[Key, list[Obj]] = {}
    preflights: dict[Key, list[Obj]] = {}

    def index(store: dict[Key, list[Obj]], key: Key, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            store.pop(key, None)
        else:
            store[key] = [obj]

    def job_seen(kind: str, job: Obj) -> None:
        index(jobs, _key(job), kind, job)
        manager.add(_key(job), "job")

    def jobset_seen(kind: str, jobset: Obj) -> None:
        labelled = names.LABEL_JOB in (jobset["metadata"].get("labels") or {})
        if labelled or _key(jobset) in jobsets:  # one that loses the label leaves the selector: DELETED, as kopf's
            kind = kind if labelled else "DELETED"
            index(jobsets, _key(jobset), kind, jobset)
            manager.jobset_seen(jobset, deleted=kind == "DELETED")

    def config_map_seen(kind: str, config_map: Obj) -> None:
        if names.LABEL_JOB in (config_map["metadata"].get("labels") or {}) or kind == "MODIFIED":
            manager.config_map_seen(config_map, deleted=kind == "DELETED")

    planned: dict[Key, dict[str, Obj]] = {}  # a job may have several pre-flight Jobs (one per generation)

    def preflight_seen(kind: str, job: Obj) -> None:
        key = preflight.job_key(job)  # ours only: the job's label and the pre-flight role
        if key is None:
            return
        mine = planned.setdefault(key, {})
        if kind == "DELETED":
            mine.pop(job["metadata"]["name"], None)
        else:
            mine[job["metadata"]["name"]] = preflight.trim(job)
        preflights[key] = list(mine.values())
        manager.preflight_seen(job)

    api.watch(JOBS, job_seen)
    api.watch(JOBSETS, jobset_seen)
    api.watch(BATCH_JOBS, preflight_seen)
    api.watch(CONFIGMAPS, config_map_seen)
    return jobs, jobsets, preflights


class MemoryHost:
    """kubelet.PodHost over the in-memory API: each call runs on `loop`, the API's, and is waited for."""

    def __init__(self, api: MemoryApi, loop: asyncio.AbstractEventLoop):
        self.api, self.loop = api, loop

    def _call(self, call: Coroutine[Any, Any, Any]) -> Any:
        if self.loop.is_closed():
            call.close()
            return None
        try:
            return asyncio.run_coroutine_threadsafe(call, self.loop).result()
        except RuntimeError:  # the loop stopped while the call waited: the run is over
            return None

    def report(self, pod: Obj, status: Obj) -> None:
        try:
            self._call(self.api.patch(PODS, *_key(pod), {"status": status}, "status"))
        except ApiError as exc:
            if exc.status != 404:
                raise

    def remove(self, pod: Obj) -> None:
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": pod["metadata"]["uid"]}}
        try:
            self._call(self.api.delete(PODS, *_key(pod), body))
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    def volumes(self, pod: Obj) -> dict[str, dict[str, str]]:
        namespace, found = pod["metadata"]["namespace"], {}
        for volume in pod["spec"].get("volumes") or []:
            try:
                if "configMap" in volume:
                    name = volume["configMap"]["name"]
                    found[name] = dict(self._call(self.api.get(CONFIGMAPS, namespace, name)).get("data") or {})
                elif "secret" in volume:  # as a kubelet does (the operator's own pods mount none since the control key)
                    name = volume["secret"]["secretName"]
                    data = self._call(self.api.get(SECRETS, namespace, name)).get("data") or {}
                    found[name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
            except ApiError as exc:
                if exc.status != 404:  # a missing optional Secret stays an empty directory (pods.py)
                    raise
        return found


class ControlPlane:
    """The operator, the JobSet stand-in and the process kubelet over one in-memory API (the module's
    docstring). Pod logs are appended to `logs/<hostname>.log` and their files live under `pods/`, both in
    `run_dir`; each pod's metrics port is a free port here, which the API's pod proxy reaches."""

    def __init__(self, api: MemoryApi, config: OperatorConfig, run_dir: Path, workers: int = 2):
        self.api, self.config, self.run_dir = (
            api,
            config,
            run_dir.resolve(),
        )  # the processes run in their pod directories
        self.events = EventPoster(api)
        tokens = control.Tokens(secrets.token_bytes(control.KEY_BYTES))
        self.manager = Manager(
            api,
            MetricsReader(api, config.metrics_access, config.metrics_timeout_s, tokens),
            config,
            self.events,
            Stats(),
            workers=workers,
        )
        self.kubelet: Kubelet | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.kubelet = kubelet = Kubelet(
            MemoryHost(self.api, loop),
            self.run_dir / "pods",
            log_path=lambda pod: (
                self.run_dir / "logs" / f"{pod['spec'].get('hostname') or pod['metadata']['name']}.log"
            ),
            prepare=self._local_ports,
        )
        self.api.watch(PODS, lambda kind, pod: kubelet.sync(kind, pod) if pod["spec"].get("nodeName") == NODE else None)
        standin = JobSetStandIn(self.api, NODE)
        jobs, jobsets, preflights = feed(self.api, self.manager)
        self.manager.start(jobs, jobsets, {}, preflights, {})
        self.tasks = [asyncio.create_task(standin.run(), name="jobset-stand-in")]

    def _local_ports(self, pod: Obj, env: dict[str, str]) -> None:
        """Every pod's metrics port as a free port of this machine (all pods share it), reached through the API's
        pod proxy under the port the pod declares."""
        declared = env.get("TPUJOB_METRICS_PORT")
        if declared and declared.isdigit():
            local = free_port()
            env["TPUJOB_METRICS_PORT"] = str(local)
            self.api.serve(pod["metadata"]["namespace"], pod["metadata"]["name"], int(declared), local)

    async def stop(self) -> None:
        """Stop the operator and the stand-in; the processes are the caller's to stop (`shutdown`)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.manager.stop()
        await self.events.drain()

    def shutdown(self, grace_s: float) -> None:
        """Stop every process (SIGTERM, SIGKILL after `grace_s`), from any thread, the loop's stopped or not."""
        if self.kubelet is not None:
            self.kubelet.shutdown(grace_s)
