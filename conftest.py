"""Settings for every test folder of the repository (tests/ and plugins/*/tests/)."""

import os

# Tests neither read nor keep this machine's timings on disk (specframe/measurements.py), their subprocesses
# included; the tests of that store turn it on in a temporary folder (tests/conftest.py, `kept_timings`).
os.environ["SPECFRAME_KEEP_TIMINGS"] = "0"
