"""SGLang's native API: ``/generate`` and its batch (``request``: bodies to job requests, results
to replies), streamed chunks (``stream``) and the routes beside it (``views``)."""
