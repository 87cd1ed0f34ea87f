"""The exactness conformance suite: `conformance.run_suite` (and `specframe check`), and for pytest the base
class `specframe.testing.suite.ProposerConformance`."""
