"""Files on disk: atomic writes and readable errors (files), advisory locks (locks), safetensors weights (weights)."""
