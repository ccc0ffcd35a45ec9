"""jsonargparse prototype: `--config FILE` (.toml/.yaml/.json, `extract:` section), `--extract.FIELD VALUE`,
`--print_config` (YAML, reads back with --config)."""
import tomllib

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, set_loader

# ---- copied model (not counted as glue): ExtractConfig from stages/extract.py (post_init trimmed to the
# ---- range checks that need no project import) + DefaultPromptConfig from dflash/generation/default_prompts.py
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class DefaultPromptConfig:
    heldout_permille: int = 50
    chars_per_completion: int = 600
    window_chars: int = 1200
    instruct: bool = True
    max_definition_lines: int = 60
    max_prompts: int | None = None
    max_heldout: int = 512
    seed: int = 0


@dataclass
class ExtractConfig:
    corpus: str
    output: str
    target: str = "default"
    target_layer_ids: list[int] | None = None
    num_taps: int = 5
    target_gpus: list[int] | None = None
    workers: int | None = None
    scheduler_address: str | None = None
    shard_size: int = 65536
    token_budget: int = 16384
    packing: bool = False
    packed_attention: Literal["flex_attention", "sdpa"] = "flex_attention"
    storage_dtype: Literal["bf16", "fp8"] = "bf16"
    codec: str | None = None
    max_length: int | None = None
    length_policy: Literal["error", "drop", "truncate"] = "error"
    force_space: bool = False
    expected_ratio: float = 1.0
    dashboard_address: str = "127.0.0.1:8787"
    tls_ca_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    break_lock: bool = False
    write_threads: int | None = None
    writes_in_flight: int = 2
    write_processes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    default_prompts: DefaultPromptConfig = field(default_factory=DefaultPromptConfig)  # the nested dataclass

    def __post_init__(self) -> None:
        for name in ("num_taps", "shard_size", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
# ---- end of copied model


def toml_or_yaml(text: str):
    """TOML if it parses as TOML, else YAML (jsonargparse hands the loader text, not the path)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as toml_error:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            raise toml_error from None


def main(argv=None) -> None:
    set_loader("toml_or_yaml", toml_or_yaml, exceptions=(tomllib.TOMLDecodeError,))
    parser = ArgumentParser(prog="extract", parser_mode="toml_or_yaml")
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(ExtractConfig, "extract")
    cfg = parser.parse_args(argv)
    extract = parser.instantiate_classes(cfg).extract
    print("would run with", extract)


if __name__ == "__main__":
    main()
