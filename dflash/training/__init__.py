"""What a training run keeps: checkpoints, the optimizer and schedule, telemetry and trackers, run-folder state files, and the artefact agreement checks (checks)."""
