"""The train command: its configuration (config), resume policy (resume), rank launcher (launch) and command line
(command); the training loop (loop), the batches it consumes (data), the target weights a rank reads
(target_weights) and the hyperparameter table (hyperparameters)."""
