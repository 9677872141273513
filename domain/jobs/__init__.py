"""One job in Redis: the typed request (``request``), its record and status moves (``store``), what
the API shows of it (``view``, ``results``), its event stream and how a reader follows it
(``events``, ``follow``, ``event_hub``: one read for all of a process's streams, ``stream_text``), how it is queued (``submission``, ``prompt_codec``: the
finalized prompt a CPU task hands the GPU), and the sweep that sends again a job whose message a
crash lost (``reaper``). Ending a job and firing what follows (webhook, batch line) is
``domain.lifecycle``, above this package and the batches and webhooks ones."""
