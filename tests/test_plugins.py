import re
import types
from dataclasses import dataclass

import pytest

from specframe import Proposal, Proposer, hookimpl
from specframe import plugins as plugins_mod
from specframe.errors import BadInputError, PluginError
from specframe.plugins import Registry, build_registry


@dataclass
class EchoConfig:
    n: int = 1


class Echo(Proposer):
    name = "echo"
    config_class = EchoConfig

    def begin(self, prompt, hidden_states):
        pass

    def propose(self, state):
        return Proposal.empty()

    def accepted(self, result):
        pass


def plugin_module(register_body):
    mod = types.ModuleType("fake_plugin")

    @hookimpl
    def register_proposers(register):
        register_body(register)

    mod.register_proposers = register_proposers
    return mod


def unmarked_plugin_module():
    """A plugin whose hook function lacks @hookimpl: pluggy never calls it."""
    mod = types.ModuleType("unmarked_plugin")
    mod.register_proposers = lambda register: register(Echo)
    return mod


class FakeDist:
    name, version = "acme-specframe", "1.2.3"


class FakeEntryPoint:
    def __init__(self, name, load, dist=None):
        self.name, self._load, self.dist = name, load, dist or FakeDist()

    def load(self):
        return self._load()


@pytest.fixture
def entry_points(monkeypatch):
    eps = []
    monkeypatch.setattr(plugins_mod.importlib.metadata, "entry_points", lambda group: list(eps))
    monkeypatch.delenv(plugins_mod.DISABLE_ENV, raising=False)
    return eps


def test_builtins_register_through_the_plugin_manager():
    reg = build_registry(autoload=False)
    assert reg.names() == ["draft", "eagle", "medusa", "none", "union"]
    assert {e.plugin for e in reg.proposers.values()} == {"builtin"}
    assert reg.get("none").distribution == "specframe"


def test_unknown_proposer_lists_installed():
    with pytest.raises(BadInputError, match="unknown proposer 'nope'; installed: draft, eagle, medusa, none"):
        build_registry(autoload=False).get("nope")
    with pytest.raises(BadInputError, match=r"union \(plugins are not loaded: SPECFRAME_DISABLE_PLUGIN_AUTOLOAD is"):
        build_registry(autoload=False).get("nope")  # (a plugin's proposer may be installed, not loaded)


def test_duplicate_names_are_refused():
    reg = Registry()
    reg.add(Echo, "a", "a", "1")
    with pytest.raises(PluginError, match="already registered by plugin 'a'"):
        reg.add(Echo, "b", "b", "1")


def test_entry_point_plugin_is_listed_with_distribution_and_version(entry_points):
    entry_points.append(FakeEntryPoint("echo-plugin", lambda: plugin_module(lambda register: register(Echo))))
    reg = build_registry()
    e = reg.get("echo")
    assert (e.plugin, e.distribution, e.version, e.cls) == ("echo-plugin", "acme-specframe", "1.2.3", Echo)


def test_two_distributions_may_name_their_entry_points_alike(entry_points):
    class Echo2(Echo):
        name = "echo2"

    other = types.SimpleNamespace(name="other-specframe", version="0.1")
    entry_points.append(FakeEntryPoint("plugin", lambda: plugin_module(lambda register: register(Echo))))
    entry_points.append(FakeEntryPoint("plugin", lambda: plugin_module(lambda register: register(Echo2)), other))
    reg = build_registry()
    assert not reg.failures and reg.get("echo2").distribution == "other-specframe" and reg.get("echo").cls is Echo


def test_two_entry_points_to_one_module_register_it_once(entry_points, recwarn):
    module = plugin_module(lambda register: register(Echo))
    entry_points += [FakeEntryPoint("a", lambda: module), FakeEntryPoint("b", lambda: module)]
    reg = build_registry()
    assert not reg.failures and not recwarn.list and reg.get("echo").plugin == "a"


def test_a_failure_message_is_one_line(entry_points):
    def raise_multiline(register):
        raise ValueError("first\n  second\n" + "x" * 400)

    entry_points.append(FakeEntryPoint("multi", lambda: plugin_module(raise_multiline)))
    with pytest.warns(UserWarning, match=r"ValueError: first second x+\.\.\.$"):
        reg = build_registry()
    assert "\n" not in reg.failures[0] and len(reg.failures[0]) < 400


class NotAProposer:
    name = "x"


class Abstract(Proposer):
    name = "abstract"
    config_class = EchoConfig


class BadName(Echo):
    name = "has space"


def _raise():
    raise ImportError("no module named acme_missing")


