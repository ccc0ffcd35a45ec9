"""pipelines: commands composed of stages (offline: generate or prepare -> extract -> train -> evaluate; online:
target replicas feeding training through shared memory); the presets they run live in ``stages/config/presets``."""
