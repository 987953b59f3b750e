"""probe: test whether pretrained attention is the closed-form solution of its Fenchel dual.

Layers, each in one place, data flowing one way:

* ``probe.solver``    -- the batched, certified dual solver (pure tensor math, no model knowledge);
* ``probe.adapters``  -- per-architecture capture of templates / evidence / preference (one file each,
                          declared in ``probe.adapters.REGISTRY``);
* ``probe.validate``  -- every check that runs before anything expensive (``probe.hub``: path or hub id);
* ``probe.loading``   -- model, adapter and tokenizer loading (eager attention);
* ``probe.rows``      -- one batch: captured sites -> problems -> solver -> rows;
* ``probe.pipeline``  -- the run: dataset -> batches -> rows -> part files + manifest, and resume
                          (``probe.stopping``: signals; ``probe.fingerprint``: what resume checks;
                          ``probe.distributed``: several processes under torchrun);
* ``probe.storage``   -- the run directory: atomic part files and manifest, liveness, readers, export;
* ``probe.report``    -- parquet + manifest -> figures, tables and an HTML page;
* ``probe.cli``       -- the typer app (``probe run``, ``resume``, ``status``, ``export``, ``report``).
"""

__version__ = "0.1.0"
