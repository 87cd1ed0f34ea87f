"""specframe's pytest plugin (entry point `pytest11`), active in any pytest run where specframe is installed.

- It registers the `slow` marker that the conformance suite's statistical tests carry, so that a plugin's own
  test suite can deselect them (`-m "not slow"`) without configuring anything.
- It provides the `specframe_conformance` fixture: call it with a proposer class (and optionally its config)
  to run the whole conformance suite, as `specframe check` does, and fail with its report:

      def test_my_proposer_is_exact(specframe_conformance):
          specframe_conformance(MyProposer, MyConfig(depth=3), quick=True)

The class-based form, one pytest test per check and device, is `specframe.testing.suite.ProposerConformance`.
Nothing heavy is imported until the fixture is used.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: specframe's statistical conformance checks and real models (deselect with -m 'not slow')"
    )


@pytest.fixture
def specframe_conformance():
    """A function (proposer class, config=None, *, quick=False, devices=None, dtypes=None, archs=None) -> Report
    that runs the conformance suite on tiny random targets (of the model types in `archs`, default llama) and
    fails the test, with the report, unless every check passed."""
    from specframe.testing.conformance import run_suite

    def check(proposer_class: type, config: Any = None, *, quick=False, devices=None, dtypes=None, archs=None):
        report = run_suite(proposer_class, devices=devices, config=config, quick=quick, dtypes=dtypes, archs=archs)
        assert report.passed, report.summary()
        return report

    return check
