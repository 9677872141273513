"""The Celery tasks, one module per worker kind (``cpu``, ``gpu``, ``webhooks``, ``batches``,
``render``, ``score_lines``), how the GPU task gathers its messages into engine sessions
(``gpu_batching``), and how a task rides out a Redis outage (``outage``). The task names live in
``domain.names``."""
