"""The QKV path: what runs once per batch (prepare) and once per layer (forward)."""
