"""The extract command (command) and the Dask worker that runs the target and writes cache shards (worker)."""
