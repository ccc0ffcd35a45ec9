"""dflash.target.taps: the one rule for the tapped target layers, and every command that picks them uses it."""

from __future__ import annotations

import pytest

from dflash.drafter.config import DEFAULT_NUM_DRAFT_LAYERS, DFlashConfig, DrafterTrainingConfig
from dflash.errors import TargetError
from dflash.target.taps import default_target_layer_ids, tapped_layer_ids


def test_the_rule_is_the_middle_layer_or_evenly_spread_from_layer_one():
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # round(1 + i * 26 / 4)
    assert tapped_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert tapped_layer_ids(30, 5, [2, 4]) == [2, 4]  # given ids win over the count, checked
    with pytest.raises(TargetError, match="strictly increasing"):
        tapped_layer_ids(30, 2, [4, 2])
    with pytest.raises(TargetError, match="outside"):
        tapped_layer_ids(30, 1, [29])  # the last layer is never tapped
    with pytest.raises(TargetError, match="too shallow"):
        tapped_layer_ids(3, 2)


def test_extract_online_run_and_the_drafter_share_one_default(tmp_path, target_path):
    from transformers import AutoConfig

    from pipelines.offline import PipelineConfig
    from stages.extract.command import ExtractConfig

    # extract taps one layer per draft layer of the default drafter, as the drafter itself does.
    assert ExtractConfig(corpus="c", output="o").num_taps == DrafterTrainingConfig().num_draft_layers == \
        DEFAULT_NUM_DRAFT_LAYERS
    config = DFlashConfig.from_target_config(AutoConfig.from_pretrained(target_path), mask_token_id=0,
                                             num_draft_layers=3)
    assert config.target_layer_ids == tapped_layer_ids(30, 3)
    generate = {"prompts": "default"}  # a pipeline needs a corpus step
    # run: an extract section without num_taps taps the train section's draft layers; a given count is kept.
    pipeline = PipelineConfig(workdir=tmp_path, generate=generate, train={"drafter": {"num_draft_layers": 2}})
    assert pipeline.extract["num_taps"] == 2
    assert PipelineConfig(workdir=tmp_path, generate=generate, extract={"num_taps": 4}, train={"drafter": {"num_draft_layers": 2}}
                          ).extract["num_taps"] == 4
    assert "num_taps" not in PipelineConfig(workdir=tmp_path, generate=generate, extract={"target_layer_ids": [1, 2]}).extract

