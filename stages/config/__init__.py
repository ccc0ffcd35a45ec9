"""Configuration of every command: reading and layering config files (check, resolve), the generated reference (reference) and the exit-status scheme (exit_status)."""
