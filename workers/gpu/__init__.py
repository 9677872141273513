"""The GPU worker's side: running one continuous-batching session (``session``), opening a job's
prompt and writing its result (``jobs``), the engine's limits from settings (``limits``), giving
back a dead worker's messages (``held_messages``) and the load-time fidelity check
(``model_check``). The Celery task and its message batching are ``workers.tasks.gpu`` and
``workers.tasks.gpu_batching``."""
