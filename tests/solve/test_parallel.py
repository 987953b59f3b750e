"""Independent pieces of tensor work run side by side (probe.solve.parallel): the answers do not depend on
how many threads compute them, errors and stops propagate, and a memory budget limits what runs at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest
import torch

import probe.solve.dual as solver
import probe.solve.parallel as parallel
from probe.capture.data import DatasetSpec
from probe.pipeline.runner import RunConfig, run
from probe.solve import newton_cg, tiles
from probe.solve.dual import DualSolution, solve_dual
from probe.solve.parallel import Lane, call_compiled, cpu_workers, run_all, without_gil

from ..support.solver_problems import random_groups, torch_loops


def _identical(a: DualSolution, b: DualSolution):
    for name, x in vars(a).items():
        y = getattr(b, name)
        assert torch.equal(torch.nan_to_num(x, nan=-7.0), torch.nan_to_num(y, nan=-7.0)), name


def test_solver_answers_do_not_depend_on_the_workers(monkeypatch):
    """Many small tiles (a small tile size) solved by 1, 2 and 3 threads: bitwise the same solution, with
    the padding queries and keys of the problems in place, and the problems themselves untouched."""
    monkeypatch.setitem(tiles.TILE_BYTES, "cpu", 16 * 24 * 8 * 10)  # 10 rows of 24 keys a tile
    problems = random_groups(groups=5, per_group=17, n=24, d=12, template_scale=0.5, logit_std=4.0, seed=3)
    given = {name: value.clone() for name, value in vars(problems).items() if isinstance(value, torch.Tensor)}
    one = solve_dual(problems, workers=1)
    assert bool(one.converged[problems.active].all())
    for workers in (2, 3):
        _identical(one, solve_dual(problems, workers=workers))
    for name, value in given.items():  # the tiles leave the caller's problems as they were
        assert torch.equal(getattr(problems, name), value), name


@pytest.mark.skipif(not hasattr(torch.jit, "script"), reason="this torch has no TorchScript")
def test_the_solver_loops_are_compiled_and_answer_as_their_python():
    """The compiled loops are TorchScript (a change that made them uncompilable would silently cost the
    parallel speed), and running their Python originals instead gives bitwise the same solutions, with
    and without the CG preconditioner (solve_spd_reduced)."""
    for compiled in newton_cg.COMPILED_LOOPS:
        assert isinstance(getattr(newton_cg, compiled), torch.jit.ScriptFunction), compiled
    problems = random_groups(groups=3, per_group=20, n=24, d=12, template_scale=0.7, logit_std=4.0, seed=5)
    factor = solver.factor_gram(problems.gram)
    weights = torch.softmax(problems.logits, -1)
    rhs = torch.randn(3, 20, factor.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch_loops():  # the torch loops, not the compiled kernel that runs them where it can
        fast = solve_dual(problems, workers=0), solver.solve_spd_reduced(factor, weights, rhs, 1.0)
        with pytest.MonkeyPatch.context() as patch:
            for module in (solver, newton_cg):  # wherever a compiled loop is called from
                for compiled, python in newton_cg.COMPILED_LOOPS.items():
                    if hasattr(module, compiled):
                        patch.setattr(module, compiled, getattr(newton_cg, python))
            slow = solve_dual(problems, workers=0), solver.solve_spd_reduced(factor, weights, rhs, 1.0)
    assert bool(fast[0].converged[problems.active].all())
    _identical(fast[0], slow[0])
    for x, y in zip(fast[1], slow[1]):
        assert torch.equal(x, y)


def test_without_gil_keeps_a_function_torchscript_cannot_compile():
    """A function outside the TorchScript subset comes back as itself, still working."""

    def uncompilable(x: torch.Tensor) -> torch.Tensor:
        try:  # try blocks are not TorchScript
            return x + 3.0
        except RuntimeError:
            return x

    assert without_gil(uncompilable) is uncompilable
    assert without_gil(uncompilable)(torch.ones(1)).item() == 4.0


def test_compiled_calls_on_a_cpu_skip_the_executors_optimisation():
    """On CPU tensors a compiled loop runs with the graph executor's optimisation off (its profiling runs cost
    the first calls of a process tens of milliseconds, and fuse nothing there), restored after the call; on
    another device (meta here) the setting is left as it is."""
    seen = []

    def record(*args):
        seen.append(torch._C._get_graph_executor_optimize())

    before = torch._C._get_graph_executor_optimize()
    call_compiled(record, 1.0, torch.ones(2))
    call_compiled(record, torch.ones(2, device="meta"))
    assert seen == [False, before] and torch._C._get_graph_executor_optimize() == before
    compiled = newton_cg.conjugate_gradient
    factor = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
    weights = torch.full((2, 1, 3), 1 / 3, dtype=torch.float64)
    rhs = torch.ones(2, 1, 3, dtype=torch.float64)
    args = (factor, 1.0, weights, rhs, torch.full((2, 1), 1e-12, dtype=torch.float64), 20,
            torch.ones(2, 1, dtype=torch.bool), None)
    assert torch.equal(call_compiled(compiled, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args]),
                       compiled(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))


def test_a_memory_budget_limits_the_tiles_in_flight(monkeypatch):
    """With a budget of one tile's working set, tiles are solved one at a time whatever the workers."""
    in_flight, most = [0], [0]
    lock = threading.Lock()
    original = solver._solve_tile

    def counting(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            time.sleep(0.01)
            return original(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(solver, "_solve_tile", counting)
    problems = random_groups(groups=4, per_group=9, n=16, d=8, template_scale=0.5, logit_std=2.0, seed=1)
    group_bytes = 9 * 16 * 16 * 8  # a group's working set: 9 rows of 16 keys
    monkeypatch.setitem(tiles.TILE_BYTES, "cpu", group_bytes)  # one group a tile
    budgeted = solve_dual(problems, workers=4, memory_budget_bytes=group_bytes)
    assert most[0] == 1
    most[0] = 0
    free = solve_dual(problems, workers=4, memory_budget_bytes=4 * group_bytes)  # the same tiles, all at once
    assert most[0] > 1
    _identical(budgeted, free)


def test_a_run_with_a_roomy_budget_solves_tiles_side_by_side(tiny_bert_dir, texts_file, tmp_path, monkeypatch,
                                                             request):
    """`--max-memory` computes the sites' own work one at a time, but the solver's tiles run as many at once
    as the budget holds: a budget far above a tile lets both threads' workers solve."""
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))  # the run sets its own
    seen = []
    original = solver.run_all

    def recording(jobs, workers):
        seen.append(workers)
        return original(jobs, workers)

    monkeypatch.setattr(solver, "run_all", recording)
    config = RunConfig(model=str(tiny_bert_dir), dataset=DatasetSpec(name=str(texts_file)), out=tmp_path,
                       batch_size=2, max_length=32, device="cpu", progress=False, threads=2,
                       max_memory_bytes=1 << 30)
    run(config)
    assert seen and max(seen) == 2


