"""probe: test whether pretrained attention is the closed-form solution of its Fenchel dual.

The Python API (:mod:`probe.api`; the command line calls the same functions)::

    import probe
    result = probe.run()            # the real all-MiniLM-L6-v2 on the embedded corpus
    result.rows                     # pandas DataFrame, sorted by the row key
    result.report()                 # the figure report; probe.load(run_dir), probe.compare([...])

``import probe`` is light: the API's functions load torch and the rest when they are called.

The package is laid out along the way a run's data flows (``docs/architecture.md`` draws it); each stage
imports only the stages below it:

* ``probe.core``          -- errors, settings (``RunConfig``), the table's columns, names (no torch);
* ``probe.solve``         -- the certified dual solvers: pure tensor math, no model knowledge
                              (public paths: ``probe.solver``, ``probe.exact``, ``probe.ot``);
* ``probe.capture``       -- model and texts in, each attention site's problems out (``capture.adapters``:
                              one file per family);
* ``probe.store``         -- the run directory: atomic part files, manifest, liveness, the export's sort;
* ``probe.query``         -- the one read path: DuckDB over a run's checked parts, in bounded memory;
* ``probe.batch``         -- one batch: captured sites -> problems -> solves -> rows;
* ``probe.interventions`` -- the exact posterior put into the forward pass, and what it changes;
* ``probe.report``        -- parquet + manifest -> figures, tables and an HTML page (and ``compare``);
* ``probe.pipeline``      -- a run: checks, dataset -> batches -> parts, resume, verify, torchrun;
* ``probe.vit``           -- ViT, OT-ViT, Sinkhorn-ViT and exact-ViT, their data and training;
* ``probe.api``           -- the Python API: ``run``, ``load``, ``resume``, ``compare``, ``export``, ``report``;
* ``probe.cli``           -- the typer app over ``probe.api``.
"""

from probe.core.version import __version__  # noqa: F401 (probe.__version__)

#: the API's names, imported from :mod:`probe.api` on first use (``import probe`` stays light)
#: (``probe.report`` is the report's package: reports are built by ``Run.report()`` or ``probe.api.report``)
__all__ = ["run", "load", "resume", "compare", "export", "Run", "ProbeError", "demo_model"]


def __getattr__(name: str):
    if name == "ProbeError":
        from probe.core.errors import ProbeError

        return ProbeError
    if name in __all__:
        from probe import api

        return getattr(api, name)
    raise AttributeError(f"module 'probe' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
