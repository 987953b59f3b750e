"""What must hold on a GPU, checked on every device torch sees (the CPU always; CUDA where present).

``bench/gpu.py`` runs these on a lent GPU (its part 1, ``-k cuda``); CI runs their CPU cases.  Each compares
the device's answer with the CPU's (the solver, a whole run) or with the run's own certificate, never with
itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.solve.dual import DualProblems, solve_dual

from ..support.models import save_word_bert

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_problems(groups=3, per_group=5, n=12, d=20, scale=0.6, seed=0) -> DualProblems:
    """Groups of problems sharing templates (as one site's heads do), one masked key per problem."""
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(groups, n, d, generator=generator, dtype=torch.float64) * scale
    evidence = torch.randn(groups, per_group, d, generator=generator, dtype=torch.float64)
    log_u = torch.log(torch.rand(groups, per_group, n, generator=generator, dtype=torch.float64) + 0.1)
    log_u[..., -1] = -torch.inf  # a masked key (padding)
    return DualProblems(gram=templates @ templates.transpose(1, 2), logits=evidence @ templates.transpose(1, 2),
                        log_preference=log_u, evidence_sqnorm=(evidence * evidence).sum(-1), alpha=1.3)


def on(problems: DualProblems, device: str) -> DualProblems:
    return DualProblems(gram=problems.gram.to(device), logits=problems.logits.to(device),
                        log_preference=problems.log_preference.to(device),
                        evidence_sqnorm=problems.evidence_sqnorm.to(device), alpha=problems.alpha)


@pytest.mark.parametrize("device", DEVICES)
def test_solver_on_device_agrees_with_the_cpu_within_both_certificates(device):
    """The same problems solved on the device and on the CPU: converged on both, and every relative deviation
    within what the two certified error bounds allow (as probe verify's bound)."""
    problems = random_problems()
    here, cpu = solve_dual(on(problems, device)), solve_dual(problems)
    assert here.rel_deviation.device.type == device
    assert bool(here.converged.all()) and bool(cpu.converged.all())
    lam = torch.maximum(here.lambda_norm.cpu(), cpu.lambda_norm)
    rel = torch.maximum(here.rel_deviation.cpu(), cpu.rel_deviation)
    bound = (here.error_bound.cpu() + cpu.error_bound) * (1 + rel) / lam + 1e-12
    assert bool(((here.rel_deviation.cpu() - cpu.rel_deviation).abs() <= bound).all())
    assert float(here.attention[..., -1].abs().max()) == 0.0  # the masked key has no mass


@pytest.fixture(scope="module")
def small_bert_dir(tmp_path_factory):
    """A random 2-layer BERT with a word-level tokenizer built here (the GPU machine has no MiniLM package)."""
    words = sorted({w.strip(".,?").lower() for w in " ".join(TEXTS).split()})
    return save_word_bert(tmp_path_factory.mktemp("small-bert"), [".", ",", "?", *words], layers=2, heads=4,
                          lowercase=True)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is the closed form solution of a convex problem, or so the claim goes.",
    "Short one.",
    "Why?",
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_on_device_reproduces_the_models_attention_and_the_cpu_run(device, small_bert_dir, tmp_path):
    """probe run on the device (float64): the fidelity check passes, and each row's relative deviation equals
    the CPU run's within the two rows' certificates."""
    import pyarrow.dataset as ds

    from probe.capture.data import DatasetSpec
    from probe.core.config import RunConfig
    from probe.core.schema import ROW_KEY
    from probe.pipeline.runner import run
    from probe.store.storage import read_manifest

    texts_file = tmp_path / "texts.txt"
    texts_file.write_text("\n".join(TEXTS) + "\n")
    runs = {}
    for where in dict.fromkeys([device, "cpu"]):
        config = RunConfig(model=str(small_bert_dir), dataset=DatasetSpec(name=str(texts_file)), out=tmp_path / where,
                           device=where, dtype="float64", progress=False, batch_size=2)
        run_dir = run(config)
        manifest = read_manifest(run_dir)
        assert manifest["fidelity"]["passed"], manifest["fidelity"]
        assert manifest["solver"]["not_converged"] == 0
        runs[where] = ds.dataset(str(run_dir / "deviations.parquet"), format="parquet").to_table().to_pandas()
    here, cpu = (frame.sort_values(list(ROW_KEY), ignore_index=True) for frame in (runs[device], runs["cpu"]))
    assert len(here) == len(cpu) > 0
    bound = (here["error_bound"] + cpu["error_bound"]) * (1 + cpu["rel_deviation"]) / cpu["lambda_norm"] + 1e-9
    assert bool(((here["rel_deviation"] - cpu["rel_deviation"]).abs() <= bound).all())


@pytest.mark.parametrize("device", DEVICES)
def test_every_vit_attention_trains_a_step_on_device(device):
    """One training step of a small ViT with each final-layer attention probe knows: finite loss and
    gradients on the device, and the loss the device computes equals the CPU's for the same weights."""
    from probe.vit.attention import MultiHeadAttention
    from probe.vit.model import ViT, ViTConfig

    images = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3])
    for kind in MultiHeadAttention.KINDS:
        torch.manual_seed(0)
        model = ViT(ViTConfig(dim=32, depth=2, heads=2, head_dim=16, mlp_dim=64, dropout=0.0, attention=kind))
        losses = {}
        for where in dict.fromkeys([device, "cpu"]):
            model = model.to(where)
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images.to(where)), labels.to(where))
            loss.backward()
            assert torch.isfinite(loss)
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
            losses[where] = loss.item()
        np.testing.assert_allclose(losses[device], losses["cpu"], rtol=1e-4, err_msg=kind)


@pytest.mark.parametrize("device", DEVICES)
def test_exact_attention_and_its_gradients_on_device_equal_the_cpus(device):
    """probe.solve.exact on the device: p* within both certificates of the CPU's, and the implicit gradients (one
    Newton-system solve each) equal the CPU's to 1e-8 relative, masked keys included."""
    from probe.solve.exact import exact_attention

    generator = torch.Generator().manual_seed(3)
    templates = torch.randn(2, 3, 9, 5, generator=generator, dtype=torch.float64)
    evidence = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
    log_u = torch.randn(2, 3, 9, generator=generator, dtype=torch.float64)
    log_u[0, 1, 4:] = -torch.inf
    weights = torch.randn(2, 3, 9, generator=generator, dtype=torch.float64)
    results = {}
    for where in dict.fromkeys([device, "cpu"]):
        inputs = [x.to(where).requires_grad_(True) for x in (templates, evidence, log_u)]
        p, certificate = exact_attention(*inputs, alpha=1.5, return_certificate=True)
        assert p.device.type == where and certificate.not_converged == 0
        (p * weights.to(where)).sum().backward()
        results[where] = (p.detach().cpu(), [x.grad.cpu() for x in inputs], certificate)
    (p_here, grads_here, _), (p_cpu, grads_cpu, _) = results[device], results["cpu"]
    torch.testing.assert_close(p_here, p_cpu, rtol=0, atol=1e-9)
    assert float(p_here[0, 1, 4:].abs().max()) == 0.0
    for here, cpu in zip(grads_here, grads_cpu):
        here, cpu = torch.nan_to_num(here, posinf=0.0, neginf=0.0), torch.nan_to_num(cpu, posinf=0.0, neginf=0.0)
        torch.testing.assert_close(here, cpu, rtol=1e-8, atol=1e-10)
