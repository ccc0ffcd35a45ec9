"""The corpus contract: Parquet rows of input_ids + loss_mask (format), the chat template that makes them (chat) and the built-in default corpus (default_corpus)."""
