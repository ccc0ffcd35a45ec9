"""stages: one module per pipeline stage (prepare, extract, train, evaluate, export...).

Each stage has a typed config, named inputs and outputs on disk, and runs alone. The CLI (``stages.cli``) is a
thin layer: parse options, build the stage, run it, close it.
"""
