"""The plugin manager and the proposer registry.

Built-ins register first, then every entry point in the group `specframe` (unless the environment variable
SPECFRAME_DISABLE_PLUGIN_AUTOLOAD is 1, true, yes or on). A plugin that fails to import, whose hook raises, or that
registers a bad class or a taken name is skipped with a warning naming it; the rest keep working.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import warnings
from dataclasses import dataclass

import pluggy

from specframe import builtin, hookspecs
from specframe.errors import BadInputError, PluginError, brief
from specframe.proposer import Proposer


class PluginWarning(UserWarning):
    """A plugin was skipped; the message names it and says why."""


ENTRY_POINT_GROUP = "specframe"
DISABLE_ENV = "SPECFRAME_DISABLE_PLUGIN_AUTOLOAD"


@dataclass(frozen=True)
class ProposerEntry:
    name: str
    cls: type[Proposer]
    plugin: str  # plugin (entry point) name, "builtin" for specframe's own
    distribution: str  # installed distribution that provides it
    version: str


class ContestedName(PluginError):
    """Two plugins register one proposer name: neither gets it (which loaded first would decide otherwise)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name
        self.plugin_names: list[str] = []  # every proposer name the refused plugin registers (`register_plugin`)


class Registry:
    def __init__(self) -> None:
        self.proposers: dict[str, ProposerEntry] = {}
        self.failures: list[str] = []  # one message per plugin that could not be loaded
        self.contested: dict[str, str] = {}  # proposer name -> the plugins that both register it, in words
        # A contested plugin's other proposer names -> why they are not used (their plugin was taken out whole)
        self.withdrawn: dict[str, str] = {}
        self.autoload = True  # whether installed plugins were loaded (off: only the builtin proposers)

    def add(self, cls: type, plugin: str, distribution: str, version: str) -> None:
        check_proposer_class(cls, plugin)
        here = f"plugin '{plugin}' ({distribution})"
        if cls.name in self.contested:
            raise ContestedName(f"{here} registers proposer '{cls.name}', as {self.contested[cls.name]} do", cls.name)
        if cls.name in self.proposers:
            other = self.proposers[cls.name]
            rival = (plugin, distribution) != (other.plugin, other.distribution) and other.cls is not cls
            if rival and "builtin" not in (plugin, other.plugin):
                raise ContestedName(
                    f"{here} registers proposer '{cls.name}', already registered by plugin '{other.plugin}' "
                    f"({other.distribution}): neither is used (uninstall one)",
                    cls.name,
                )
            raise PluginError(
                f"plugin '{plugin}' registers proposer '{cls.name}', already registered by plugin '{other.plugin}'"
            )
        self.proposers[cls.name] = ProposerEntry(cls.name, cls, plugin, distribution, version)

    def contest(self, name: str, plugin: str, distribution: str) -> ProposerEntry | None:
        """`name` is registered by two plugins (or more; the one refusing it was rolled back whole): the plugin
        that holds it is taken out whole too, so what is left does not depend on which loaded first. Returns
        the entry it held, if one did."""
        held = self.proposers.get(name)
        if held is None:
            return None
        self.contested[name] = f"plugin '{held.plugin}' ({held.distribution}) and plugin '{plugin}' ({distribution})"
        ours = [n for n, e in self.proposers.items() if (e.plugin, e.distribution) == (held.plugin, held.distribution)]
        for n in ours:
            del self.proposers[n]
        self.withdraw([n for n in ours if n != name], held.plugin, held.distribution, name)
        return held

    def withdraw(self, names: list[str], plugin: str, distribution: str, contested: str) -> None:
        """Record why `names`, registered by a plugin that was not used for its `contested` name, are missing."""
        for n in names:
            if n not in self.proposers and n not in self.contested:
                self.withdrawn[n] = (
                    f"its plugin '{plugin}' ({distribution}) is not used: its proposer '{contested}' is registered "
                    "by another plugin too (uninstall one of them)"
                )

    def get(self, name: str) -> ProposerEntry:
        if name in self.contested:
            raise BadInputError(
                f"proposer '{name}' is registered by two plugins, {self.contested[name]}: neither is used; "
                "uninstall one of them"
            )
        if name in self.withdrawn and name not in self.proposers:
            raise BadInputError(f"proposer '{name}' is not available: {self.withdrawn[name]}")
        if name not in self.proposers:
            off = "" if self.autoload else f" (plugins are not loaded: {DISABLE_ENV} is set)"
            raise BadInputError(f"unknown proposer '{name}'; installed: {', '.join(sorted(self.proposers))}{off}")
        return self.proposers[name]

    def names(self) -> list[str]:
        return sorted(self.proposers)


