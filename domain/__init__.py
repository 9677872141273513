"""The Redis domain the API and every worker share: the settings and limits, one job and its
stream (``jobs``), offline batches (``batches``), webhook events (``webhooks``), the fleet's weight
target (``weights``), a job's end and what follows it (``lifecycle``), and the Redis infrastructure
under them (``infra``). It imports no worker, no Celery task and no torch (``pyproject.toml``'s
import contracts); the Celery plumbing that runs tasks on it is ``workers/``."""
