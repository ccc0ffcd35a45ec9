"""pydantic-settings prototype (model decorated with pydantic.dataclasses.dataclass): `--config FILE` (.toml/.yaml, `[extract]` section) pre-parsed by us and read by
pydantic-settings' Toml/Yaml sources; `--extract.FIELD VALUE` from its CliSettingsSource; `--print-config` (YAML)."""
import argparse
import sys

import yaml
from pydantic_settings import (BaseSettings, CliApp, SettingsConfigDict, TomlConfigSettingsSource,
                               YamlConfigSettingsSource)

# ---- copied model (not counted as glue): ExtractConfig from stages/extract.py (post_init trimmed to the
# ---- range checks that need no project import) + DefaultPromptConfig from dflash/generation/default_prompts.py
from dataclasses import field
from pydantic.dataclasses import dataclass  # the one change to the model: per-field CLI flags need pydantic dataclasses
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


CONFIG_FILE: str | None = None


class Cli(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", cli_prog_name="extract", cli_implicit_flags=True)
    extract: ExtractConfig

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        if CONFIG_FILE is None:
            return (init_settings,)
        source = TomlConfigSettingsSource if CONFIG_FILE.endswith(".toml") else YamlConfigSettingsSource
        return (init_settings, source(settings_cls, CONFIG_FILE))


def main(argv=None) -> None:
    global CONFIG_FILE
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--print-config", action="store_true")
    known, rest = pre.parse_known_args(argv)
    CONFIG_FILE = known.config
    cli = CliApp.run(Cli, cli_args=rest)
    if known.print_config:
        print(yaml.safe_dump(cli.model_dump(mode="json"), sort_keys=False))
        sys.exit(0)
    print("would run with", cli.extract)


if __name__ == "__main__":
    main()
