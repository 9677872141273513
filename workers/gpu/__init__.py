"""The GPU worker's side: running one continuous-batching session (``session``), opening a job's
prompt and writing its result (``jobs``), the engine's limits from settings (``limits``) and the
load-time fidelity check (``model_check``); a dead worker's messages go back through
``workers.infra.held_messages``. The Celery task and its message batching are ``workers.tasks.gpu`` and
``workers.tasks.gpu_batching``."""
