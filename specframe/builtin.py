"""The built-in proposers, registered through the same hook as any plugin."""

from specframe.hookspecs import hookimpl
from specframe.proposers.draft import DraftProposer
from specframe.proposers.eagle import EagleProposer
from specframe.proposers.medusa import MedusaProposer
from specframe.proposers.none import NoneProposer
from specframe.proposers.union import UnionProposer


@hookimpl
def register_proposers(register):
    register(NoneProposer)
    register(DraftProposer)
    register(EagleProposer)
    register(MedusaProposer)
    register(UnionProposer)
