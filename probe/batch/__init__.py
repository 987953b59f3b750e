"""One batch of texts measured: captured sites -> problems -> certified solves -> rows.

Takes a loaded model and a batch of token ids.  Gives the batch's rows of the deviations table
(:mod:`probe.batch.rows`) and its summary; the pipeline writes them, the interventions reuse its problems.
"""
