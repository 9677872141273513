"""Protocol adapters: one module per dialect (SGLang, vLLM, OpenAI) over the one job request and
result, plus the thin views that serve them. Every call still goes through ``web.api.submit`` and is a
durable job owned by the caller's key; these routes answer only when their jobs are done."""
