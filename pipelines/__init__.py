"""pipelines: commands composed of stages (offline: generate or prepare -> extract -> train -> evaluate; online:
target replicas feeding training through shared memory) and their presets (``pipelines/presets``)."""
