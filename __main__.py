"""``python -m probe`` started in the folder that holds a clone named ``probe/`` finds this file, not the
package's ``__main__``: the clone's ``cli.py`` then says why (see it).  ``python CLONE`` runs the command line."""

import sys

try:
    from probe.cli import main
except ImportError as error:  # the clone shadows the package: one paragraph, not a traceback
    print(f"Error: {error}", file=sys.stderr)
    raise SystemExit(2) from None

main()
