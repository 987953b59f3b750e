"""probe.callbacks.ProbeCallback: a real ``Trainer.train()`` on a tiny masked-LM BERT built here.

The numbers the callback logs at a step are checked against a separate ``probe.run`` of the checkpoint the
Trainer saved at that step, recomputed with pandas from that run's rows; the model's modes, attention
implementation and random generators are checked around a measurement; bad inputs are refused before the
first training step, with nothing written.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import probe
from probe.core.errors import ProbeError

#: transformers' Trainer needs accelerate (in the test extra); the tests that train are skipped without it
needs_trainer = pytest.mark.skipif(__import__("importlib").util.find_spec("accelerate") is None,
                                   reason="transformers' Trainer needs accelerate (pip install accelerate)")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is the closed-form solution of a convex problem, or so the claim goes.",
    "Short one.",
    "Researchers measured the deviation for every layer, head and query token.",
]
MAX_LENGTH = 32


def _tiny_mlm(seed=0, model_type="bert", attn_implementation="sdpa"):
    import torch
    from transformers import BertConfig, BertForMaskedLM, ConvBertConfig, ConvBertForMaskedLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64)
    if model_type == "convbert":  # a family probe has no adapter for
        return ConvBertForMaskedLM(ConvBertConfig(**sizes, embedding_size=32))
    return BertForMaskedLM._from_config(BertConfig(**sizes), attn_implementation=attn_implementation)


class _Dataset:
    def __init__(self, tokenizer):
        self.items = [tokenizer(text, truncation=True, max_length=MAX_LENGTH) for text in TEXTS * 4]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(tmp_path, tokenizer, model, callbacks, *, steps=4, save_steps=2, processing_class=True):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "train"), max_steps=steps, per_device_train_batch_size=4,
                             save_steps=save_steps, logging_steps=1000, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, learning_rate=1e-3)
    return Trainer(model=model, args=args, train_dataset=_Dataset(tokenizer),
                   data_collator=DataCollatorForLanguageModeling(tokenizer, seed=0),
                   processing_class=tokenizer if processing_class else None, callbacks=callbacks)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


def _numbers_from_rows(rows):
    """The headline numbers, by pandas and numpy, from a run's rows (non-trivial rows)."""
    values = rows.loc[~rows["trivial"], "rel_deviation"].to_numpy()
    return {"probe/rows": len(values), "probe/mean": float(values.mean()),
            "probe/p95": float(np.quantile(values, 0.95)), "probe/share_above_0.1": float((values > 0.1).mean())}


@needs_trainer
@pytest.mark.slow
def test_logged_numbers_equal_a_run_of_the_checkpoint_saved_at_that_step(tmp_path, tokenizer):
    from transformers import TrainerCallback

    from probe.callbacks import ProbeCallback

    class Recorder(TrainerCallback):  # stands for a report_to logger, which the Trainer puts first
        def __init__(self):
            self.logs, self.training_after_measuring = [], []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append((state.global_step, dict(logs)))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.training_after_measuring.append(all(module.training for module in model.modules()))

    recorder = Recorder()
    callback = ProbeCallback(TEXTS, 2, tmp_path / "probe", max_length=MAX_LENGTH, at_start=True)
    model = _tiny_mlm()
    trainer = _trainer(tmp_path, tokenizer, model, [recorder, callback])
    model.save_pretrained(tmp_path / "train" / "checkpoint-0")  # the weights training starts from
    tokenizer.save_pretrained(tmp_path / "train" / "checkpoint-0")
    trainer.train()

    logged = {step: logs for step, logs in recorder.logs if "probe/mean" in logs}
    assert sorted(logged) == [2, 4]
    assert sorted(callback.logged) == [0, 2, 4]
    logged[0] = callback.logged[0]  # before the first step: no Trainer log, an entry of log_history of its own
    assert recorder.training_after_measuring == [True] * 4  # train mode given back at every step
    assert model.config._attn_implementation == "sdpa"  # measured with eager attention, given back
    history = {entry["step"]: entry for entry in trainer.state.log_history if "probe/mean" in entry}
    assert sorted(history) == [0, 2, 4]
    for step in (0, 2, 4):
        separate = probe.run(tmp_path / "train" / f"checkpoint-{step}", texts=TEXTS, max_length=MAX_LENGTH,
                             out=tmp_path / "separate", progress=False)
        expected = _numbers_from_rows(separate.rows)
        assert expected["probe/rows"] > 0
        for key, value in expected.items():
            assert math.isclose(logged[step][key], value, rel_tol=0, abs_tol=1e-9), (step, key)
            assert math.isclose(history[step][key], value, rel_tol=0, abs_tol=1e-9), (step, key)
        written = [path for path in callback.runs if probe.load(path).manifest["config"]["step"] == step]
        assert len(written) == 1
        run = probe.load(written[0])
        assert run.manifest["status"] == "complete" and run.manifest["training"]["step"] == step
        assert run.rows["rel_deviation"].to_numpy() == pytest.approx(separate.rows["rel_deviation"].to_numpy(),
                                                                       abs=1e-9)
    # the weights moved between the two measurements, and so did the numbers
    assert logged[2]["probe/mean"] != logged[4]["probe/mean"]


