"""Exact inference put into the forward pass: what the model outputs when a site's attention is replaced.

Takes a loaded model, a batch and the sites' problems.  Gives the interventions table
(``interventions.parquet``): the outputs' change under the exact posterior, the second-order point and a
seeded null of the same size, one site at a time and every site at once.
"""
