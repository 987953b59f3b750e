"""transformers' warnings about what probe has already handled are not shown: a config whose ``num_labels``
disagrees with its labels (probe loads the model without its classification head), said each time the config
is read, and "will result in indexing errors" for a long text that probe tokenizes only to cut it to
``--max-length``.  Each is first shown to be said by transformers itself."""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager

from probe.capture.data import Texts
from probe.capture.loading import load_config
from probe.capture.truncation import cut_texts


@contextmanager
def records(logger_name: str):
    """The records that reach the handlers of a transformers logger (after its filters)."""
    caught: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record):
            caught.append(record)

    logger, handler = logging.getLogger(logger_name), Catch()
    logger.addHandler(handler)
    try:
        yield caught
    finally:
        logger.removeHandler(handler)


def test_a_config_whose_num_labels_disagrees_with_its_labels_is_read_quietly(tiny_bert_dir, tmp_path):
    from transformers import AutoConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(num_labels=5, id2label={"0": "A", "1": "B"}, label2id={"A": 0, "B": 1})
    (model / "config.json").write_text(json.dumps(config))
    logger = logging.getLogger("transformers.configuration_utils")
    kept = logger.filters[:]
    logger.filters.clear()  # transformers as it is, without probe's filter (which a test before may have set)
    try:
        with records("transformers.configuration_utils") as said:
            AutoConfig.from_pretrained(model)
        assert any("num_labels=5" in record.getMessage() for record in said)  # transformers says it
    finally:
        logger.filters[:] = kept
    with records("transformers.configuration_utils") as said:
        for _ in range(3):  # a run reads the config several times, a series once per checkpoint
            load_config(str(model))
    assert not [record.getMessage() for record in said if "num_labels" in record.getMessage()]


def test_cutting_a_long_text_warns_of_no_indexing_errors(tiny_bert_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    tokenizer.model_max_length = 64
    long_text = " ".join(f"word{i % 50}" for i in range(2000))
    tokenizer.deprecation_warnings.clear()
    with records("transformers.tokenization_utils_base") as said:
        tokenizer(long_text[:2000])  # what transformers says of a text longer than the model takes
    assert any("indexing errors" in record.getMessage() for record in said)
    tokenizer.deprecation_warnings.clear()
    with records("transformers.tokenization_utils_base") as said:
        cut = cut_texts(Texts(texts=[long_text], indices=[0]), tokenizer, 32)
    assert cut.truncated == 1 and len(cut.texts[0]) < len(long_text)
    assert not [record.getMessage() for record in said if "indexing errors" in record.getMessage()]
