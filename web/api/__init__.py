"""The native API: jobs (``jobs``, ``generate``: submit, poll, long-poll, cancel), the request
schemas and the checks every route's submit goes through (``schemas``, ``submit``,
``idempotency``, ``session_header``), event streams (``streams``, ``stored_json``), renders,
weight updates, files and batches (``files``, ``batches``, ``batch_upload``), webhook deliveries."""
