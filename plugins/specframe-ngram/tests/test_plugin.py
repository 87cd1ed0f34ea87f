"""The installed distribution is found through its entry point, listed, and configured through specframe."""

import importlib.metadata
import json

import pytest
from specframe_ngram import NgramConfig, NgramProposer

from specframe import load_config
from specframe.cli import main
from specframe.errors import ConfigError
from specframe.plugins import build_registry


def installed_version() -> str:
    try:
        return importlib.metadata.version("specframe-ngram")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("specframe-ngram is not installed: pip install ./plugins/specframe-ngram")


def test_entry_point_is_found_by_specframe_registry():
    version = installed_version()
    entry = build_registry(autoload=True).get("ngram")
    assert entry.cls is NgramProposer
    assert (entry.plugin, entry.distribution, entry.version) == ("ngram", "specframe-ngram", version)


def test_listed_by_specframe_plugins(capsys):
    version = installed_version()
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["proposers"]}
    assert rows["ngram"]["distribution"] == "specframe-ngram" and rows["ngram"]["version"] == version


def test_config_through_load_config():
    installed_version()
    cfg = load_config(overrides=["proposer.name=ngram", "proposer.max_candidates=3"])
    assert cfg.proposer == NgramConfig(max_candidates=3)
    with pytest.raises(ConfigError, match=r"proposer\.max_ngram must be an integer >= 1, got 0"):
        load_config(overrides=["proposer.name=ngram", "proposer.max_ngram=0"])
    # (every n up to max_ngram is indexed at each token: 10**8 ran out of time and 15 GB of memory)
    with pytest.raises(ConfigError, match=r"proposer\.max_ngram must be at most 64, got 100000000"):
        load_config(overrides=["proposer.name=ngram", "proposer.max_ngram=100000000"])
    assert load_config(overrides=["proposer.name=ngram", "proposer.max_ngram=64"]).proposer.max_ngram == 64


def test_cli_reports_a_bad_value_with_exit_code_2(capsys):
    installed_version()
    assert main(["generate", "--proposer", "ngram", "--prompt", "hi", "proposer.min_ngram=5"]) == 2
    err = capsys.readouterr().err
    assert "proposer.min_ngram must be <= proposer.max_ngram" in err
