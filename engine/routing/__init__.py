"""The routing room: which experts each token took at every MoE layer (rollout routing replay,
R3), captured from the router's own top-k during the engine's forwards, kept per row, and
encoded for each dialect. See docs/architecture.md ("Routed experts")."""
