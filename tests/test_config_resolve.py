"""Every stage command resolves its config the same way: --preset < --config FILE < options < --set, checked before
any work, printed by --print-config in a form --config reads back (stages/stage_config.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import pytest

from dflash.errors import ConfigError
from tests.cli_helpers import main_in_process, main_in_process_out

# (command, the options and arguments that name its inputs/outputs; paths that need not exist: nothing runs)
STAGES = {
    "prepare": ["-o", "{tmp}/out"],
    "generate": ["-o", "{tmp}/out"],
    "extract": ["--corpus", "{tmp}/corpus", "-o", "{tmp}/out"],
    "evaluate": ["--drafter", "{tmp}/drafter", "--prompts", "{tmp}/p.jsonl"],  # made by _args: checked up front
    "train": ["--cache", "{tmp}/cache", "-o", "{tmp}/out"],
    "export": ["{tmp}/ckpt", "{tmp}/out"],
    "sweep": ["--cache", "{tmp}/cache", "--grid", "lr=1e-3,2e-3"],
}
# One field of each stage, three values of the right type (for the file, the option, --set), a typo of its name,
# and a value of the wrong type.
FIELD = {
    "prepare": ("max_length", (777, 1554, 2331), "max_lenght", "long"),
    "generate": ("max_new_tokens", (77, 154, 231), "max_new_token", "many"),
    "extract": ("shard_size", (7777, 15554, 23331), "shard_sise", "big"),
    "evaluate": ("num_prompts", (7, 14, 21), "num_prompt", "few"),
    "train": ("optim.lr", (0.007, 0.014, 0.021), "optim.lrr", "fast"),  # a nested config's field: [train.optim]
    "export": ("target", ("t1", "t2", "t3"), "targte", 5),
    "sweep": ("output", ("s1", "s2", "s3"), "outptu", 5),
}


# The section a bare ``--set FIELD=VALUE`` sets where it is not the command's own: sweep's fix train fields.
BARE_SET = {"sweep": "train"}


def _args(stage: str, tmp_path) -> list[str]:
    if stage == "evaluate":
        (tmp_path / "p.jsonl").write_text('{"prompt": "Write a haiku."}\n')
    return [a.format(tmp=tmp_path) for a in STAGES[stage]]


def _nested(field: str, value) -> dict:
    """``("optim.lr", 1)`` -> ``{"optim": {"lr": 1}}``."""
    head, _, rest = field.partition(".")
    return {head: _nested(rest, value)} if rest else {field: value}


def _toml(stage: str, field: str, text: str) -> str:
    """A TOML file setting ``field`` (dotted: in its nested table, ``[train.optim]``) to the literal ``text``."""
    table, _, leaf = field.rpartition(".")
    return f"[{stage}{'.' + table if table else ''}]\n{leaf} = {text}\n"


def _get(printed: dict, field: str):
    for part in field.split("."):
        printed = printed[part]
    return printed



@pytest.mark.parametrize("stage", sorted(STAGES))
def test_print_config_reads_back_and_layers_in_order(stage, tmp_path, monkeypatch, capsys):
    """The file's value beats the default, an option given beats the file, --set beats the option; the printed
    config, fed back with --config, prints the same again."""
    field, (value, other, last), _, _ = FIELD[stage]
    option = "--" + field.rpartition(".")[2].replace("_", "-")  # --lr sets train.optim.lr
    (tmp_path / "c.toml").write_text(_toml(stage, field, json.dumps(value)))

    def resolved(*extra: str) -> dict:
        code, out, err = main_in_process_out(monkeypatch, capsys, stage, *_args(stage, tmp_path), *extra,
                                             "--print-config")  # fmt: skip
        assert code == 0, err
        return json.loads(out)

    def of(printed: dict):
        return _get(printed[stage], field)

    default = of(resolved())
    assert default != value
    assert of(resolved("--config", str(tmp_path / "c.toml"))) == value
    assert of(resolved("--config", str(tmp_path / "c.toml"), option, str(other))) == other
    final = resolved("--config", str(tmp_path / "c.toml"), option, str(other), "--set",
                     f"{stage}.{field}={json.dumps(last)}")
    assert of(final) == last
    (tmp_path / "printed.json").write_text(json.dumps(final))
    code, out, err = main_in_process_out(monkeypatch, capsys, stage, "--config", str(tmp_path / "printed.json"),
                                         "--print-config")  # fmt: skip
    assert code == 0, err
    assert json.loads(out) == final


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_bad_configs_exit_2_with_one_line_naming_key_and_source_and_write_nothing(stage, tmp_path, monkeypatch,
                                                                                  capsys):
    field, _, typo, wrong = FIELD[stage]
    import yaml

    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({stage: _nested(typo, 1)}))
    (tmp_path / "broken.toml").write_text(_toml(stage, field, "= 3"))
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump({stage: _nested(field, "X")}).replace("X", "[1, 2"))
    (tmp_path / "wrong.json").write_text(json.dumps({stage: _nested(field, wrong)}))
    cases = [
        (["--config", str(tmp_path / "typo.yaml")], [f"{stage}.{typo} (--config ", f"did you mean {stage}.{field}?"]),
        (["--config", str(tmp_path / "broken.toml")], ["invalid TOML", "broken.toml"]),
        (["--config", str(tmp_path / "broken.yaml")], ["broken.yaml"]),
        (["--config", str(tmp_path / "wrong.json")], [f"{stage}.{field} (--config ", "expected"]),
        (["--config", str(tmp_path / "missing.toml")], ["missing.toml", "no such file"]),
        (["--set", f"{stage}.{field}={wrong}"], [f"{stage}.{field} (--set {stage}.{field}={wrong})", "expected"]),
        (["--set", f"{typo}=3"], [f"{BARE_SET.get(stage, stage)}.{typo} (--set {typo}=3)", "did you mean"]),
        (["--preset", "no-such-preset"], ["no-such-preset"]),
    ]
    for extra, needles in cases:
        code, err = main_in_process(monkeypatch, capsys, stage, *_args(stage, tmp_path), *extra)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (extra, err)
        assert len(lines) == 1 and lines[0].startswith("error:"), (extra, err)
        for needle in needles:
            assert needle in lines[0], (extra, needle, lines[0])
    made = {"broken.toml", "broken.yaml", "typo.yaml", "wrong.json"} | ({"p.jsonl"} if stage == "evaluate" else set())
    assert {p.name for p in tmp_path.iterdir()} == made


def test_a_pipeline_preset_configures_each_stage_from_its_own_section(tmp_path, monkeypatch, capsys):
    """``--preset h200-smollm2`` gives extract the preset's extract section (and the top-level target), evaluate its
    evaluate section without the pipeline-only keys; a required input missing everywhere is one error line."""
    code, out, err = main_in_process_out(monkeypatch, capsys, "extract", *_args("extract", tmp_path), "--preset",
                                         "h200-smollm2", "--print-config")  # fmt: skip
    assert code == 0, err
    extract = json.loads(out)["extract"]
    assert (extract["num_taps"], extract["target_gpus"], extract["shard_size"]) == (5, [0], 262144)
    code, out, err = main_in_process_out(monkeypatch, capsys, "evaluate", *_args("evaluate", tmp_path), "--preset",
                                         "h200-smollm2", "--print-config")  # fmt: skip
    assert code == 0, err
    evaluate = json.loads(out)["evaluate"]
    assert (evaluate["dtype"], evaluate["ignore_eos"], evaluate["prompt_tokens"]) == ("float32", True, 256)
    code, err = main_in_process(monkeypatch, capsys, "extract", "--preset", "h200-smollm2")
    assert code == 2 and err.strip().startswith("error: extract: --corpus is required")


def test_hostile_config_files_and_values_are_one_error_line(tmp_path, monkeypatch, capsys):
    """Inputs that break parsers or slip past a flat type check (found by attacking the CLI): each exits 2 with one
    ``error:`` line naming the file or key, and nothing is written; a YAML alias bomb is refused before expansion."""
    (tmp_path / "huge.json").write_text('{"extract": {"shard_size": ' + "1" * 5000 + "}}")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "laughs.yaml").write_text('a: &a ["x","x","x"]\nb: &b [*a,*a,*a]\nextract:\n  extra: {c: [*b,*b]}\n')
    (tmp_path / "nested.json").write_text('{"generate": {"default_prompts": {"window_chars": "big"}}}')
    (tmp_path / "typo_section.json").write_text('{"extract": {"target_processes": 1}, "trian": {"lr": 5}}')
    (tmp_path / "lr.toml").write_text("[train.optim]\nlr = -1.0\n")
    (tmp_path / "inf.json").write_text('{"extract": {"expected_ratio": 1e999}}')
    (tmp_path / "epochs.toml").write_text("[train]\nepochs = 1" + "0" * 400 + "\n")  # overflows a float
    (tmp_path / "seed.toml").write_text(f"[train]\nseed = {2**63}\n")
    (tmp_path / "list_section.yaml").write_text("train: [1, 2]\n")  # was 'train.train: unknown key'
    (tmp_path / "flow.yaml").write_text("train:\n  x: " + "[" * 20000 + "]" * 20000 + "\n")  # quadratic in PyYAML
    (tmp_path / "dashes.yaml").write_text("- " * 20000 + "x\n")
    (tmp_path / "deep.toml").write_text("x = " + "[" * 20000 + "]" * 20000 + "\n")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.yaml")
    os.mkfifo(tmp_path / "fifo.json")
    out = str(tmp_path / "out")
    train = ["train", "--cache", "c", "-o", out]
    cases = [
        (["extract", "--corpus", "c", "-o", out, "--config", str(tmp_path / "huge.json")], "huge.json: unreadable"),
        (["extract", "--corpus", "c", "-o", out, "--config", str(tmp_path / "deep.json")], "deep.json: nested more than 64"),
        (["extract", "--corpus", "c", "-o", out, "--preset", str(tmp_path / "bin.json")], "bin.json: not valid JSON"),
        (["extract", "--corpus", "c", "-o", out, "--preset", str(tmp_path / "fifo.json")], "fifo.json: is a FIFO"),
        ([*train, "--config", str(tmp_path / "epochs.toml")], "train.epochs (--config "),
        ([*train, "--config", str(tmp_path / "seed.toml")], "train.seed (--config "),
        ([*train, "--config", str(tmp_path / "list_section.yaml")],
         "train (--config " + str(tmp_path / "list_section.yaml") + "): expected a section (a table of train settings), "
         "got [1, 2]"),
        ([*train, "--seed", str(2**63), "--print-config"], "train.seed (--seed): must be an integer from 0 to 2**63-1"),
        ([*train, "--set", "seed=-1", "--print-config"], "must be an integer from 0 to 2**63-1"),
        (["generate", "-o", out, "--set", f"default_prompts.seed={2**64}", "--print-config"], "default_prompts.seed"),
        ([*train, "--config", str(tmp_path / "flow.yaml")], "flow.yaml: nested more than 64 levels deep"),
        ([*train, "--config", str(tmp_path / "dashes.yaml")], "dashes.yaml: nested more than 64 levels deep"),
        ([*train, "--config", str(tmp_path / "deep.toml")], "deep.toml: nested more than 64 levels deep"),
        ([*train, "--config", str(tmp_path / "zero.toml")], "zero.toml: is a device, not a regular file"),
        ([*train, "--config", str(tmp_path / "fifo.yaml")], "fifo.yaml: is a FIFO, not a regular file"),
        (["extract", "--corpus", "c", "-o", out, "--config", str(tmp_path / "laughs.yaml")], "YAML aliases"),
        (["extract", "--corpus", "c", "-o", out, "--set", "shard_size=" + "1" * 5000], "unreadable value"),
        (["extract", "--corpus", "c", "-o", out, "--config", str(tmp_path)], "is a folder"),
        (["extract", "--corpus", "c", "-o", out, "--config", str(tmp_path / "inf.json")], "expected a finite number"),
        (["extract", "--corpus", "c", "-o", out, "--config", str(tmp_path / "typo_section.json")], "did you mean train?"),
        (["generate", "-o", out, "--config", str(tmp_path / "nested.json")],
         "generate.default_prompts.window_chars (--config "),
        (["generate", "-o", out, "--set", "generate.default_prompts=5"], "expected an object of DefaultPromptConfig"),
        (["train", "--cache", "c", "-o", out, "--config", str(tmp_path / "lr.toml")], "train.optim.lr (--config "),
        (["train", "--cache", "c", "-o", out, "--set", "train.epochs=-3"], "train.epochs (--set train.epochs=-3)"),
    ]
    for args, needle in cases:
        code, stdout, err = main_in_process_out(monkeypatch, capsys, *args)
        lines = [line for line in (stdout + err).splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (args, lines)
    assert not (tmp_path / "out").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("[1]")
    code, err = main_in_process(monkeypatch, capsys, "train", "-o", str(tmp_path / "run"), "--resume")
    assert code == 2 and "is not a readable run record" in err


def test_run_takes_a_config_file_over_its_preset_and_prints_what_it_would_run(tmp_path, monkeypatch, capsys):
    """``run --config`` merges sections field by field over the preset, ``--set`` over both; ``--print-config``
    checks everything, prints JSON that ``--preset FILE.json`` reads back, and creates no work folder."""
    workdir = str(tmp_path / "work")
    (tmp_path / "c.toml").write_text("[train.optim]\nlr = 0.002\n[evaluate]\nnum_prompts = 3\n")
    code, out, err = main_in_process_out(monkeypatch, capsys, "run", "--workdir", workdir, "--config",
                                         str(tmp_path / "c.toml"), "--set", "train.optim.lr=0.003", "--print-config")  # fmt: skip
    assert code == 0, err
    printed = json.loads(out)
    assert (printed["train"]["optim"]["lr"], printed["evaluate"]["num_prompts"]) == (0.003, 3)
    assert printed["train"]["drafter"]["block_size"] == 4  # the cpu-small preset's, untouched by the file
    (tmp_path / "resolved.json").write_text(out)
    code, again, err = main_in_process_out(monkeypatch, capsys, "run", "--workdir", workdir, "--preset",
                                           str(tmp_path / "resolved.json"), "--print-config")  # fmt: skip
    assert code == 0 and json.loads(again) == printed, err
    (tmp_path / "bad.toml").write_text("[trian]\nlr = 1\n")
    (tmp_path / "range.toml").write_text("[train.optim]\nlr = -1\n")
    for name, needle in (("bad.toml", "did you mean train?"), ("range.toml", "train.optim.lr (--config ")):
        code, err = main_in_process(monkeypatch, capsys, "run", "--workdir", workdir, "--config", str(tmp_path / name))
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(("name", "text", "line"), [
    ("dup.yaml", "extract:\n  shard_size: 5\n  shard_size: 6\n", " (line 3)"),
    ("dup.yml", "shard_size: 5\nshard_size: 6\n", " (line 2)"),
    ("dup.json", '{"extract": {"shard_size": 5, "shard_size": 6}}', ""),
])  # fmt: skip
def test_a_key_given_twice_in_a_yaml_or_json_file_is_refused(name, text, line, tmp_path):
    """As TOML refuses it: last-wins would silently drop one of the two values."""
    from dflash.errors import ConfigError
    from stages.config.check import read_config_file

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        read_config_file(path)
    assert str(raised.value) == f"--config {path}: key 'shard_size' given twice{line}; keep one"
    path.write_text(text.replace("shard_size: 6", "num_taps: 6").replace('"shard_size": 6', '"num_taps": 6'))
    assert read_config_file(path)  # distinct keys (also the same key in different mappings) are fine


@pytest.mark.parametrize(("name", "text"), [("empty.yaml", ""), ("comments.yml", "# nothing set yet\n"),
                                            ("empty.toml", "# nothing\n"), ("empty.json", "{}")])  # fmt: skip
def test_an_empty_config_file_sets_nothing_in_every_format(name, text, tmp_path):
    """An empty YAML document reads as no settings, like an empty TOML file or ``{}``; a YAML scalar is refused."""
    from dflash.errors import ConfigError
    from stages.config.check import read_config_file

    path = tmp_path / name
    path.write_text(text)
    assert read_config_file(path) == {}
    (tmp_path / "sections.yaml").write_text("train:\nextract:\n")  # sections with nothing under them yet
    assert read_config_file(tmp_path / "sections.yaml") == {"train": {}, "extract": {}}
    (tmp_path / "flat.yaml").write_text("max_steps:\n")  # a field set to null stays null
    assert read_config_file(tmp_path / "flat.yaml") == {"max_steps": None}
    (tmp_path / "scalar.yaml").write_text("5\n")
    with pytest.raises(ConfigError, match="expected a table/object of settings at the top, got int"):
        read_config_file(tmp_path / "scalar.yaml")


def test_paths_and_names_that_would_fail_a_later_stage_are_refused_before_run_writes_anything(
        tmp_path, monkeypatch, capsys):  # fmt: skip
    """A wrong target path, prompts file, codec name or target layer to copy fails `run` before its first stage,
    naming where it came from, and the work folder is never made (these once failed only when their stage started)."""
    workdir = str(tmp_path / "work")
    (tmp_path / "prompts.csv").write_text("not a prompts file\n")
    cases = [
        (["--target", str(tmp_path / "no-model")], "error: target '"),
        (["--set", f"evaluate.prompts={tmp_path / 'missing.jsonl'}"], "error: evaluate.prompts (--set evaluate.prompts="),
        (["--set", f"evaluate.prompts={tmp_path / 'prompts.csv'}"], "must end in .jsonl (chat rows) or .txt"),
        (["--set", "extract.codec=zstd-9"], "error: extract.codec (--set extract.codec=zstd-9): expected auto or one of"),
        # Read from the GGUF file's header: SmolLM2 has 30 decoder layers.
        (["--set", "train.drafter.init=target", "--set", "train.drafter.num_draft_layers=2", "--set",
          "train.drafter.init_target_layers=[3,30]"],
         "error: train.drafter.init_target_layers (--set train.drafter.init_target_layers=[3,30]): [30] out of range: "
         "the target (SmolLM2-135M-Instruct.Q4_1.gguf) has layers 0..29"),
    ]
    for args, start in cases:
        code, err = main_in_process(monkeypatch, capsys, "run", "--workdir", workdir, *args)
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("preset ")]
        assert code == 2 and len(lines) == 1 and start in lines[0], (args, err)
    assert not (tmp_path / "work").exists()
    for args, start in [
        (["generate", "-o", workdir, str(tmp_path / "missing.jsonl")], "error: generate.prompts (PROMPTS"),
        (["evaluate", "--drafter", str(tmp_path), "--prompts", str(tmp_path / "missing.jsonl")],
         "error: evaluate.prompts (--prompts"),
    ]:
        code, err = main_in_process(monkeypatch, capsys, *args)
        assert code == 2 and err.startswith(start) and "does not exist" in err, (args, err)
    assert not (tmp_path / "work").exists()


def test_a_config_error_is_reported_without_importing_torch(tmp_path):
    """Every command's module is imported at start-up; none may import torch before the config check, which would
    delay every `error:` line by the seconds torch takes to import on a small host. (`run` and `extract` do import it:
    the extract section's own checks import the cache module, which needs torch.)"""
    import subprocess
    import sys

    script = ("import sys\nfrom stages.cli import main\nsys.argv = ['dflash-stages', *sys.argv[1:]]\n"
              "try:\n    main()\nexcept SystemExit as exit:\n"
              "    print(exit.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    for args in (["train", "--cache", "c", "-o", "o", "--set", "optim.lr=abc"],
                 ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--set", "block_size=x"],
                 ["evaluate", "--drafter", "d", "--set", "block_size=x"]):
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        assert done.stdout.split()[-3:] == ["2", "False", "False"], (args, done.stdout, done.stderr)


def test_a_nested_configs_refusal_names_its_whole_path_and_source(tmp_path, monkeypatch, capsys):
    """A value the nested config refuses (generate.default_prompts, train.data) is named by its dotted path and
    where it came from, in each stage's own resolver as in `run`'s."""
    (tmp_path / "g.toml").write_text("[generate.default_prompts]\nheldout_permille = 2000\n")
    out = str(tmp_path / "out")
    for args, expected in [
        (["generate", "-o", out, "--config", str(tmp_path / "g.toml")],
         f"error: generate.default_prompts.heldout_permille (--config {tmp_path / 'g.toml'}): must be in 0..999, got 2000"),
        (["generate", "-o", out, "--heldout-permille", "-3"],
         "error: generate.default_prompts.heldout_permille (--heldout-permille): must be in 0..999, got -3"),
        (["train", "--cache", "c", "-o", out, "--set", "train.data.token_budget=-1"],
         "error: train.data.token_budget (--set train.data.token_budget=-1): must be a positive int (tokens per batch); "
         "got -1"),
        (["generate", "-o", out, "--set", "generate.default_prompts.max_heldout=-1"],  # a negative cap sliced [:-1]
         "error: generate.default_prompts.max_heldout (--set generate.default_prompts.max_heldout=-1): must be >= 1, "
         "got -1"),
        (["train", "--cache", "c", "-o", out, "--set", "train.telemetry.progress_interval=-5"],
         "error: train.telemetry.progress_interval (--set train.telemetry.progress_interval=-5): must be a number of "
         "seconds >= 0 (0: no progress lines), got -5"),
        # the engine's sizes are checked with the settings, not once a worker has loaded the target
        (["generate", "-o", out, "--set", "generate.batch_size=0"],
         "error: generate.batch_size (--set generate.batch_size=0): must be >= 1, got 0"),
        (["generate", "-o", out, "--set", "generate.prefill_tokens=-5"],
         "error: generate.prefill_tokens (--set generate.prefill_tokens=-5): must be >= 1, got -5"),
    ]:
        code, err = main_in_process(monkeypatch, capsys, *args)
        assert code == 2 and err.strip() == expected, (args, err)
    assert not (tmp_path / "out").exists()


#: A config with a nested one, for the resolver's own layers.
@dataclass
class _Inner:
    lr: float = 1e-3
    eps: float = 1e-8

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")


@dataclass
class _Config:
    output: str = "o"
    seed: int = 0
    steps: int | None = None
    inner: _Inner = field(default_factory=_Inner)

    def __post_init__(self):
        if isinstance(self.inner, dict):
            try:
                self.inner = _Inner(**self.inner)
            except ConfigError as error:
                raise ConfigError(f"inner.{error}") from None


def test_a_base_layer_sits_under_every_other_and_a_fill_sees_what_no_layer_set(tmp_path):
    """``resolve_stage_config``'s lowest layer (train's saved run) is overridden by a file, a nested option given by
    its dotted path and ``--set``; ``fill`` fills only what no layer set; a refused value names its key and the
    layer it came from (the base's own source too)."""
    from stages.config.resolve import resolve_stage_config

    (tmp_path / "c.toml").write_text("seed = 2\n")
    saved = ({"seed": 1, "steps": 9, "inner": {"eps": 1e-6}}, "the saved run R")

    def fill(merged):
        merged.setdefault("steps", 100)
        return "filled"

    config, filled = resolve_stage_config(_Config, "demo", given={"inner.lr": 0.5}, config_file=tmp_path / "c.toml",
                                          overrides=["demo.output=x"], base=lambda upper: saved, fill=fill)
    assert (config.output, config.seed, config.steps, config.inner.lr, config.inner.eps) == ("x", 2, 9, 0.5, 1e-6)
    assert filled == "filled"
    config, _ = resolve_stage_config(_Config, "demo", base=lambda upper: None, fill=fill)
    assert config.steps == 100  # nothing set it: filled
    with pytest.raises(ConfigError, match=r"^demo\.inner\.lr \(--learning-rate\): must be > 0, got -1"):
        resolve_stage_config(_Config, "demo", given={"inner.lr": -1}, option_names={"inner.lr": "--learning-rate"})
    with pytest.raises(ConfigError, match=r"^demo\.inner\.lr \(the saved run R\): must be > 0"):
        resolve_stage_config(_Config, "demo", base=lambda upper: ({"inner": {"lr": -2}}, "the saved run R"))
