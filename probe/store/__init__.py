"""A run on disk: atomic part files, the manifest, liveness and the export's out-of-core sort.

Takes the rows of finished batches (Arrow tables).  Gives a run directory that survives any stop
(:mod:`probe.store.storage`), checks of its parts against their checksums, and the rows in key order
(:mod:`probe.store.keyorder`) under DuckDB's memory budget (:mod:`probe.store.engine`).
"""