def check_proposer_class(cls: type, plugin: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise PluginError(f"plugin '{plugin}' registered {cls!r}, which is not a specframe.Proposer subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"plugin '{plugin}': {cls.__name__}.name must be an identifier string, got {name!r}")
    if not dataclasses.is_dataclass(getattr(cls, "config_class", None)):
        raise PluginError(f"plugin '{plugin}': {cls.__name__}.config_class must be a dataclass")
    if any(f.name == "name" for f in dataclasses.fields(cls.config_class)):  # (`proposer.name` picks the proposer)
        raise PluginError(
            f"plugin '{plugin}': {cls.config_class.__name__} has a field called 'name', which a config cannot set "
            "(proposer.name picks the proposer): rename the field"
        )
    if getattr(cls, "train_config_class", None) is not None and not callable(getattr(cls, "train", None)):
        raise PluginError(f"plugin '{plugin}': {cls.__name__} sets train_config_class but has no train()")
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"plugin '{plugin}': {cls.__name__} does not implement {missing}")


def register_plugin(
    pm: pluggy.PluginManager, registry: Registry, module: object, plugin: str, dist: str, version: str
) -> None:
    """Register one plugin module and collect its proposers; all or nothing."""
    found: list[type] = []
    # (pluggy's own name must be unique: two distributions may both call their entry point "plugin")
    pm.register(module, name=f"{dist}:{plugin}")
    try:
        pm.check_pending()
        pm.subset_hook_caller("register_proposers", [m for m in pm.get_plugins() if m is not module])(
            register=found.append
        )
        if not found:  # (pluggy skips a hook function that is not marked, without a word)
            raise PluginError(
                f"plugin '{plugin}' registered no proposer: is its register_proposers marked @specframe.hookimpl?"
            )
        before = dict(registry.proposers)
        try:
            for cls in found:
                registry.add(cls, plugin, dist, version)
        except Exception as e:
            registry.proposers = before
            if isinstance(e, ContestedName):
                e.plugin_names = [getattr(cls, "name", "") for cls in found]
            raise
    except Exception:
        pm.unregister(module)
        raise


def build_registry(autoload: bool | None = None) -> Registry:
    pm = pluggy.PluginManager("specframe")
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    version = importlib.metadata.version("specframe")
    register_plugin(pm, registry, builtin, "builtin", "specframe", version)
    if autoload is None:
        # (set means 1/true/yes/on; 0, false or empty leave autoloading on)
        autoload = os.environ.get(DISABLE_ENV, "").strip().lower() not in {"1", "true", "yes", "on"}
    registry.autoload = autoload
    if not autoload:
        return registry
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "?"
        ver = ep.dist.version if ep.dist else "?"
        try:
            module = ep.load()
            if pm.is_registered(module):  # a second entry point to the same module: its proposers are in already
                continue
            register_plugin(pm, registry, module, ep.name, dist, ver)
        except Exception as e:
            not_loaded(registry, ep.name, dist, ver, brief(e, 300, typed=True))
            held = registry.contest(e.name, ep.name, dist) if isinstance(e, ContestedName) else None
            if isinstance(e, ContestedName):
                registry.withdraw([n for n in e.plugin_names if n != e.name], ep.name, dist, e.name)
            if held is not None:
                why = f"plugin '{ep.name}' ({dist}) registers proposer '{e.name}' too: neither is used (uninstall one)"
                not_loaded(registry, held.plugin, held.distribution, held.version, f"ContestedName: {why}")
    return registry


def not_loaded(registry: Registry, plugin: str, dist: str, version: str, why: str) -> None:
    """Record and warn that a plugin was not loaded, and why."""
    message = f"plugin '{plugin}' ({dist} {version}) was not loaded: {why}"
    registry.failures.append(message)
    warnings.warn(message, PluginWarning, stacklevel=3)


_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        _registry = build_registry()
    return _registry
