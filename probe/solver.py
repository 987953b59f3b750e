"""``probe.solver``: the stable public path of the batched, certified dual solver.

It lives in :mod:`probe.solve.dual`, with the other solvers; this module re-exports its public names so that
``from probe.solver import ...`` keeps working.  probe's own modules import from :mod:`probe.solve.dual`.
"""

from probe.solve.dual import *  # noqa: F403 (the names of its __all__)
from probe.solve.dual import __all__  # noqa: F401
