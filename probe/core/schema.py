"""The deviations table: one row per (space, alpha, example, attention site, head, query token).

This module is the single definition of the table's columns; the pipeline writes them and the report
reads them.  The row key is ``(space, alpha, attention_type, layer, head, example, query)``.
"""

import pyarrow as pa

#: Columns, in order, with their Arrow types.  The model is named once, in the run's manifest (``model``); a
#: version-1 run may have a ``model`` column first, which readers ignore (probe.store.storage.FORMAT_VERSION).
DEVIATION_SCHEMA = pa.schema(
    [
        # "self" (encoders); "encoder_self" / "decoder_self" / "cross" (encoder-decoders); "causal_self"
        ("attention_type", pa.string()),
        ("layer", pa.int32()),  # numbered within its stack, from 0
        ("head", pa.int32()),
        ("example", pa.int64()),  # index of the text in the dataset, from 0
        ("query", pa.int32()),  # query token position within its own sequence, from 0
        ("n_keys", pa.int32()),  # number of keys with non-zero preference u_i
        ("alpha", pa.float64()),
        ("rel_deviation", pa.float64()),  # ||lambda* - alpha z|| / ||lambda*||
        ("lambda_norm", pa.float64()),  # ||lambda*||
        ("duality_gap", pa.float64()),  # primal(p(lambda)) - dual(lambda) at the returned point
        ("error_bound", pa.float64()),  # certified bound on ||lambda_returned - lambda*||
        ("iterations", pa.int32()),  # Newton iterations
        ("converged", pa.bool_()),  # certificate met the tolerance
        # the parameterisation: "hidden" (t_i = x_i / sqrt(d'), z = c W_k^T q) or "key" (t_i = k_i / sqrt(d'), z = c q)
        ("space", pa.string()),
        ("token_id", pa.int32()),  # the query token's id
        ("token", pa.string()),  # the query token as the tokenizer writes it
        ("token_role", pa.string()),  # "special" (tokenizer special token), "first" (first decoder position), "word"
        ("trivial", pa.bool_()),  # n_keys == 1: lambda* = alpha z by construction
        ("second_order_deviation", pa.float64()),  # ||lambda* - lambda_2|| / ||lambda*||, the paper's correction
        ("attention_tv", pa.float64()),  # 0.5 sum_i |p*_i - p_att_i|
        ("output_deviation", pa.float64()),  # ||sum_i (p*_i - p_att_i) v_i|| / ||sum_i p_att_i v_i||
        ("evidence_norm", pa.float64()),  # ||alpha z||, the attention approximation's lambda
        ("attention_entropy", pa.float64()),  # -sum_i p_att_i log p_att_i of the model's attention row (nats)
    ]
)

REQUIRED_COLUMNS = tuple(DEVIATION_SCHEMA.names)
#: The row key: no two rows of a run share it.
ROW_KEY = ("space", "alpha", "attention_type", "layer", "head", "example", "query")


#: The interventions table (``interventions.parquet/`` of a run with ``--intervene``; :mod:`probe.interventions`):
#: one record per (space, alpha, substitute, site, example), ``site`` "self.3"-style or "whole" (the
#: whole-model substitution).  Columns with their Arrow type names, in order.
INTERVENTION_COLUMNS = {
    "space": "string", "alpha": "float64", "substitute": "string", "site": "string", "example": "int64",
    "attention_type": "string", "layer": "int32", "hidden_change": "float64", "embedding_cosine": "float64",
    "pooling": "string", "lm_head": "string", "lm_loss_original": "float64", "lm_loss": "float64",
    "top1_agreement": "float64", "scored_tokens": "int32", "solver_rows": "int64", "solver_not_converged": "int64",
    "max_relative_error_bound": "float64",
}
INTERVENTION_SCHEMA = pa.schema([(name, getattr(pa, kind)()) for name, kind in INTERVENTION_COLUMNS.items()])
#: the key of an intervention record
INTERVENTION_KEY = ("space", "alpha", "substitute", "site", "example")
