"""``probe.ot``: the stable public path of OT attention and its certified solver (the theory's second half).

It lives in :mod:`probe.solve.ot`, with the other solvers; this module re-exports its public names so that
``from probe.ot import ...`` keeps working.  probe's own modules import from :mod:`probe.solve.ot`.
"""

from probe.solve.ot import *  # noqa: F403 (the names of its __all__)
from probe.solve.ot import __all__  # noqa: F401
