"""Media to model inputs: the guarded fetcher (``processors.fetch``), decoders
(``processors.decode``), one processor per model family (``processors.registry``), the
preprocessing pipeline that turns a request's prompt and media into a finalized prompt
(``processors.pipeline``), chat rendering, and the multimodal cache (``processors.cache``).

Other layers import the modules they use; this package names nothing itself, so importing it
loads neither transformers nor torch.
"""
