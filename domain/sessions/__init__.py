"""An agent's session (``X-Session-ID`` or ``session_id``) as token-exact turns: the last turn kept
per key and session (its messages' fingerprints, its prompt and sampled ids: ``store``), how a
next turn's messages are matched against it (``fingerprint``), the tokens the template puts between
a turn's sampled ids and the next turn's new messages (``bridge``), and the session's trajectory
as token sequences with a loss mask (``trajectory``)."""
