"""Forward + backward time of the exact attention (probe.solve.exact) against softmax attention, at the ViT's
final-layer size.

The exact-ViT's final layer solves one problem per image and head for the class-token query: ``B = 128``
images, ``H = 8`` heads, ``N = 50`` keys (49 patches of a 28x28 image at patch 4x4, and the class token),
head dimension ``d' = 32``, templates ``k / sqrt(d')``, evidence ``q``, ``u`` uniform, ``alpha = 1``, float32
inputs (as in training).  Its queries and keys come from the final layer of two paper-size models on 128
Fashion-MNIST test images: the ViT at its initial weights (seed 0), and the trained OT-ViT kept in
``reports/vit/ot-seed0.pt`` (4 epochs; its parameters have the exact-ViT's shapes).  Each timing is the
attention weights' forward and their backward for a fixed random upstream gradient (gradients to ``q`` and
``k``): ``softmax(q k^T / sqrt(d'))`` against ``exact_attention``.  A second measurement puts it in context: one whole training step (forward, backward and
Adam) of the paper-size ViT and exact-ViT, from the same weights on the same batch, each going first in
every other repeat.

Times are the process's CPU time (``time.process_time``) with one torch thread (the protocol's): on a
shared machine, wall time mostly measures the other work.  Repeats alternate softmax and exact; the ratios
are of the medians, and the smallest and largest per-repeat ratios show the noise.

    python bench/exact.py            # a few minutes on one core: bench/results_exact.json and .md
    python bench/exact.py --quick    # smoke run: random images, small batch, one repeat
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import common  # noqa: E402

from probe.solve.exact import exact_attention, merge_summaries  # noqa: E402
from probe.vit import load_checkpoint  # noqa: E402
from probe.vit.model import ViT, ViTConfig  # noqa: E402

TRAINED = ROOT / "reports" / "vit" / "ot-seed0.pt"

#: the clock of every timing: this process's CPU time (one thread), not the shared machine's wall time
clock = time.process_time


def images(batch: int, quick: bool) -> torch.Tensor:
    """``batch`` Fashion-MNIST test images normalised as in training (random images in quick mode)."""
    if quick:
        return torch.randn(batch, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    from probe.vit.data import load_data

    data = load_data("fashion-mnist")
    return data.normalise(data.test_images[:batch])


def final_layer_inputs(model: ViT, x: torch.Tensor):
    """The final layer's class-token queries ``(B, H, 1, d')`` and keys ``(B, H, N, d')``, detached."""
    model.eval()
    with torch.no_grad():
        block = model.blocks[-1]
        q, k, _ = block.attn.split(block.norm1(model.hidden_before_final(x)))
    return q[:, :, :1].contiguous(), k.contiguous()


def softmax_weights(q, k):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1), None


def exact_weights(q, k):
    log_u = torch.zeros(k.shape[0], 1, 1, k.shape[2], dtype=k.dtype)
    return exact_attention((k / math.sqrt(k.shape[-1])).unsqueeze(2), q, log_u, return_certificate=True)


def timed_weights(weights, q, k, upstream):
    """(forward s, backward s, certificate summary or None) of one forward and backward."""
    q, k = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    start = clock()
    w, certificate = weights(q, k)
    middle = clock()
    (w * upstream).sum().backward()
    end = clock()
    return middle - start, end - middle, None if certificate is None else certificate.summary()


def measure_layer(name, q, k, repeats):
    upstream = torch.randn(q.shape[:3] + (k.shape[2],), generator=torch.Generator().manual_seed(1))
    timed_weights(softmax_weights, q, k, upstream)  # warm-up (the compiled kernel loads on first use)
    timed_weights(exact_weights, q, k, upstream)
    soft, exact, summaries = [], [], []
    for _ in range(repeats):
        forward, backward, _ = timed_weights(softmax_weights, q, k, upstream)
        soft.append(forward + backward)
        forward, backward, summary = timed_weights(exact_weights, q, k, upstream)
        exact.append((forward, backward))
        summaries.append(summary)
    total = [f + b for f, b in exact]
    ratios = [e / s for e, s in zip(total, soft)]
    certificate = merge_summaries(summaries)
    return {
        "inputs": name, "problems": q.shape[0] * q.shape[1], "keys": k.shape[2], "head_dim": k.shape[3],
        "q_norm_median": float(q.norm(dim=-1).median()), "k_norm_median": float(k.norm(dim=-1).median()),
        "softmax_s": statistics.median(soft), "exact_s": statistics.median(total),
        "exact_forward_s": statistics.median(f for f, _ in exact),
        "exact_backward_s": statistics.median(b for _, b in exact),
        "ratio": statistics.median(total) / statistics.median(soft),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        "newton_iterations_mean": certificate["mean_iterations"],
        "newton_iterations_max": certificate["max_iterations"],
        "max_relative_error_bound": certificate["max_relative_error_bound"],
        "not_converged": certificate["not_converged"],
    }


