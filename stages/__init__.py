"""stages: one module or package per command (prepare, generate, extract, train, evaluate, export, sweep, cache,
and the forensics commands), over the domain library ``dflash``.

Each stage has a typed config, named inputs and outputs on disk, and runs alone. ``stages.config`` resolves and
checks the configuration of every command, ``stages.replicas`` runs the target replicas on Dask. The CLI
(``stages.cli``) is a thin layer: parse options, build the stage, run it, close it.
"""
