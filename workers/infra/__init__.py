"""What every worker kind shares and no domain owns: the Redis client, records and embedded server
(``redis_client``, ``redis_records``, ``redis_server``), Redis' memory against its bound
(``redis_memory``), strict JSON (``finite_json``),
Prometheus metrics (``metrics``), heartbeats (``heartbeats``), the lost-message sweeps' common
parts (``lost_messages``), giving back what a dead worker held (``held_messages``), per-key fair shares of worker slots (``fair_share``) and log setup
(``logs``)."""