def measure_step(x, y, repeats):
    """Median seconds of one training step of the paper-size ViT and exact-ViT (same weights, same batch)."""
    models = {}
    for kind in ("softmax", "exact"):
        torch.manual_seed(0)
        models[kind] = ViT(ViTConfig(attention=kind))
    optimizers = {kind: torch.optim.Adam(m.parameters(), lr=3e-4) for kind, m in models.items()}

    def step(kind):
        model = models[kind]
        model.train()
        torch.manual_seed(1)  # the same dropout masks for both
        start = clock()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizers[kind].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[kind].step()
        return clock() - start

    step("softmax"), step("exact")  # warm-up
    times = {"softmax": [], "exact": []}
    for repeat in range(repeats):
        for kind in ("softmax", "exact") if repeat % 2 == 0 else ("exact", "softmax"):  # each goes first in turn
            times[kind].append(step(kind))
    ratios = [e / s for e, s in zip(times["exact"], times["softmax"])]
    return {
        "batch": x.shape[0], "softmax_s": statistics.median(times["softmax"]),
        "exact_s": statistics.median(times["exact"]),
        "ratio": statistics.median(times["exact"]) / statistics.median(times["softmax"]),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
    }


def markdown(results) -> str:
    lines = [
        "# Exact attention against softmax attention (bench/exact.py)",
        "",
        common.header(results) + f" CPU time of one thread; {results['repeats']} alternating repeats; medians.",
        "",
        "## The final layer's attention weights: forward + backward",
        "",
        "| queries and keys from | problems (images x heads) | softmax | exact (forward + backward) | "
        "exact / softmax (per-repeat range) | Newton iterations (mean / max) | max bound / norm lambda | "
        "not certified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["layer"]:
        lines.append(
            f"| {r['inputs']} | {r['problems']:,} | {r['softmax_s'] * 1e3:.1f} ms | {r['exact_s'] * 1e3:.0f} ms "
            f"({r['exact_forward_s'] * 1e3:.0f} + {r['exact_backward_s'] * 1e3:.0f}) | **{r['ratio']:.0f}x** "
            f"({r['ratio_min']:.0f} to {r['ratio_max']:.0f}) | {r['newton_iterations_mean']:.1f} / "
            f"{r['newton_iterations_max']} | {r['max_relative_error_bound']:.1e} | {r['not_converged']} |"
        )
    s = results["step"]
    lines += [
        "",
        "## One whole training step of the paper-size model",
        "",
        "| batch | ViT (softmax) | exact-ViT | exact / softmax (per-repeat range) |",
        "|---|---|---|---|",
        f"| {s['batch']} | {s['softmax_s']:.2f} s | {s['exact_s']:.2f} s | **{s['ratio']:.2f}x** "
        f"({s['ratio_min']:.2f} to {s['ratio_max']:.2f}) |",
        "",
        f"The exact layer's extra time in the first table (the initial ViT's problems) is "
        f"{s['layer_extra_over_softmax_step']:.1%} of the ViT's step: a ratio of "
        f"{1 + s['layer_extra_over_softmax_step']:.2f}, "
        + ("inside" if s["ratio_min"] <= 1 + s["layer_extra_over_softmax_step"] <= s["ratio_max"] else "outside")
        + " the whole step's per-repeat range.",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        __doc__.split("\n\n")[2].replace("\n", " "),
    ]
    return "\n".join(lines) + "\n"


def rewrite_markdown(path: Path) -> None:
    """The markdown of an existing results file (after a change to :func:`markdown`)."""
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))


def main(argv=None):
    parser = common.parser(__doc__, "results_exact.json", quick="random images, batch 8, one repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--step-repeats", type=int, default=4)
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return
    torch.set_num_threads(1)
    env = common.environment()
    batch = 8 if args.quick else 128
    repeats, step_repeats = (1, 1) if args.quick else (args.repeats, args.step_repeats)
    x = images(batch, args.quick)
    results = {"environment": env, "repeats": repeats, "layer": []}
    torch.manual_seed(0)
    sources = [("the initial ViT (seed 0)", ViT(ViTConfig(attention="exact")))]
    if TRAINED.exists():
        sources.append(("the trained OT-ViT (reports/vit/ot-seed0.pt)", load_checkpoint(TRAINED)[0]))
    for name, model in sources:
        row = measure_layer(name, *final_layer_inputs(model, x), repeats)
        print(json.dumps(row), flush=True)
        results["layer"].append(row)
    y = torch.arange(batch) % 10
    results["step"] = measure_step(x, y, step_repeats)
    print(json.dumps(results["step"]), flush=True)
    layer = results["layer"][0]  # what the exact layer adds to a step, from the layer's own timing
    results["step"]["layer_extra_over_softmax_step"] = (layer["exact_s"] - layer["softmax_s"]) / results["step"]["softmax_s"]
    common.write_results(args.out, results, markdown, indent=1, echo=False, benchmark="exact")


if __name__ == "__main__":
    main()