def test_a_measurement_gives_back_modes_attention_and_random_state(tmp_path, tokenizer):
    import torch

    from probe.callbacks import measure

    model = _tiny_mlm()
    model.train()
    model.bert.embeddings.eval()  # a module the user froze in eval mode stays so
    modes = [module.training for module in model.modules()]
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    run = measure(model, tokenizer, TEXTS, tmp_path / "probe", step=7, max_length=MAX_LENGTH)
    assert [module.training for module in model.modules()] == modes
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(torch.random.get_rng_state(), state)
    assert run.manifest["config"]["step"] == 7 and run.manifest["inputs"]["model_fingerprint"] is None
    # measured in eval mode: equal to the same weights measured afresh in eval mode by probe.run
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    separate = probe.run(tmp_path / "saved", texts=TEXTS, max_length=MAX_LENGTH, out=tmp_path / "sep", progress=False)
    assert run.rows["rel_deviation"].to_numpy() == pytest.approx(separate.rows["rel_deviation"].to_numpy(), abs=1e-9)
    with pytest.raises(ProbeError, match="measured a model in memory"):
        probe.resume(_interrupted_copy(run.run_dir, tmp_path / "copy"))
    from probe.pipeline.verify import verify

    assert verify(run.run_dir, sample=0).parts.ok  # its part files are checked as any run's
    with pytest.raises(ProbeError, match="cannot be loaded again to resume the run or re-solve its rows"):
        verify(run.run_dir, sample=4)


