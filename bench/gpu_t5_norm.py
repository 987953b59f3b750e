"""Why the T5 run on the GPU and on the CPU differ by more than their certificates (bench/results_gpu.md, part 2).

On the lent H100 (2026-11-27) the same float64 run of a t5-small-shaped model on CUDA and on the CPU gave rows
whose ``rel_deviation`` differ by up to 1.1e-8, about 10 times what the two certificates allow, while the
bert-base-shaped model's rows agreed to 0.014 of their bound.  The two T5 runs did not solve the same
problems: their ``evidence_norm`` (computed from the inputs alone) differed by 2e-7, relative, against 2e-15 for
BERT.  transformers' ``T5LayerNorm`` computes its variance in float32 whatever the model's dtype
(``hidden_states.to(torch.float32).pow(2).mean(-1)``), so a float64 T5 is float64 up to float32 rounding in
every layer norm, and two devices round that float32 mean differently.

This script shows, on the CPU alone, that a perturbation of that kind and size explains the difference: the
same model and texts run twice on the CPU, once as transformers computes it and once with the layer norm's
variance in float64, are compared exactly as bench/gpu.py compares the GPU and the CPU.  The certificates bound
each solve; they cannot bound the change of the problem itself, which is the forward's, not the solver's.

    python bench/gpu_t5_norm.py            # writes bench/results_gpu_t5_norm.{json,md}
    python bench/gpu_t5_norm.py --quick    # tiny model (tests/project/test_gpu_check.py)
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import gpu_agreement  # noqa: E402  (the GPU check's comparison of two runs)
import gpu_report  # noqa: E402
import gpu_runs  # noqa: E402  (the GPU check's models and data)


@contextmanager
def float64_layer_norm():
    """T5LayerNorm with its variance in the input's dtype (float64 for a float64 model), not float32."""
    import torch
    from transformers.models.t5 import modeling_t5

    original = modeling_t5.T5LayerNorm.forward

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states

    modeling_t5.T5LayerNorm.forward = forward
    try:
        yield
    finally:
        modeling_t5.T5LayerNorm.forward = original


def measure(quick: bool, workdir: Path) -> dict:
    from probe.pipeline.runner import run

    models = gpu_runs.build_models(workdir / "models", quick)
    length, count = (16, 2) if quick else (128, 4)
    results = []
    for name in ("t5-small-shape", "bert-base-shape"):  # BERT: the control, no float32 inside
        model = models[name]
        data = gpu_runs.data_file(workdir, model, length, count)
        dirs = {}
        for variant in ("as-transformers", "float64-norm"):
            config = gpu_runs.run_config(model, data, length, device="cpu", dtype="float64", batch_size=count,
                                    out=workdir / variant)
            if variant == "float64-norm":
                with float64_layer_norm():
                    dirs[variant] = run(config)
            else:
                dirs[variant] = run(config)
        results.append({"model": name, "tokens": length, "texts": count, "dtype": "float64",
                        **gpu_agreement.compare_runs(dirs["as-transformers"], dirs["float64-norm"])})
    return {"quick": quick, "runs": results}


def markdown(results: dict, gpu_results: dict | None) -> str:
    lines = ["# A float64 T5 is float64 up to its layer norms' float32 variance", "", common.header(results), "",
             "On the CPU; nothing here is typed by hand. "
             "The same model and texts, run twice on the CPU in float64: once as transformers computes it "
             "(`T5LayerNorm` takes its variance in float32), once with that variance in float64. The two runs "
             "are compared as `bench/gpu.py` compares the GPU and the CPU.", "",
             *gpu_report.comparison_table(results["runs"])]
    if gpu_results:
        rows = [r for r in gpu_results.get("agreement", {}).get("runs", []) if "skipped" not in r]
        if rows:
            lines += ["", f"Beside them, the GPU against the CPU ({gpu_results['environment']['device_name']}, "
                      "`bench/results_gpu.md`):", "", *gpu_report.comparison_table(rows)]
    t5 = next(r for r in results["runs"] if r["model"] == "t5-small-shape")
    bert = next(r for r in results["runs"] if r["model"] == "bert-base-shape")
    lines += ["", f"On one device, changing only where T5's layer-norm variance is rounded changes the inputs by "
              f"{t5['max_relative_evidence_difference']:.1e} and `rel_deviation` by up to {t5['max_difference']:.1e} "
              f"({t5['max_difference_over_bound']:.3g} of the certificates' bound); BERT, which has no float32 step, "
              f"does not move ({bert['max_difference']:.1e}). The certificates bound the solver's error on the "
              "problem it was given; two forwards that round differently give it different problems."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = common.parser(__doc__, quick="tiny models (the test)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for results_gpu_t5_norm.{json,md}")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="rewrite this results file's markdown")
    args = parser.parse_args(argv)
    gpu_path = HERE / "results_gpu.json"
    gpu_results = json.loads(gpu_path.read_text()) if gpu_path.exists() and not args.quick else None
    if common.rendered(args, lambda r: markdown(r, gpu_results)):
        return 0
    env = common.environment()
    workdir = Path(tempfile.mkdtemp(prefix="probe-t5-norm-"))
    try:
        results = {"environment": env, **measure(args.quick, workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    common.write_results(args.out / "results_gpu_t5_norm.json", results, lambda r: markdown(r, gpu_results), indent=1,
                         benchmark="gpu_t5_norm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
