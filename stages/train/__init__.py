"""The train command: its config and command line (command), the training loop (loop) and hyperparameter derivation (hyperparameters)."""
