"""What the domain's packages share and none owns: the Redis client, records and embedded server
(``redis_client``, ``redis_records``, ``redis_server``), Redis' memory against its bound
(``redis_memory``), strict JSON (``finite_json``), waking a record's waiters (``wakeups``,
``wakeup_hub``), Prometheus metrics (``metrics``), heartbeats (``heartbeats``), the lost-message
sweeps' common parts (``lost_messages``), which GPU worker a prompt goes to (``gpu_affinity``),
per-key fair shares of worker slots (``fair_share``), the feature transport's acknowledgements
(``transport_acks``) and log setup (``logs``)."""