@pytest.mark.parametrize(
    "load, message",
    [
        (_raise, "ImportError: no module named acme_missing"),
        (lambda: plugin_module(lambda register: 1 / 0), "ZeroDivisionError"),
        (lambda: plugin_module(lambda register: register(NotAProposer)), "not a specframe.Proposer"),
        (lambda: plugin_module(lambda register: register(Abstract)), "does not implement"),
        (lambda: plugin_module(lambda register: register(BadName)), "identifier"),
        (lambda: plugin_module(lambda register: [register(Echo), register(Echo)]), "already registered"),
        (lambda: types.SimpleNamespace(register_proposer=hookimpl(lambda register: None)), "unknown hook"),
        (lambda: unmarked_plugin_module(), "marked @specframe"),
        (lambda: plugin_module(lambda register: None), "registered no proposer"),
    ],
)
def test_broken_plugin_warns_naming_it_and_the_rest_keep_working(entry_points, load, message):
    entry_points.append(FakeEntryPoint("broken-plugin", load))
    with pytest.warns(UserWarning, match=f"plugin 'broken-plugin' .*{message}"):
        reg = build_registry()
    assert reg.names() == ["draft", "eagle", "medusa", "none", "union"]
    assert len(reg.failures) == 1


def test_a_plugin_cannot_take_a_builtin_name(entry_points):
    class Impostor(Echo):
        name = "draft"

    entry_points.append(FakeEntryPoint("impostor", lambda: plugin_module(lambda register: register(Impostor))))
    with pytest.warns(UserWarning, match="already registered by plugin 'builtin'"):
        reg = build_registry()
    assert reg.get("draft").plugin == "builtin"


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (2, 1, 0)])
def test_a_name_two_plugins_register_is_used_by_neither(entry_points, order):
    # Which plugin loaded first decided who got the name (entry points come in no promised order): a newly
    # installed package could displace the proposer a user meant.
    class Echo2(Echo):
        name = "echo2"

    class OtherEcho(Echo):  # (another class of the same name; the very same class is not a rival: below)
        pass

    class ThirdEcho(Echo):
        pass

    makers = [
        ("echo-plugin", types.SimpleNamespace(name="acme-specframe", version="1"), [Echo2, Echo]),
        ("impostor", types.SimpleNamespace(name="other-specframe", version="2"), [OtherEcho]),
        ("third", types.SimpleNamespace(name="third-specframe", version="3"), [ThirdEcho]),
    ]
    for i in order:
        name, dist, classes = makers[i]
        load = lambda classes=classes: plugin_module(lambda register: [register(c) for c in classes])  # noqa: E731
        entry_points.append(FakeEntryPoint(name, load, dist))
    with pytest.warns(UserWarning, match="proposer 'echo'.*neither is used"):
        reg = build_registry()
    assert "echo" not in reg.names() and "echo2" not in reg.names()  # (the rivals are out whole, either way round)
    with pytest.raises(BadInputError, match=r"proposer 'echo' is registered by two plugins, plugin '.*' \(.*\) and"):
        reg.get("echo")
    # (the contested plugin's other proposer is named so, not "unknown", either way round)
    with pytest.raises(
        BadInputError,
        match=r"^proposer 'echo2' is not available: its plugin 'echo-plugin' \(acme-specframe\) is not used: its "
        r"proposer 'echo' is registered by another plugin too \(uninstall one of them\)$",
    ):
        reg.get("echo2")
    assert len(reg.failures) == 3 and all(any(f"plugin '{m[0]}'" in f for f in reg.failures) for m in makers)


def test_two_plugins_registering_the_very_same_class_keep_it(entry_points):
    # (a bundle re-exporting another plugin's class is not a rival: the class stays, the second plugin is refused)
    entry_points.append(FakeEntryPoint("echo-plugin", lambda: plugin_module(lambda register: register(Echo))))
    other = types.SimpleNamespace(name="bundle-specframe", version="1")
    entry_points.append(FakeEntryPoint("bundle", lambda: plugin_module(lambda register: register(Echo)), other))
    with pytest.warns(UserWarning, match="plugin 'bundle' .*already registered by plugin 'echo-plugin'"):
        reg = build_registry()
    assert reg.get("echo").plugin == "echo-plugin"


def test_environment_variable_turns_autoload_off(entry_points, monkeypatch):
    entry_points.append(FakeEntryPoint("echo-plugin", lambda: plugin_module(lambda register: register(Echo))))
    for value in ("1", "true", "YES"):
        monkeypatch.setenv(plugins_mod.DISABLE_ENV, value)
        assert "echo" not in build_registry().names()
    for value in ("0", "false", ""):  # (not a way to turn it off)
        monkeypatch.setenv(plugins_mod.DISABLE_ENV, value)
        assert "echo" in build_registry().names()


def test_require_proposers_skips_naming_only_the_missing_ones():
    from specframe.testing.suite import require_proposers

    require_proposers("none", "eagle")  # built in: no skip
    with pytest.raises(pytest.skip.Exception, match=r"not registered: no-such-proposer \("):
        require_proposers("none", "no-such-proposer")


