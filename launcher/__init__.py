"""The ``rollout-queue`` command (``cli``): the API, a worker of one kind, or ``up``, the whole
service on one machine (``stack``: the embedded Redis and a supervisor that restarts a child that
dies, ``supervisor``). Above every layer: it starts them."""
