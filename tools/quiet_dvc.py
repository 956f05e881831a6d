"""``dvc`` as the tools run it (``python -m tools.quiet_dvc exp run ...``): DVC's own command line, less one warning.

``dvc exp run`` first checks out every output of the commit it starts from; on a commit that has no dvc.lock yet (a
fresh clone, before the recipe's first run) each output logs "No file hash info found for '...'. It won't be
created." Nothing is wrong: no run has made them yet. DVC has no switch for that logger alone (``-q`` also hides
which stages run), so this quiets it and nothing else.
"""

import logging
import sys

try:
    from dvc.cli import main
except ImportError:
    sys.exit("error: dvc is not installed in this environment (install the project's requirements)")

logging.getLogger("dvc_data.index.checkout").setLevel(logging.ERROR)
sys.exit(main(sys.argv[1:]))
