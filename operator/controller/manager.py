"""The manager: what sets reconciles going, and the workers that run them.

- kopf's watches feed in-memory indices (jobs, the JobSets labelled as a job's, and the Kueue
  Workloads owned by JobSets): a reconcile reads the job, its JobSet and its Workload from them,
  never from the API, so a queued job costs no request to follow. kopf runs no handler until they
  are filled from their initial listing, so a restarted operator knows every existing JobSet before
  it looks at the first job, and re-creates nothing. Without Kueue installed there is no Workload
  resource to watch, and kopf does not wait for one.
- Job, JobSet and Workload events add the job's key to the work queue (queue.py): the one place where
  anything is retried, with backoff. A key is reconciled by one worker at a time. A request the API
  refuses for good (`ApiError.permanent`: 400, 403, 422, 404 on a create) is not retried: it is shown on
  the job (Reconciled=False with the API's words, one Warning Event) and the job is held until its
  generation changes or `refused_retry_s` (10 minutes) passes.
- A JobSet that leaves the JobSet watch (its job label edited: the watch says DELETED) is GET once by its
  name; a ConfigMap event queues its job only when the ConfigMap the JobSet mounts lost labels the operator
  rendered, or was deleted (drift.py). Neither is cached.
- A JobSet event or a resync may list the JobSet's pods once, if some are not ready, to say why
  (diagnosis.py); nothing else lists pods, except the metrics reader finding pod 0 once.
- A ticker adds unfinished jobs with a JobSet every `resync_interval_s`, reconciled from the caches,
  and every `REREAD_EVERY`th time as a `reread`: the reconcile then GETs the JobSet once, to catch up
  on an event that was lost (client-go's informers resync from their cache alone; one GET per job per
  resync was the largest request cost of a quiet job), and reads the trainer of every Running job every
  `metrics_interval_s`, outside the workers (a slow trainer never holds up a reconcile), one read per
  job at most: a read due while the job's last one is pending is skipped; the sample is applied, and
  written if something changed, by the next reconcile of that job.
- The status a reconcile wrote is kept until the watch delivers it (`written`), so the next reconcile
  computes from it and not from the version before, which would only conflict. Likewise a JobSet a
  reconcile created or adopted is kept until the watch delivers it (`made`): the job's own status
  write often comes back first, and its reconcile would otherwise POST the JobSet again (a 409 and a
  GET to adopt it).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any, TypeVar

from ..api import names, timestamps
from ..api.spec import RuntimeSpec
from ..api.status import TERMINAL_PHASES, TPUTrainingJobStatus
from . import drift, health, kueue, preflight, trimmed
from .children import config_map_of, owner_of
from .kube import JOBSETS, ApiError, Kube, Obj
from .metrics_reader import MetricsReader
from .queue import WorkQueue
from .reconcile import Emit, Means, OperatorConfig, Seen, reconcile, show_refusal
from .stats import Stats
from .status import Sample

log = logging.getLogger("tpu_operator")
Key = tuple[str, str]  # (namespace, job name)
_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")
Index = Mapping[_K, Collection[_V]]  # kopf.Index: key -> a store of the values indexed under it
# The reason a reconcile ran, for the operator's metrics: the first of these it was queued for.
TRIGGERS = ("job", "jobset", "configmap", "workload", "preflight", "node", "reread", "resync", "metrics", "retry")
REREAD_EVERY = 10  # resyncs of a job per GET of its JobSet
# Phases where time alone changes nothing: a job waits for its user (spec.suspend) or for Kueue (its Workload's
# events). Their resyncs are only the rereads; a reconcile of every such job every interval was, with 2,000 of
# them, the operator's largest CPU cost that grew with the jobs rather than with their events.
QUIET = ("Suspended", "Queued")
LOOK_AT_PODS = {"jobset", "reread", "resync"}  # the only triggers that may list a JobSet's pods
LOOK_AT_NODES = {"node", "jobset", "reread", "resync"}  # ... and, while a TPU node is unhealthy, a Running job's


def _first(store: Collection[Obj] | None) -> Obj | None:
    return next(iter(store), None) if store is not None else None


def _rv(obj: Obj | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


class Manager:
    def __init__(
        self,
        kube: Kube,
        reader: MetricsReader,
        config: OperatorConfig,
        emit: Emit,
        stats: Stats,
        *,
        workers: int = 16,
        concurrent_reads: int = 32,
        now: timestamps.Clock = timestamps.utc_now,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 0.2,
    ):
        self.kube, self.reader, self.config, self.emit, self.stats = kube, reader, config, emit, stats
        self.workers, self.now, self.clock, self.tick_s = workers, now, clock, tick_s
        self.queue: WorkQueue[Key] = WorkQueue(clock=clock)
        self.means = Means(kube, config, emit, reader, now)
        self.jobs: Index[Key, Obj] = {}
        self.jobsets: Index[Key, Obj] = {}
        self.workloads: Index[Key, Obj] = {}
        self.preflights: Index[Key, Obj] = {}
        self.nodes: Index[str, health.Unhealthy] = {}  # TPU node name -> why and since when (only unhealthy ones)
        self.node_counts: Index[str, None] = {}  # "tpu" / "not_ready" -> one entry per such TPU node (health.py)
        self.unhealthy_since: dict[str, datetime.datetime] = {}  # when this operator first saw a node unhealthy
        self.held = False  # so many TPU nodes are NotReady that Ready-based stops wait (health.holding)
        self.written: dict[Key, Obj] = {}
        self.superseded: dict[Key, set[str | None]] = {}  # resourceVersions older than `written`'s
        self.made: dict[Key, Obj] = {}  # JobSets created or adopted here that the watch has not delivered yet
        self.unlabelled: dict[Key, str] = {}  # JobSets that left the watch's selector (their job label was edited)
        self.config_map_edits: dict[Key, drift.ConfigMapEdit] = {}  # hand edits the ConfigMap watch saw (drift.py)
        self.samples: dict[Key, Sample] = {}
        self.due_resync: dict[Key, float] = {}
        self.resyncs: dict[Key, int] = {}  # resyncs left before the next reread (a GET of the JobSet)
        self.quiet: set[Key] = set()  # Suspended or Queued: only an event (or a reread) changes anything
        self.due_metrics: dict[Key, float] = {}
        self.refused: dict[Key, tuple[int | None, float]] = {}  # a permanent refusal: (generation, retry after)
        self.reads = asyncio.Semaphore(concurrent_reads)
        self.tasks: list[asyncio.Task[None]] = []
        self.reading: set[asyncio.Task[None]] = set()
        self.reading_jobs: set[Key] = set()  # the jobs whose trainer is being read: one read each at most
        self.rng = random.Random()

    # --- what sets reconciles going ---------------------------------------------------------------

    def start(
        self,
        jobs: Index[Key, Obj],
        jobsets: Index[Key, Obj],
        workloads: Index[Key, Obj],
        preflights: Index[Key, Obj] | None = None,
        nodes: Index[str, health.Unhealthy] | None = None,
        node_counts: Index[str, None] | None = None,
    ) -> None:
        self.jobs, self.jobsets, self.workloads = jobs, jobsets, workloads
        self.preflights = preflights if preflights is not None else {}
        self.nodes = nodes if nodes is not None else {}
        self.node_counts = node_counts if node_counts is not None else {}
        self.held = self._holding()
        self.tasks = [
            asyncio.create_task(self.queue.run_timers(), name="queue-timers"),
            asyncio.create_task(self._ticker(), name="ticker"),
            *(asyncio.create_task(self._worker(), name=f"worker-{i}") for i in range(self.workers)),
        ]

    async def stop(self) -> None:
        for task in (*self.tasks, *self.reading):
            task.cancel()
        await asyncio.gather(*self.tasks, *self.reading, return_exceptions=True)
        await self.reader.close()

    def add(self, key: Key, reason: str) -> None:
        self.queue.add(key, reason)

    def jobset_seen(self, jobset: Mapping[str, Any], deleted: bool = False) -> None:
        """A JobSet changed: reconcile the job that controls it. One deleted from the watch without its job label
        was not deleted: it left the watch's selector; the reconcile GETs it (the index no longer has it)."""
        owner = owner_of(jobset)
        if owner is None:
            return
        meta = jobset.get("metadata") or {}
        if deleted and names.LABEL_JOB not in (meta.get("labels") or {}):
            self.unlabelled[owner[:2]] = str(meta.get("name"))
        self.queue.add(owner[:2], "jobset")

    def config_map_seen(self, config_map: Mapping[str, Any], deleted: bool = False) -> None:
        """A ConfigMap labelled as a job's changed: reconcile the job only when the one its JobSet mounts was
        edited or deleted (drift.config_map_edit: O(1), no request, nothing of it kept but its name)."""
        found = drift.config_map_edit(config_map, deleted)
        if found is None:
            return
        key, edit = found
        jobset = self.jobset(key)
        if jobset is not None and config_map_of(jobset) == edit[0]:
            self.config_map_edits[key] = edit
            self.queue.add(key, "configmap")

    def preflight_seen(self, job: Mapping[str, Any]) -> None:
        """A pre-flight Job changed: reconcile the job it plans (preflight.py)."""
        key = preflight.job_key(job)
        if key is not None:
            self.queue.add(key, "preflight")

    def node_health(self, name: str, node: Mapping[str, Any]) -> health.Unhealthy | None:
        """The node index's value: why and since when the node is unhealthy (None: it is not), with when this
        operator first saw it so standing in for a Ready lastTransitionTime it cannot use (health.judge)."""
        found = health.judge(node, self.unhealthy_since.get(name) or self.now())
        if found is None:
            self.unhealthy_since.pop(name, None)
            return None
        self.unhealthy_since.setdefault(name, self.now())
        return found

    def node_seen(self, node: Mapping[str, Any], deleted: bool = False) -> None:
        """A TPU node changed: if GKE says it is unhealthy, or the hold starts or ends, every Running job looks at
        where its pods are (one pod list each; the jobs on healthy nodes change nothing). Which jobs run on a
        node is not cached: pods are never watched (rbac.py)."""
        if deleted:
            self.unhealthy_since.pop(str((node.get("metadata") or {}).get("name")), None)
        held, self.held = self.held, self._holding()
        if held != self.held:
            log.warning("TPU nodes NotReady together: %s", self.hold_message() or "the hold is over")
        if health.judge(node) is not None or held != self.held:
            for key in list(self.due_metrics):  # the Running jobs
                self.queue.add(key, "node")

    def node_totals(self) -> tuple[int, int]:
        """(TPU nodes, of them NotReady): counts kept by the node_counts index, never the nodes."""
        return len(self.node_counts.get("tpu") or ()), len(self.node_counts.get("not_ready") or ())

    def _holding(self) -> bool:
        held = health.holding(*self.node_totals())
        self.stats.node_hold(held, *self.node_totals())
        return held

    def hold_message(self) -> str | None:
        if not self.held:
            return None
        tpu, not_ready = self.node_totals()
        return (
            f"{not_ready} of {tpu} TPU nodes are NotReady together (a control-plane or network disruption, "
            f"not the hosts): stops on a node's Ready wait {health.HOLD_FACTOR} x nodeUnhealthyGraceSeconds"
        )

    def unhealthy(self) -> dict[str, health.Unhealthy]:
        return {name: found for name, store in self.nodes.items() for found in store}

    def workload_seen(self, workload: Mapping[str, Any]) -> None:
        """A Workload changed: reconcile the job whose JobSet owns it (if the JobSet is one of ours)."""
        name = kueue.jobset_owner(workload)
        jobset = _first(self.jobsets.get((workload["metadata"].get("namespace", "default"), name))) if name else None
        owner = owner_of(jobset) if jobset is not None else None
        if owner is not None:
            self.queue.add(owner[:2], "workload")

    # --- the caches ---------------------------------------------------------------------------------

    def job(self, key: Key) -> Obj | None:
        """The newest known state of the job: as watched, or as this operator last wrote it until the watch
        delivers it. resourceVersions are opaque (API conventions), so they are compared only for equality:
        the watched job is older while its version is one this operator's writes were computed from."""
        seen, mine = _first(self.jobs.get(key)), self.written.get(key)
        if mine is None or seen is None or _rv(seen) not in self.superseded.get(key, ()):
            self.written.pop(key, None)
            self.superseded.pop(key, None)
            return seen
        return mine

    def jobset(self, key: Key) -> Obj | None:
        """The job's JobSet as watched, or as this operator created it while the watch has yet to say."""
        seen = _first(self.jobsets.get((key[0], names.jobset_name(key[1]))))
        if seen is not None:
            self.made.pop(key, None)
            return seen
        return self.made.get(key)

    def workloads_of(self, key: Key) -> list[Obj]:
        """The Workloads seen under the job's JobSet name (the reconcile picks the one its JobSet owns)."""
        return list(self.workloads.get((key[0], names.jobset_name(key[1]))) or ())

    # --- the workers ----------------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            key, reasons = await self.queue.get()
            trigger = next((t for t in TRIGGERS if t in reasons), "job")
            started, result = self.clock(), "error"
            try:
                result = await self._reconcile(key, reasons)
            except ApiError as exc:
                result = await self._failed(key, exc)
            except Exception:  # a bug: log it, keep the operator up, try again later
                delay = self.queue.retry(key)
                log.exception("reconcile of %s/%s failed; retrying in %.1f s", *key, delay)
            else:
                self.queue.forget(key)
            finally:
                self.queue.done(key)
                self.stats.observe(trigger, result, self.clock() - started)

    async def _failed(self, key: Key, exc: ApiError) -> str:
        """A transient failure backs off (queue.py). A permanent one is shown on the job (Reconciled=False,
        one Event) and tried again only when the job's generation changes or after `refused_retry_s`."""
        if not exc.permanent:
            delay = self.queue.retry(key)
            log.warning("reconcile of %s/%s failed (%s); retrying in %.1f s", *key, exc, delay)
            return "api_error"
        self.queue.forget(key)
        job = self.job(key)
        log.warning(
            "reconcile of %s/%s refused (%s); not retried before the spec changes or %.0f s pass",
            *key,
            exc,
            self.config.refused_retry_s,
        )
        if job is None:
            return "refused"
        self.refused[key] = (job["metadata"].get("generation"), self.clock() + self.config.refused_retry_s)
        self.queue.add_after(key, self.config.refused_retry_s, "retry")
        try:
            written = await show_refusal(self.kube, job, exc, self.now(), self.emit)
        except ApiError as again:  # the status cannot be written either (e.g. no RBAC for it): the log says
            log.warning("could not write the refusal on %s/%s: %s", *key, again)
            return "refused"
        if written is not None and written is not job:
            self.superseded.setdefault(key, set()).add(_rv(job))
            self.written[key] = trimmed.job(written)
        return "refused"

    def _held(self, key: Key, job: Obj) -> bool:
        """The job's last reconcile was refused for good, and neither its spec nor the time says try again."""
        generation, until = self.refused.get(key, (None, 0.0))
        if key in self.refused and job["metadata"].get("generation") == generation and self.clock() < until:
            return True
        self.refused.pop(key, None)
        return False

    def _echo(self, key: Key) -> bool:
        """The watch delivers the status this operator wrote, and nothing else changed: its reconcile would
        compute from what the write was computed from (a JobSet, a sample or a node has a trigger of its
        own), so it is not run. The filter controller-runtime users write as a predicate, on every job."""
        mine, seen = self.written.get(key), _first(self.jobs.get(key))
        return mine is not None and seen is not None and _rv(seen) == _rv(mine)

    async def _reconcile(self, key: Key, reasons: set[str]) -> str:
        echo = reasons == {"job"} and self._echo(key)
        job = self.job(key)
        if job is None:
            self._drop(key)
            return "gone"
        if self._held(key, job):
            return "held"
        if echo and (job.get("status") or {}).get("phase") not in TERMINAL_PHASES:  # a finished one is `finished`
            return "echo"
        jobset, left = self.jobset(key), self.unlabelled.pop(key, None)
        if "reread" in reasons or (jobset is None and left):  # one GET: the JobSet as it is, whatever the watch says
            try:
                jobset = await self.kube.get(JOBSETS, key[0], names.jobset_name(key[1]))
            except ApiError as exc:
                if exc.status != 404:
                    raise
                jobset = None
        seen = Seen(
            jobset,
            self.samples.pop(key, None),
            self.workloads_of(key),
            list(self.preflights.get(key) or ()),
            look_at_pods=bool(reasons & LOOK_AT_PODS),
            probe=_first(self.jobsets.get((key[0], names.growback_name(key[1])))),
            unhealthy=self.unhealthy(),
            look_at_nodes=bool(reasons & LOOK_AT_NODES),
            hold=self.hold_message(),
            config_map=self.config_map_edits.get(key),
        )
        outcome = await reconcile(self.means, job, seen)
        if seen.config_map is not None and self.config_map_edits.get(key) == seen.config_map:
            del self.config_map_edits[key]  # handled (a failed reconcile keeps it for its retry)
        if outcome.job is not None:
            written = outcome.job
            if written is not job:  # a status write: the version it was computed from is older now
                self.superseded.setdefault(key, set()).add(_rv(job))
                written = trimmed.job(written)  # as the index keeps it
            self.written[key] = written
        if outcome.jobset is not None:
            self.made[key] = trimmed.jobset(outcome.jobset)  # as the index will keep it
        if outcome.requeue_after_s is not None:
            self.queue.add_after(key, outcome.requeue_after_s, "retry")
        if outcome.nodes_after_s is not None:  # a node's grace runs out then (health.py)
            self.queue.add_after(key, outcome.nodes_after_s, "node")
        self._schedule(key, outcome.job or self.job(key))
        return outcome.result

    # --- the periodic work -----------------------------------------------------------------------------

    def _schedule(self, key: Key, job: Obj | None) -> None:
        """Keep the job's resync and metrics reads on the ticker's calendar while they are due. First
        reads are spread over an interval, so jobs found together (a restart) are not read together."""
        status = TPUTrainingJobStatus.model_validate((job or {}).get("status") or {})
        gone = job is None or job["metadata"].get("deletionTimestamp")
        if not gone:
            self.stats.job(key, status)  # a finished job's last figures stay until it is deleted
        if gone or status.finished:
            self._drop(key, forget_stats=bool(gone))
            return
        if status.job_set_name and status.phase != "Invalid":
            self.due_resync.setdefault(key, self.clock() + self.config.resync_interval_s * self.rng.uniform(0.5, 1))
        if status.phase in QUIET:
            self.quiet.add(key)
        else:
            self.quiet.discard(key)
        if status.phase == "Running":
            self.due_metrics.setdefault(key, self.clock() + self.config.metrics_interval_s * self.rng.uniform(0.05, 1))
        elif self.due_metrics.pop(key, None) is not None:
            self.reader.forget(key[0], names.jobset_name(key[1]))  # not running: its pods will be new ones

    def _drop(self, key: Key, forget_stats: bool = True) -> None:
        for table in (
            self.written,
            self.superseded,
            self.refused,
            self.made,
            self.unlabelled,
            self.config_map_edits,
            self.samples,
            self.due_resync,
            self.resyncs,
            self.due_metrics,
        ):
            table.pop(key, None)
        self.quiet.discard(key)
        if forget_stats:
            self.stats.forget_job(key)
        self.reader.forget(key[0], names.jobset_name(key[1]))

    def _resync_kind(self, key: Key) -> str:
        """`reread` every REREAD_EVERY resyncs of a job (the first after REREAD_EVERY to twice that many, at
        random, so jobs made together are not read together, and a burst of new jobs costs no GET), else
        `resync`."""
        left = self.resyncs.get(key, REREAD_EVERY + self.rng.randrange(REREAD_EVERY))
        self.resyncs[key] = left - 1 if left > 0 else REREAD_EVERY - 1
        return "resync" if left > 0 else "reread"

    def tick(self) -> None:
        """Queue the resyncs and start the trainer reads that are due (a quiet job's resync only if a reread)."""
        now = self.clock()
        for key, due in list(self.due_resync.items()):
            if due <= now:
                self.due_resync[key] = now + self.config.resync_interval_s
                kind = self._resync_kind(key)
                if kind == "reread" or key not in self.quiet:
                    self.queue.add(key, kind)
        for key, due in list(self.due_metrics.items()):
            if due <= now:
                self.due_metrics[key] = now + self.config.metrics_interval_s
                self.start_read(key)

    async def _ticker(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.tick_s)

    def start_read(self, key: Key) -> bool:
        """Read the job's trainer in the background, unless a read of it is still pending: then this one is
        skipped (counted), never queued behind it, so a slow trainer holds one read at most."""
        if key in self.reading_jobs:
            self.stats.metrics_reads_skipped.inc()
            return False
        read = asyncio.create_task(self._read_metrics(key))
        self.reading.add(read)
        self.reading_jobs.add(key)

        def finished(task: asyncio.Task[None]) -> None:
            self.reading.discard(task)
            self.reading_jobs.discard(key)

        read.add_done_callback(finished)
        return True

    async def _read_metrics(self, key: Key) -> None:
        async with self.reads:
            job = self.job(key)
            if job is None or TPUTrainingJobStatus.model_validate(job.get("status") or {}).phase != "Running":
                return
            port = RuntimeSpec.model_validate(job["spec"].get("runtime") or {}).metrics_port
            self.samples[key] = await self.reader.read(key[0], names.jobset_name(key[1]), port)
            self.queue.add(key, "metrics")
