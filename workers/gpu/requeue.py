"""What a GPU session returns when its messages must go back to the queue (Redis went away under
it, or this worker may not serve now); ``workers/tasks/gpu_batching.py`` puts them back.

A module of its own: every worker kind imports the task modules, and the batching layer reads this
without importing the session (and with it torch)."""

REQUEUE = "requeue"