def test_run_all_keeps_order_uses_one_intra_op_thread_and_propagates_errors():
    seen = []

    def job(i):
        time.sleep(0.002 * (5 - i))  # finish out of order
        seen.append(torch.get_num_threads())
        return i * i

    assert run_all([lambda i=i: job(i) for i in range(5)], workers=3) == [0, 1, 4, 9, 16]
    assert set(seen) == {1}
    assert run_all([lambda i=i: job(i) for i in range(3)], workers=1) == [0, 1, 4]
    assert set(seen) == {1}  # one worker for a caller with several threads: still one thread per operation
    here = threading.get_ident()
    assert run_all([threading.get_ident] * 3, workers=0) == [here] * 3  # workers=0: in the caller's thread
    with torch.no_grad():  # grad mode is per thread: the workers take the caller's
        assert run_all([torch.is_grad_enabled] * 4, workers=2) == [False] * 4
    assert run_all([torch.is_grad_enabled] * 4, workers=2) == [True] * 4

    started = []

    def failing(i):
        started.append(i)
        if i == 0:
            raise ValueError("tile 0 failed")
        time.sleep(0.2)
        return i

    with pytest.raises(ValueError, match="tile 0 failed"):
        run_all([lambda i=i: failing(i) for i in range(40)], workers=2)
    time.sleep(0.5)
    assert len(started) < 40  # the jobs not yet started were cancelled (all of them would take 4 s)


def test_cpu_workers_follow_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert cpu_workers() == 3 and cpu_workers("cpu") == 3
        assert cpu_workers("meta") == 0  # any device that is not a CPU parallelises its own operations
    finally:
        torch.set_num_threads(threads)


