"""Configuration of every command: reading and layering config files (check, resolve) and the exit-status scheme (exit_status)."""
