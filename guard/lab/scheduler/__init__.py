"""Scheduler simulator: the parts of kube-scheduler that make the ghost loop.

Test and demo infrastructure (never imported by the serving path). It talks to
one apiserver replica through the official ``kubernetes`` client, like a real
scheduler whose connection landed on that replica:

- **informers** for Pods and Nodes: LIST ``resourceVersion=0`` (watch cache),
  then WATCH from the list's resourceVersion; a new WATCH from the last seen
  resourceVersion when one ends; a re-LIST on ``410 Gone``
  (client-go ``tools/cache/reflector.go``);
- a **scheduling queue** with activeQ, backoffQ and the unschedulable pool
  (``pkg/scheduler/backend/queue/scheduling_queue.go``): error backoff starts at
  ``pod_initial_backoff`` and doubles to ``pod_max_backoff``; backoffQ is flushed
  every ``backoff_flush_period``; any cluster event (pod or node add, update,
  delete) moves unschedulable pods out, subject to backoff; pods left in the
  pool longer than ``pod_max_in_unschedulable`` are flushed;
- **serial scheduling cycles** (``schedule_one.go``): built-in filters first
  (node unschedulable, nodeSelector, resource requests against allocatable
  minus the pods bound or assumed there and nominated pods of equal or higher
  priority), then each extender's filter verb with the nodes that passed
  (``extender.go``), then a node by least-allocated score, then the Binding
  POST; on failure the pod is forgotten and, **if the informer still holds
  it**, requeued with backoff, and a status PATCH (``PodScheduled=False``) is
  sent when the condition changes;
- **preemption** like DefaultPreemption (``framework/preemption/preemption.go``,
  ``plugins/defaultpreemption``) when no node fits: candidates on nodes not
  marked unresolvable, victims chosen by removing lower-priority pods and
  reprieving the most important ones, the extenders' preempt verb, then the
  victims really deleted through the API (after a ``DisruptionTarget``
  condition patch) and the preemptor's ``nominatedNodeName`` patched.

Every constant is in :class:`Timings` so tests can run fast. Per-pod counters are
available from :meth:`Scheduler.stats`.

One module per job:

- :mod:`.config`: ``extenders[]`` entries (:class:`ExtenderConfig`,
  :class:`TLSConfig`), :class:`Timings`, the per-pod :class:`PodStats`;
- :mod:`.extender`: the HTTP extender client (filter and preempt verbs);
- :mod:`.fit`: resource fit, static filters, scoring and victim selection
  (pure functions of pod and node objects);
- :mod:`.informer`: the reflector (LIST, WATCH, relist on 410);
- :mod:`.queue`: activeQ, backoffQ and the unschedulable pool;
- :mod:`.core`: :class:`Scheduler`, which wires them into scheduling cycles,
  binds, status patches and preemption.
"""

from __future__ import annotations

from guard.lab.scheduler.config import ExtenderConfig, PodStats, Timings, TLSConfig
from guard.lab.scheduler.core import Scheduler
from guard.lab.scheduler.extender import ExtenderError
from guard.lab.scheduler.fit import UNRESOLVABLE, UNSCHEDULABLE, pod_requests

__all__ = [
    "UNRESOLVABLE",
    "UNSCHEDULABLE",
    "ExtenderConfig",
    "ExtenderError",
    "PodStats",
    "Scheduler",
    "TLSConfig",
    "Timings",
    "pod_requests",
]
