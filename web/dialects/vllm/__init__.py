"""vLLM's token-in-token-out ``/inference/v1/generate`` and its server routes: bodies and replies
(``request``) and the routes (``views``)."""
