"""The job queue: the one package that knows arq (an import-linter contract keeps it so).

Each model has one queue on the queue Redis (``SLUICE_QUEUE_URL``, else the one Redis). The
API admits into it, the workers consume from it, the sweepers repair it, and the gauges and
``sluice status`` count it, all through two doors:

- ``client.Queue`` (API, sweepers, status): ``enqueue`` (bounded and idempotent, ringing the
  queue's doorbell: ``ENQUEUED``, ``DUPLICATE`` or ``QUEUE_FULL``), ``enqueue_all`` (the
  choices of one request, all or none), ``size``, ``waiting``,
  ``remove`` (a job that never started), and for the recovery sweeper ``runs`` (queued? picked
  up how long ago?), ``running_ids``, ``forget`` and ``repair(model, dead_runs)``.
- ``consumer.Consumer`` (worker): runs a handler per job payload on as many jobs at once as the
  backend has slots, polling when the doorbell (``bell.py``) rings and backing off through a
  Redis outage (``poll_backoff.py``).

arq's keys, envelope and overridden internals (``arq_keys.py``, ``consumer.OwnJobsWorker``)
stay in here, so an arq upgrade or a change of engine touches this package only.
"""

from services.queue.client import DUPLICATE, ENQUEUED, QUEUE_FULL, Queue, Run

__all__ = ["DUPLICATE", "ENQUEUED", "QUEUE_FULL", "Queue", "Run"]
