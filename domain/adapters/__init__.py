"""The fleet's LoRA adapters in Redis: the registry of what each key (or, shared, an admin) loaded
(``store.py``), and the load and unload calls that wait until every live GPU worker serves the
set (``fleet.py``). The GPU workers' side is ``workers/gpu/adapter_sync.py``."""
