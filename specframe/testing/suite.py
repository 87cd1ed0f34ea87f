"""The conformance suite as pytest tests, for plugin authors and for specframe's own test suite.

    from specframe.testing.suite import ProposerConformance

    class TestMyProposer(ProposerConformance):
        proposer_class = MyProposer      # built with MyProposer.random(target_info, proposer_config)
        proposer_config = None           # optional: a config_class instance
        target_arch = "llama"            # optional: the tiny target's model type (e.g. "qwen2", "gemma3_text")

The statistical tests are marked `slow`. They run every sampling setting (`conformance.SETTINGS`) unless the
class names fewer in `sampling_settings`: for variants of a proposer whose every setting is tested elsewhere.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from specframe.proposer import Proposer
from specframe.testing import conformance
from specframe.testing.tiny import available_devices, one_thread

# The sampling settings for a variant of a proposer (another config, dtype or random build) whose every setting is
# run elsewhere: a transformed q (temperature and top-p) and deep drafts, what a variant's own code can get wrong.
VARIANT_SETTINGS = ("temperature=0.7,top_p=0.9", "deep,temperature=1")


def require_proposers(*names: str) -> None:
    """Skip the calling test, naming them, when any of these proposers is not registered (a plugin not installed)."""
    from specframe.plugins import get_registry

    missing = [n for n in names if n not in get_registry().proposers]
    if missing:
        pytest.skip(f"proposers not registered: {', '.join(missing)} (install the plugins that provide them)")


def _assert(result: conformance.CheckResult, drafts_of: type[Proposer] | None = None) -> None:
    """The check passed; with `drafts_of`, it also saw that proposer draft (else it verified nothing the proposer
    proposes: `conformance.drafted_nothing`; asked of the greedy check, whose long prompt repeats itself, as
    `specframe check` fails only when no check saw a draft)."""
    assert result.passed, f"{result.check} [{result.device}]: {result.detail} (p={result.p_value})"
    if drafts_of is not None:
        unexercised = conformance.drafted_nothing(drafts_of, [result])
        assert unexercised is None, f"{result.check} [{result.device}]: {unexercised.detail}"


@pytest.mark.parametrize("device", available_devices())
class ProposerConformance:
    proposer_class: ClassVar[type[Proposer]]
    proposer_config: ClassVar[Any] = None
    # The tiny target's model type (`specframe.testing.tiny.tiny_target`): llama, or another transformers type.
    target_arch: ClassVar[str] = "llama"
    # Which of conformance.SETTINGS the sampling test runs (default: all of them). Fewer only for a variant of a
    # proposer that is run in every setting elsewhere: each setting costs thousands of generate calls.
    sampling_settings: ClassVar[tuple[str, ...]] = tuple(conformance.SETTINGS)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrize the sampling test by this class's `sampling_settings` (a name not in SETTINGS is an error)."""
        if "setting" not in metafunc.fixturenames:
            return
        unknown = [s for s in self.sampling_settings if s not in conformance.SETTINGS]
        if unknown or not self.sampling_settings:
            raise ValueError(
                f"{type(self).__name__}.sampling_settings must name some of {list(conformance.SETTINGS)}, "
                f"got {list(self.sampling_settings)}"
            )
        metafunc.parametrize("setting", self.sampling_settings)

    @pytest.fixture(autouse=True)
    def _one_thread(self):  # (a method, so that it applies to subclasses in any module)
        with one_thread():
            yield

    def test_greedy_identical_to_target(self, device: str) -> None:
        check = conformance.check_greedy(self.proposer_class, device, self.proposer_config, arch=self.target_arch)
        _assert(check, self.proposer_class)

    def test_rollback_matches_recompute(self, device: str) -> None:
        _assert(conformance.check_rollback(self.proposer_class, device, self.proposer_config, arch=self.target_arch))

    def test_isolation_one_seed_one_output_and_target_untouched(self, device: str) -> None:
        _assert(conformance.check_isolation(self.proposer_class, device, self.proposer_config, arch=self.target_arch))

    @pytest.mark.slow
    def test_sampling_matches_target_distribution(self, device: str, setting: str) -> None:
        config, arch = self.proposer_config, self.target_arch
        _assert(conformance.check_sampling(self.proposer_class, device, setting, config, arch=arch))
