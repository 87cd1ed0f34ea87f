"""Settings for the test runs from the repository's root (tests/ and plugins/*/tests/, as the README and CI run
them; `pytest plugins/<plugin>` on its own reads that plugin's pyproject.toml and not this file)."""

import os

# Tests neither read nor keep this machine's timings on disk (specframe/measurements.py), their subprocesses
# included; the tests of that store turn it on in a temporary folder (tests/conftest.py, `kept_timings`).
os.environ["SPECFRAME_KEEP_TIMINGS"] = "0"
