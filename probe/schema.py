"""The deviations parquet: one row per (example, attention site, head, query token).

This module is the single definition of the table's columns; the pipeline writes them and the report
reads them.
"""

import pyarrow as pa

#: Required columns, in order, with their Arrow types.
DEVIATION_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("attention_type", pa.string()),  # "self" (BERT); "encoder_self" / "decoder_self" / "cross" (T5)
        ("layer", pa.int32()),  # numbered within its stack, from 0
        ("head", pa.int32()),
        ("example", pa.int64()),  # index of the text in the dataset, from 0
        ("query", pa.int32()),  # query token position within the example, from 0
        ("n_keys", pa.int32()),  # number of keys with non-zero preference u_i
        ("alpha", pa.float64()),
        ("rel_deviation", pa.float64()),  # ||lambda* - alpha z|| / ||lambda*||
        ("lambda_norm", pa.float64()),  # ||lambda*||
        ("duality_gap", pa.float64()),  # primal(p(lambda)) - dual(lambda) at the returned point
        ("error_bound", pa.float64()),  # certified bound on ||lambda_returned - lambda*||
        ("iterations", pa.int32()),  # Newton iterations
        ("converged", pa.bool_()),  # certificate met the tolerance
    ]
)

REQUIRED_COLUMNS = tuple(DEVIATION_SCHEMA.names)
