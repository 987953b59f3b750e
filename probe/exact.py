"""``probe.exact``: the stable public path of exact inference as a differentiable layer (the KL problem's posterior with implicit gradients).

It lives in :mod:`probe.solve.exact`, with the other solvers; this module re-exports its public names so that
``from probe.exact import ...`` keeps working.  probe's own modules import from :mod:`probe.solve.exact`.
"""

from probe.solve.exact import *  # noqa: F403 (the names of its __all__)
from probe.solve.exact import __all__  # noqa: F401
