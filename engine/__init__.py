"""The model side: load a Hugging Face model, generate and score with continuous batching, swap
weights in place, move features between processes (``engine.transport``), and the typed errors
every layer raises (``engine.errors``).

Other layers import the modules they use (``engine.generation``, ``engine.errors``, ...); this
package names nothing itself, so importing a torch-free module (``engine.errors``,
``engine.request_rules``) loads no torch. docs/architecture.md walks the modules.
"""