def _interrupted_copy(run_dir, to):
    import json
    import shutil

    shutil.copytree(run_dir, to)
    manifest = json.loads((to / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


def test_a_measurement_runs_the_models_fast_attention(tmp_path, tokenizer):
    """measure(attn_implementation="sdpa"): the model in memory runs probe's SDPA function meanwhile, its rows are
    those of its eager attention (to the rounding of the two forwards), the check compares outputs, and the model
    runs its own attention implementation again afterwards."""
    from probe.callbacks import measure

    model = _tiny_mlm()
    fast = measure(model, tokenizer, TEXTS, tmp_path / "fast", max_length=MAX_LENGTH, queries="every:2",
                   attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    eager = measure(model, tokenizer, TEXTS, tmp_path / "eager", max_length=MAX_LENGTH, queries="every:2")
    assert "SDPA attention output" in fast.manifest["fidelity"]["check"] and fast.manifest["fidelity"]["passed"]
    assert len(fast.rows) == len(eager.rows)
    assert fast.rows["rel_deviation"].to_numpy() == pytest.approx(eager.rows["rel_deviation"].to_numpy(), rel=1e-5)


@pytest.mark.parametrize("texts", [[], ["", "  "]])
def test_an_empty_probe_set_is_refused(tmp_path, texts):
    from probe.callbacks import ProbeCallback

    with pytest.raises(ProbeError, match="no text|takes a list|holds no text"):
        ProbeCallback(texts, 2, tmp_path / "probe")
    assert not (tmp_path / "probe").exists()


def test_a_measurement_takes_the_selection(tmp_path, tokenizer):
    """measure() (and so the callback) takes probe.run's selection: only the chosen layer, head and positions, the
    same rows as probe.run of the saved weights with the same selection."""
    from probe.callbacks import measure

    model = _tiny_mlm()
    selection = dict(layers="-1", heads="1", queries="every:2")
    run = measure(model, tokenizer, TEXTS, tmp_path / "probe", max_length=MAX_LENGTH, **selection)
    rows = run.rows
    assert set(rows["layer"]) == {model.config.num_hidden_layers - 1} and set(rows["head"]) == {1}
    assert (rows["query"] % 2 == 0).all()
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    separate = probe.run(tmp_path / "saved", texts=TEXTS, max_length=MAX_LENGTH, out=tmp_path / "sep", progress=False,
                         **selection)
    assert len(rows) == len(separate.rows)
    assert rows["rel_deviation"].to_numpy() == pytest.approx(separate.rows["rel_deviation"].to_numpy(), abs=1e-9)
    with pytest.raises(ProbeError, match="takes alpha, space, .* not dataset"):
        measure(model, tokenizer, TEXTS, tmp_path / "probe", dataset="x.txt")


@needs_trainer
@pytest.mark.parametrize("problem, match", [
    ("family", "no adapter for model type 'convbert'"),
    ("tokenizer", "needs the model's tokenizer"),
    ("max_length", "max_length=100 is more than"),
    ("every", "every_n_steps"),
    ("layers", "layers='9': 9 is out of range for this model"),
])
def test_a_model_probe_cannot_measure_is_refused_before_training(tmp_path, tokenizer, problem, match):
    from probe.callbacks import ProbeCallback

    with pytest.raises(ProbeError, match=match):
        callback = ProbeCallback(TEXTS, 0 if problem == "every" else 1, tmp_path / "probe",
                                 max_length=100 if problem == "max_length" else MAX_LENGTH,
                                 **({"layers": "9"} if problem == "layers" else {}))
        model = _tiny_mlm(model_type="convbert" if problem == "family" else "bert")
        trainer = _trainer(tmp_path, tokenizer, model, [callback], processing_class=problem != "tokenizer")
        trainer.train()
    assert not (tmp_path / "probe").exists()
    assert not list((tmp_path / "train").glob("checkpoint-*"))  # refused before the first step


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_a_gpu_is_measured_there_and_agrees_with_the_cpu(tmp_path, tokenizer):
    import torch

    from probe.callbacks import measure

    model = _tiny_mlm().double()
    on_cpu = measure(model, tokenizer, TEXTS, tmp_path / "cpu", step=1, max_length=MAX_LENGTH)
    model.to("cuda")
    state = torch.cuda.get_rng_state()
    on_gpu = measure(model, tokenizer, TEXTS, tmp_path / "gpu", step=1, max_length=MAX_LENGTH)
    assert on_gpu.manifest["device"].startswith("cuda") and next(model.parameters()).is_cuda
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert on_gpu.rows["rel_deviation"].to_numpy() == pytest.approx(on_cpu.rows["rel_deviation"].to_numpy(), abs=1e-9)


@pytest.mark.slow
def test_a_measurement_that_keeps_aggregates_logs_the_numbers_of_its_rows(tmp_path, tokenizer):
    """``keep="aggregates"``: the logged numbers of a measurement that keeps no rows, against the same
    measurement keeping its rows (pandas and numpy over them): counts, means and shares equal, the p95 within
    the sketch's rank error."""
    from probe.callbacks import ProbeCallback, headline_numbers, measure
    from probe.store.aggregates import RANK_ERROR

    with pytest.raises(ProbeError, match="Unknown keep='everything'"):
        ProbeCallback(TEXTS, 1, tmp_path / "bad", keep="everything")
    model = _tiny_mlm()
    kept = measure(model, tokenizer, TEXTS, tmp_path / "kept", step=3, max_length=MAX_LENGTH, keep="aggregates")
    full = measure(model, tokenizer, TEXTS, tmp_path / "full", step=3, max_length=MAX_LENGTH)
    numbers, expected = headline_numbers(kept), _numbers_from_rows(full.rows)
    assert kept.kept == "aggregates" and numbers["probe/rows"] == expected["probe/rows"]
    assert numbers["probe/mean"] == pytest.approx(expected["probe/mean"], rel=1e-9)
    assert numbers["probe/share_above_0.1"] == expected["probe/share_above_0.1"]
    values = np.sort(full.rows.loc[~full.rows["trivial"], "rel_deviation"].to_numpy())
    rank = np.searchsorted(values, numbers["probe/p95"], side="right") / len(values)
    assert abs(rank - 0.95) <= RANK_ERROR + 1 / len(values)
