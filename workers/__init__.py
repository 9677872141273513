"""The Celery plumbing: the app and its Redis transport (``celery_app``, ``celery_transport``),
starting a worker of one kind (``worker_main``, ``worker_kinds``), each process's runtime
(``runtime``, ``runtimes``), the tasks (``tasks``), the GPU worker's session (``gpu``) and giving
back what a dead worker held (``held_messages``). The Redis domain they act on is ``domain/``."""