def test_runs_on_one_and_two_threads_are_bitwise_identical(tiny_bert_dir, texts_file, tmp_path):
    """A whole run (capture, stacked solves, derived quantities side by side) on 1 and on 2 threads:
    the same rows, bitwise."""
    threads = torch.get_num_threads()
    frames = []
    try:
        for count in (1, 2):
            config = RunConfig(
                model=str(tiny_bert_dir), dataset=DatasetSpec(name=str(texts_file)), out=tmp_path / f"t{count}",
                batch_size=2, max_length=32, device="cpu", progress=False, threads=count, alphas=(0.5, 2.0),
            )
            frames.append(pd.read_parquet(run(config) / "deviations.parquet"))
    finally:
        torch.set_num_threads(threads)
    one, two = frames
    assert len(one) > 0
    pd.testing.assert_frame_equal(one, two, check_exact=True)


def test_a_thread_count_set_at_a_threads_start_survives_a_later_setting_elsewhere(request):
    """torch settles a new thread's intra-op count at its first operation, from the count last set in any
    thread: a worker (or the lane) whose thread started before the main thread set its own count must keep
    the count it was started with."""
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    pool = ThreadPoolExecutor(1, initializer=parallel._one_intra_op_thread)
    lane = Lane(threads=2)
    try:
        pool.submit(lambda: None).result()  # both threads started, no torch operation yet
        lane.submit(lambda: None).result()
        torch.set_num_threads(3)
        assert pool.submit(torch.get_num_threads).result() == 1
        assert lane.submit(torch.get_num_threads).result() == 2
    finally:
        pool.shutdown()
        lane.close()


def test_the_lane_runs_jobs_in_order_one_at_a_time_and_propagates_errors():
    lane = Lane(threads=2)
    try:
        running, order = [], []

        def job(i):
            running.append(i)
            assert len(running) == 1, "two jobs ran at once"
            time.sleep(0.01)
            order.append((i, torch.get_num_threads(), torch.is_grad_enabled()))
            running.remove(i)
            return i

        with torch.no_grad():  # the lane computes in the submitter's grad mode
            futures = [lane.submit(lambda i=i: job(i)) for i in range(4)]
        assert [future.result() for future in futures] == [0, 1, 2, 3]
        assert order == [(i, 2, False) for i in range(4)]  # in order, on the caller's thread count

        def failing():
            raise ValueError("stack failed")

        failed = lane.submit(failing)
        with pytest.raises(ValueError, match="stack failed"):
            failed.result()
        with pytest.raises(ValueError, match="stack failed"):  # or at the next submit, whichever comes first
            lane.submit(lambda: None)
    finally:
        lane.close()


@pytest.mark.parametrize("stack_bytes", [None, 20_000])
def test_runs_with_and_without_the_lane_are_bitwise_identical(tiny_bert_dir, texts_file, tmp_path, monkeypatch,
                                                              request, stack_bytes):
    """Each batch's last stack solved in the background while the next batch is captured: the same rows,
    bitwise, as solving it before the next batch starts; also with stacks small enough that several fill
    (and are solved at once) while the model runs."""
    import probe.batch.rows as rows
    import probe.pipeline.runner as pipeline

    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))  # the runs set their own

    if stack_bytes is not None:
        monkeypatch.setattr(rows, "STACK_BYTES", stack_bytes)
    lanes = []

    def counting_lane(threads):
        lanes.append(Lane(threads))
        return lanes[-1]

    frames = []
    for name, lane in (("lane", counting_lane), ("none", lambda threads: None)):
        monkeypatch.setattr(pipeline, "Lane", lane)
        config = RunConfig(
            model=str(tiny_bert_dir), dataset=DatasetSpec(name=str(texts_file)), out=tmp_path / name,
            batch_size=2, max_length=32, device="cpu", progress=False, alphas=(0.5, 2.0), threads=2,
        )
        frames.append(pd.read_parquet(run(config) / "deviations.parquet"))
    assert len(lanes) == 1 and lanes[0].last is not None  # the first run did solve in its lane
    monkeypatch.setattr(pipeline, "Lane", counting_lane)
    config = RunConfig(model=str(tiny_bert_dir), dataset=DatasetSpec(name=str(texts_file)), out=tmp_path / "one",
                       batch_size=2, max_length=32, device="cpu", progress=False, threads=1)
    run(config)
    assert len(lanes) == 1  # one thread: no lane (capture and solves would only take turns on it)
    with_lane, without = frames
    assert len(with_lane) > 0 and with_lane["example"].nunique() > 2  # several batches
    pd.testing.assert_frame_equal(with_lane, without, check_exact=True)