def install(monkeypatch, name, config_class):
    """A proposer `name` configured by `config_class`, registered in the process-wide registry for the test."""
    proposer = type(name.title(), (Echo,), {"name": name, "config_class": config_class})
    registry = build_registry()
    registry.add(proposer, f"{name}-plugin", "acme-specframe", "1")
    monkeypatch.setattr(plugins_mod, "_registry", registry)


def test_a_plugin_config_field_with_a_tuple_default_loads(monkeypatch):
    from specframe.config import load_config

    @dataclass
    class WidthsConfig:
        widths: tuple[int, ...] = (1, 2)

    install(monkeypatch, "widths", WidthsConfig)
    # (before: "proposer.widths must be a list, e.g. proposer.widths=[(1, 2)], got (1, 2)" unless set by hand)
    assert load_config(overrides=["proposer.name=widths"]).proposer.widths == (1, 2)
    assert load_config(overrides=["proposer.name=widths", "proposer.widths=[3]"]).proposer.widths == (3,)


@pytest.mark.parametrize("error", [AssertionError, KeyError, ValueError])
def test_a_plugin_config_check_that_raises_is_a_config_error_naming_its_class(monkeypatch, error):
    from specframe.config import load_config
    from specframe.errors import ConfigError

    @dataclass
    class CheckedConfig:
        k: int = 1

        def __post_init__(self):
            if self.k < 1:
                raise error("k must be positive")

    install(monkeypatch, "checked", CheckedConfig)
    # (before, an assert or KeyError: "error: k must be positive", exit 1, neither the key's section nor the class)
    with pytest.raises(ConfigError, match=rf"proposer \(CheckedConfig\): {error.__name__}: .*k must be positive"):
        load_config(overrides=["proposer.name=checked", "proposer.k=0"])


def test_a_config_field_called_name_is_refused_at_registration():
    @dataclass
    class NamedConfig:
        name: str = "x"  # (generate could never set it: proposer.name picks the proposer; check did set it)

    class Named(Echo):
        name = "named"
        config_class = NamedConfig

    with pytest.raises(PluginError, match="NamedConfig has a field called 'name'"):
        Registry().add(Named, "named-plugin", "acme-specframe", "1")


class BuildsNothing(Echo):
    """A plugin bug: from_config and random return None instead of an instance."""

    name = "builds_nothing"

    @classmethod
    def from_config(cls, config, target):
        return None

    @classmethod
    def random(cls, target, config=None, seed=0):
        return None


def test_a_build_that_returns_no_proposer_is_named_so(monkeypatch, tiny_dirs):
    # Before: "'NoneType' object has no attribute 'name'", naming neither the plugin nor what it returned.
    from specframe import SpeculativeDecoder
    from specframe.config import load_config
    from specframe.errors import ProposerError
    from specframe.testing import conformance
    from specframe.testing.tiny import tiny_llama

    registry = build_registry(autoload=False)
    registry.add(BuildsNothing, "acme", "acme-specframe", "1.0")
    monkeypatch.setattr(plugins_mod, "_registry", registry)
    cfg = load_config(None, ["proposer.name=builds_nothing", f"target.model={tiny_dirs['target']}"])
    words = r"^proposer 'builds_nothing' \(plugin 'acme'\)'s from_config\(\) returned None, not a Proposer instance$"
    with pytest.raises(ProposerError, match=words):
        SpeculativeDecoder.from_config(cfg)
    cfg = load_config(None, ["proposer.name=union", "proposer.members=[builds_nothing]"])
    cfg.target.model = str(tiny_dirs["target"])
    with pytest.raises(ProposerError, match=r"^union member 'builds_nothing''s from_config\(\) returned None"):
        SpeculativeDecoder.from_config(cfg)
    report = conformance.run_suite(BuildsNothing, devices=["cpu"], quick=True, power=False)
    assert not report.passed and "'s random() returned None, not a Proposer instance" in report.results[0].detail
    # The Python API: a class where an instance belongs, or something else, is refused by name.
    model = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    for given, said in (
        (Echo, "the class Echo (not an instance of it)"),
        (object(), "an object"),
        ([], "a list"),
        (None, "None"),
    ):
        with pytest.raises(
            BadInputError, match=rf"^SpeculativeDecoder takes a Proposer instance, got {re.escape(said)}"
        ):
            SpeculativeDecoder(model, given)


def test_the_default_random_build_is_seeded():
    # (a plugin that leaves `random` to the base class and draws weights in its constructor gets the seed's weights)
    import torch

    class Weighted(Echo):
        def __init__(self, config, target):
            super().__init__(config, target)
            self.weight = torch.randn(4)

    info = object()  # (the constructor ignores it)
    torch.manual_seed(123)
    first = Weighted.random(info, seed=0).weight
    assert torch.equal(first, Weighted.random(info, seed=0).weight)
    assert not torch.equal(first, Weighted.random(info, seed=1).weight)
    after = torch.randn(2)
    torch.manual_seed(123)
    assert torch.equal(after, torch.randn(2))  # (the global generator is as the builds found it)
