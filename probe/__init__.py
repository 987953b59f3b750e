"""probe: test whether pretrained attention is the closed-form solution of its Fenchel dual.

The Python API (:mod:`probe.api`; the command line calls the same functions)::

    import probe
    result = probe.run()            # the real all-MiniLM-L6-v2 on the embedded corpus
    result.rows                     # pandas DataFrame, sorted by the row key
    result.report()                 # the figure report; probe.load(run_dir), probe.compare([...])

``import probe`` is light: the API's functions load torch and the rest when they are called.

Layers, each in one place, data flowing one way:

* ``probe.solver``    -- the batched, certified dual solver (pure tensor math, no model knowledge);
* ``probe.adapters``  -- per-architecture capture of templates / evidence / preference (one file each,
                          declared in ``probe.adapters.REGISTRY``);
* ``probe.config``    -- a run's settings (``RunConfig``) and the names of their choices (no torch);
* ``probe.validate``  -- every check that runs before anything expensive (``probe.hub``: path or hub id);
* ``probe.naming``    -- the model's real name from its files, and the run's name;
* ``probe.loading``   -- model, adapter and tokenizer loading (eager attention);
* ``probe.rows``      -- one batch: captured sites -> problems -> solver -> rows;
* ``probe.pipeline``  -- the run: dataset -> batches -> rows -> part files + manifest, and resume
                          (``probe.stopping``: signals; ``probe.fingerprint``: what resume checks;
                          ``probe.distributed``: several processes under torchrun);
* ``probe.storage``   -- the run directory: atomic part files and manifest, liveness, readers, export;
* ``probe.report``    -- parquet + manifest -> figures, tables and an HTML page;
* ``probe.verify``    -- a finished run checked after the fact: checksums and rows re-solved independently;
* ``probe.intervene`` -- the exact posterior put into the forward pass, and what it changes in the outputs
                          (``probe run --intervene``: the ``interventions.parquet`` table);
* ``probe.ot``        -- the theory's second half: the OT attention (eq. 22) and its certified OT solver;
* ``probe.vit``       -- ViT, OT-ViT and Sinkhorn-ViT, their offline data and training (``probe vit train``);
* ``probe.api``       -- the public Python API: ``run``, ``load``, ``resume``, ``compare``, ``export``
                          (``probe.*``) and ``report``;
* ``probe.cli``       -- the typer app (``probe run``, ``resume``, ``status``, ``export``, ``report``,
                          ``compare``, ``verify``, ``vit train``), over ``probe.api``.
"""

__version__ = "0.1.0"

#: the API's names, imported from :mod:`probe.api` on first use (``import probe`` stays light)
#: (``probe.report`` is the report's package: reports are built by ``Run.report()`` or ``probe.api.report``)
__all__ = ["run", "load", "resume", "compare", "export", "Run", "ProbeError", "demo_model"]


def __getattr__(name: str):
    if name == "ProbeError":
        from .errors import ProbeError

        return ProbeError
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'probe' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
