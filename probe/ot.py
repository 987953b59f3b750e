"""``probe.ot``: the stable public path of OT attention and its certified solver (the theory's second half).

The path to import from (``from probe.ot import ...``): it re-exports the public names of
:mod:`probe.solve.ot`, where the code lives beside the other solvers and where probe's own modules import
it from.
"""

from probe.solve.ot import *  # noqa: F403 (the names of its __all__)
from probe.solve.ot import __all__  # noqa: F401
