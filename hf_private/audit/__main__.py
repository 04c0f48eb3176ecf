"""`python -m hf_private.audit`, the same command as `hf-private-audit`.

A package's `__main__` rather than `audit.py` run as a script: `import hf_private` already imports the audit module
(the trainer uses it), and running an imported module as `__main__` would load it twice (runpy's RuntimeWarning).
"""

import sys

from . import main

sys.exit(main())
