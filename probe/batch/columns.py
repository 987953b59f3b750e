"""A site's rows as tensors on the run's device (:class:`SiteColumns`), and as the parquet table of
:data:`probe.core.schema.DEVIATION_SCHEMA` (:func:`columns_table`, with the token strings of :class:`RowContext`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from probe.core.schema import DEVIATION_SCHEMA


@dataclass
class RowContext:
    """What rows need beyond a site and its solution."""

    example_ids: list[int]
    special_ids: frozenset
    token_text: dict  # token id -> token string, filled as ids are met
    tokenizer: object = None

    def tokens(self, ids: np.ndarray) -> pa.Array:
        """The token strings of ``ids`` as a string column (each distinct id looked up once)."""
        distinct, position = np.unique(ids, return_inverse=True)
        missing = [int(i) for i in distinct if int(i) not in self.token_text]
        if missing:
            texts = self.tokenizer.convert_ids_to_tokens(missing) if self.tokenizer is not None else None
            for i, text in zip(missing, texts or [None] * len(missing)):
                self.token_text[i] = text if text is not None else str(i)
        strings = pa.array([self.token_text[int(i)] for i in distinct], pa.string())
        return strings.take(pa.array(position.reshape(-1), pa.int64()))


@dataclass
class SiteColumns:
    """The rows of one site in one space and alpha as tensors on the run's device, one entry per (example, head,
    real query) in the order :func:`probe.batch.rows.site_rows` writes them: what :func:`columns_table` turns into the parquet
    table and :class:`probe.batch.aggregates.Aggregates` folds into statistics without building it."""

    attention_type: str
    layer: int
    space: str
    alpha: float
    example: torch.Tensor  # int64, the dataset's example ids
    head: torch.Tensor
    query: torch.Tensor  # the query token's position
    token_id: torch.Tensor
    n_keys: torch.Tensor
    role: torch.Tensor  # int64 codes into ROLES
    values: dict  # column -> float64 (or int / bool) tensor: the measured columns of DEVIATION_SCHEMA

    @property
    def count(self) -> int:
        return int(self.head.shape[0])

    def take(self, index: torch.Tensor) -> "SiteColumns":
        """The rows at ``index``."""
        pick = lambda x: x[index]  # noqa: E731
        return SiteColumns(self.attention_type, self.layer, self.space, self.alpha, pick(self.example),
                           pick(self.head), pick(self.query), pick(self.token_id), pick(self.n_keys), pick(self.role),
                           {name: pick(value) for name, value in self.values.items()})


#: the measured columns of a row, as :class:`SiteColumns` holds them in ``values``
MEASURED = ("rel_deviation", "lambda_norm", "duality_gap", "error_bound", "iterations", "converged",
            "second_order_deviation", "attention_tv", "output_deviation", "evidence_norm", "attention_entropy")


def columns_table(columns: SiteColumns, context: RowContext) -> pa.Table:
    """The rows of :func:`probe.batch.rows.site_columns` in the parquet schema (on the host)."""
    count = columns.count
    host = {name: value.cpu().numpy() for name, value in columns.values.items()}
    token_ids = columns.token_id.cpu().numpy()
    keys = columns.n_keys.cpu().numpy().astype(np.int32)
    table = {
        "attention_type": _repeated(columns.attention_type, count),
        "layer": np.full(count, columns.layer, np.int32),
        "head": columns.head.cpu().numpy().astype(np.int32),
        "example": columns.example.cpu().numpy(),
        "query": columns.query.cpu().numpy().astype(np.int32),
        "n_keys": keys,
        "alpha": np.full(count, columns.alpha, np.float64),
        **{name: host[name] for name in ("rel_deviation", "lambda_norm", "duality_gap", "error_bound")},
        "iterations": host["iterations"].astype(np.int32),
        "converged": host["converged"],
        "space": _repeated(columns.space, count),
        "token_id": token_ids.astype(np.int32),
        "token": context.tokens(token_ids),
        "token_role": _ROLES.take(pa.array(columns.role.cpu().numpy())),
        "trivial": keys == 1,
        **{name: host[name] for name in ("second_order_deviation", "attention_tv", "output_deviation",
                                         "evidence_norm", "attention_entropy")},
    }
    return pa.table(table, schema=DEVIATION_SCHEMA)


def with_layer(table: pa.Table, layer: int) -> pa.Table:
    """``table`` (of :func:`columns_table`) with every row's ``layer`` set to ``layer``: one site's slice of a
    table built for several sites at once."""
    position = table.schema.get_field_index("layer")
    layers = pa.array(np.full(table.num_rows, layer, np.int32))
    return table.set_column(position, DEVIATION_SCHEMA.field("layer"), layers)


#: the ``token_role`` values, by code
_ROLES = pa.array(["word", "special", "first"], pa.string())


def _repeated(value: str, count: int) -> pa.Array:
    """A string column of ``count`` copies of ``value``."""
    return pa.repeat(pa.scalar(value, pa.string()), count)
