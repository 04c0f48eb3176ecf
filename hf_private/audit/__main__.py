"""`python -m hf_private.audit`, the same command as `hf-private-audit` (both run `hf_private.cli.audit.main`).

A package's `__main__` rather than `cli.py` run as a script: `import hf_private` already imports the audit package
(the trainer uses it) and `cli` imports the trainer, so running an imported module as `__main__` would load it twice
(runpy's RuntimeWarning).
"""

import sys

from ..cli.audit import main

sys.exit(main())
