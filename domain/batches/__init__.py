"""Offline batches (ours and OpenAI's format): the batch record and its lines (``store``),
creating one (``creation``), submitting its lines in chunks (``messages``), counting what ended
(``progress``), expiry and owed scoring runs (``sweeps``), the sweep for chunks a crash lost
(``reaper``), uploaded files (``files``) and the per-key cap on input held in Redis
(``stored_input``)."""
