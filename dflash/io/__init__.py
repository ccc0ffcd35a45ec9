"""Files on disk: atomic writes and readable errors (files), advisory locks (locks), safetensors weights (weights),
and POSIX shared-memory segments shared by processes of one host (shm: the online ring, the cache's write processes)."""
