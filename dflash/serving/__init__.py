"""The serving format of an exported drafter (format) and the export from a training checkpoint (export)."""
