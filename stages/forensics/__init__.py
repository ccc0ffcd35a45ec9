"""Reading finished runs, checkpoints and exports: inspect, scan, diff and report."""
