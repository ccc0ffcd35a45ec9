"""The target model: loading it and naming its tapped layers (load), and running it on batches for hidden states and generation (runner)."""
