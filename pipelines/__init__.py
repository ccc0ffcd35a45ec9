"""pipelines: compositions of stages (offline: prepare -> extract -> train -> evaluate; sweep) and their presets."""
