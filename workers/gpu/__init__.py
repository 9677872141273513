"""The GPU worker's side: running one continuous-batching session (``session``), opening a job's
prompt and writing its result (``jobs``), acknowledging a batch's messages (``bulk_ack``), its
side of fleet-wide weight updates (``weight_sync``) and the load-time fidelity check
(``model_check``); a dead worker's messages go back through ``workers.held_messages``. The Celery
task and its message batching are ``workers.tasks.gpu`` and ``workers.tasks.gpu_batching``."""
