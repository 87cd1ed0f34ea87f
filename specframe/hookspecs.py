"""The plugin hooks (pluggy, project name and entry-point group `specframe`)."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("specframe")
hookimpl = pluggy.HookimplMarker("specframe")


@hookspec
def register_proposers(register: Callable[[type], None]) -> None:
    """Register the proposers this plugin provides.

    :param register: call ``register(ProposerClass)`` once per proposer; the class must subclass
        :class:`specframe.Proposer` and set ``name`` and ``config_class``.
    """
