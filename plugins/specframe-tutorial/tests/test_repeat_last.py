import pytest
from specframe_tutorial import RepeatLastConfig, RepeatLastProposer

from specframe import load_config
from specframe.errors import ConfigError
from specframe.testing.suite import ProposerConformance


class TestRepeatLast(ProposerConformance):
    proposer_class = RepeatLastProposer
    proposer_config = RepeatLastConfig(num_speculative_tokens=2)


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"proposer\.num_speculative_tokens must be an integer in \[1, 16\]"):
        load_config(overrides=["proposer.name=repeat_last", "proposer.num_speculative_tokens=0"])
