r"""The solver's Newton iterations as compiled C (``probe/solve/newton.c``), built on first use, with the
second order's factorisations per interval of keys (``probe/solve/intervals.c``).

On a CPU, most of a solve's time in batched torch operations goes to elementwise passes over tensors
too large for the cache, and to the overhead of issuing them.  ``newton.c`` runs the method of
:mod:`probe.solve.newton_cg` over blocks of a few dozen rows at a time, so that each block's elementwise
work is fused into a few loops over data in cache, with the products by the BLAS torch itself uses.  It
forms each product in the precision the row needs at that point: float32 while the row is far from its
goal, float64 from there on (the comment at the top of ``newton.c``).

It is built once per machine with the system's C compiler (``$CC``, else ``cc``) into a cache directory
(``$PROBE_CACHE_DIR``, else ``~/.cache/probe``), and used only where it can be trusted: a CPU, torch's
BLAS found (its ``sgemm_``/``dgemm_``) and checked on a small product.  Anywhere else, or with
``PROBE_NATIVE=0``, the solver runs its torch loops, with one warning saying why.

The kernel writes each row's solution and certificate, formed from a fresh float64 state at the row's
final iterate (:math:`\theta = \log u + \alpha s + Ay` by one product from the returned :math:`y`), so that
its iterations decide where a row ends and not what is certified about it.  Rows it leaves above their
goal are continued by the torch loops from its iterates.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from probe.core import environment
from probe.solve.problems import shares_rows

__all__ = ["FLOPS", "newton_tile", "interval_solve", "intervals_available", "available", "unavailable_reason",
           "describe", "block_rows"]

SOURCES = [Path(__file__).with_name(name) for name in ("newton.c", "intervals.c")]
#: -fopenmp-simd: the loops' ``omp simd`` reductions vectorise without -ffast-math (which would drop
#: the -inf handling the softmaxes need); libmvec supplies the vector exp
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared"]
LIBRARIES = ["-lmvec", "-lm"]

_lock = threading.Lock()
_state: dict = {}

#: the flops of the kernel's matrix products since the process started, by precision, with those of the
#: factorisations per interval of keys (float64; a counter the benchmarks read: their BLAS and LAPACK calls are
#: invisible to torch's flop counter)
FLOPS = {"float32": 0.0, "float64": 0.0}


def _cpu_signature() -> str:
    """What the built library depends on besides its source: the CPU's instruction set (-march=native)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _cache_dir() -> Path:
    return environment.cache_dir() / "native"


def _build() -> Path:
    """The compiled library, built if this source, compiler and CPU have none in the cache yet."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} is not on PATH; set CC to one)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        "\0".join([*(source.read_text() for source in SOURCES), compiler, version, " ".join(FLAGS + LIBRARIES),
                   _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"newton-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(target.parent, os.W_OK)
    except OSError:
        writable = False
    if not writable:  # no writable cache: built for this process only, in a temporary directory
        target = Path(tempfile.mkdtemp(prefix="probe-native-")) / target.name
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # concurrent builds: last rename wins
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), *LIBRARIES], capture_output=True, text=True,
            timeout=300,
        )
        if result.returncode != 0:
            names = ", ".join(source.name for source in SOURCES)
            raise RuntimeError(f"{compiler} failed to build {names}: {result.stderr.strip()[-500:]}")
        os.replace(built, target)
    return target


def _torch_cpu():
    """torch's own CPU library, which carries its BLAS and LAPACK."""
    lib_dir = Path(torch.__file__).parent / "lib"
    names = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib"}
    path = lib_dir / names.get(sys.platform, "")
    if not path.is_file():
        raise RuntimeError(f"torch's CPU library was not found at {path}")
    return ctypes.CDLL(str(path))


def _blas():
    """Addresses of torch's own ``sgemm_``/``dgemm_`` (and MKL's per-thread thread count, if present)."""
    torch_cpu = _torch_cpu()
    try:
        sgemm, dgemm = torch_cpu.sgemm_, torch_cpu.dgemm_
    except AttributeError as error:
        raise RuntimeError("torch's CPU library exports no Fortran BLAS (sgemm_, dgemm_)") from error
    address = lambda function: ctypes.cast(function, ctypes.c_void_p).value  # noqa: E731
    threads = getattr(torch_cpu, "MKL_Set_Num_Threads_Local", None)  # the C interface (by value)
    return address(sgemm), address(dgemm), address(threads) if threads is not None else None


def _lapack():
    """Addresses of torch's own LAPACK ``dpotrf_``/``dpotrs_``, or None where its library exports none."""
    torch_cpu = _torch_cpu()
    potrf, potrs = getattr(torch_cpu, "dpotrf_", None), getattr(torch_cpu, "dpotrs_", None)
    if potrf is None or potrs is None:
        return None
    return ctypes.cast(potrf, ctypes.c_void_p).value, ctypes.cast(potrs, ctypes.c_void_p).value


def _load_intervals(library, threads):
    """``probe_interval_solve`` with torch's ``dpotrf_``/``dpotrs_`` (and MKL's per-thread thread count, as the
    kernel's, or None), or None without them."""
    try:
        lapack = _lapack()
    except (OSError, RuntimeError):
        lapack = None
    if lapack is None:
        return None
    function = library.probe_interval_solve
    function.restype = ctypes.c_int
    P, I = ctypes.c_void_p, ctypes.c_int
    # g, n, r, A; count, group, start, stop, offset; b; alpha; info; counted flops; dpotrf, dpotrs, threads
    function.argtypes = [I, I, I, P, I, P, P, P, P, P, ctypes.c_double, P, P, P, P, P]
    return function, *lapack, threads


class _Library(NamedTuple):
    """The loaded library: the Newton kernel, its block sizing, torch's BLAS (sgemm, dgemm, MKL's thread count)
    and the interval solve with its LAPACK (None without one)."""

    newton_tile: object
    block_bytes: object
    blas: tuple
    intervals: tuple | None


def _load() -> _Library:
    library = ctypes.CDLL(str(_build()))
    function = library.probe_newton_tile
    function.restype = ctypes.c_int
    P, I, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    # g, m, n, r, block rows; A, A32, base, u; shared; logits, mvec, esq, active; alpha, rtol, atol;
    # max_iter; eps, forcing floor; outputs, counted flops, sgemm, dgemm, threads
    function.argtypes = [I] * 5 + [P] * 4 + [I] + [P] * 4 + [D] * 3 + [I] + [D] * 2 + [P] * 5
    size = library.probe_block_bytes
    size.restype = ctypes.c_size_t
    size.argtypes = [I, I, I]
    check = library.probe_check_blas
    check.restype = ctypes.c_double
    check.argtypes = [P, P]
    sgemm, dgemm, threads = _blas()
    error = check(sgemm, dgemm)
    if not error < 1e-6:  # NaN included
        raise RuntimeError(f"torch's BLAS did not compute a small product as expected (error {error})")
    return _Library(function, size, (sgemm, dgemm, threads), _load_intervals(library, threads))


def _kernel():
    """The loaded kernel, or None (with the reason in ``_state["reason"]``, warned about once)."""
    if "kernel" in _state:
        return _state["kernel"]
    with _lock:
        if "kernel" not in _state:
            kernel, reason = None, None
            if not environment.native_kernel_allowed():
                reason = "PROBE_NATIVE=0"
            else:
                try:
                    kernel = _load()
                except Exception as error:  # noqa: BLE001 - any failure leaves the torch loops, said once
                    reason = str(error) or type(error).__name__
                    warnings.warn(
                        f"probe: the compiled solver kernel is not available ({reason}); the solver runs its "
                        "torch loops instead, several times slower on a CPU. Install a C compiler (or set CC) to use it.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            _state["kernel"], _state["reason"] = kernel, reason
    return _state["kernel"]


def available() -> bool:
    """Whether :func:`newton_tile` runs the compiled kernel (building it if needed)."""
    return _kernel() is not None


def unavailable_reason() -> str | None:
    """Why the kernel is not used (None when it is)."""
    _kernel()
    return _state.get("reason")


def describe(device) -> str:
    """How the solver's Newton iterations run on ``device``, for a run's manifest."""
    if torch.device(device).type != "cpu":
        return "torch loops (not a CPU)"
    if available():
        return "compiled C kernel (probe/solve/newton.c), certifying each row from a fresh float64 state"
    return f"torch loops (the compiled kernel is not available: {unavailable_reason()})"


#: the working set of a block of rows: large enough for the products over its rows to run near the BLAS's
#: full rate (at 1 MiB, a block of 22 rows at 512 keys took 1.25x as long), small enough for two workers'
#: blocks to stay in a shared L3 cache
BLOCK_BYTES = 12 << 20


def block_rows(n: int, r: int) -> int:
    """Rows per block: about :data:`BLOCK_BYTES` of the kernel's working set, as the kernel itself counts it
    (``probe_block_bytes``), and 16 to 256 rows."""
    bytes_of = _kernel().block_bytes
    per_row = bytes_of(n, r, 2) - bytes_of(n, r, 1)
    return max(16, min(256, BLOCK_BYTES // max(1, per_row)))


def newton_tile(work, active: torch.Tensor, rtol: float, atol: float, max_iter: int, forcing_floor: float, out):
    """Newton-CG (:mod:`probe.solve.newton_cg`'s method) on every active problem of a tile by the compiled
    kernel, which writes each row's solution and certificate into ``out`` (the tile's
    :class:`probe.solve.problems.DualSolution`; NaN, no iterations and not converged for inactive rows) and
    returns the
    iterates ``y`` ``(g, m, r)``; or None where the kernel does not apply (not a CPU, not float64 with
    float32 directions, or not available), with ``out`` untouched.  ``work`` is the tile's
    :class:`probe.solve.newton_cg.WorkingSet`."""
    A = work.A
    if A.device.type != "cpu" or A.dtype != torch.float64 or work.A_low.dtype != torch.float32:
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    function, (sgemm, dgemm, threads) = kernel.newton_tile, kernel.blas
    g, m, n = work.base.shape
    r = A.shape[-1]
    if g * m == 0 or n == 0 or r == 0:
        return None
    shared = shares_rows(work.u) and shares_rows(work.m)
    u, mvec = (work.u[:, :1], work.m[:, :1]) if shared else (work.u, work.m)
    inputs = [t.contiguous() for t in (A, work.A_low, work.base, u, work.logits, mvec, work.evidence_sqnorm)]
    flags = active.to(torch.uint8).contiguous()
    y = torch.empty(g, m, r, dtype=torch.float64)
    targets = [y, out.attention, out.coefficients, out.correction, out.lambda_norm, out.rel_deviation,
               out.duality_gap, out.error_bound, out.iterations, out.converged]
    written = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format) for t in targets]
    pointers = (ctypes.c_void_p * len(written))(*(t.data_ptr() for t in written))
    counted = (ctypes.c_double * 2)(0.0, 0.0)
    A_, A32, base, u, logits, mvec, esq = inputs
    status = function(
        g, m, n, r, block_rows(n, r), A_.data_ptr(), A32.data_ptr(), base.data_ptr(), u.data_ptr(), int(shared),
        logits.data_ptr(), mvec.data_ptr(), esq.data_ptr(), flags.data_ptr(), float(work.alpha), float(rtol),
        float(atol), int(max_iter), torch.finfo(torch.float64).eps, float(forcing_floor), pointers, counted, sgemm,
        dgemm, threads,
    )
    if status != 0:
        return None
    with _lock:
        FLOPS["float32"] += counted[0]
        FLOPS["float64"] += counted[1]
    for target, copy in zip(targets, written):
        if copy is not target:
            target.copy_(copy)
    return y


def intervals_available(a: torch.Tensor) -> bool:
    """Whether :func:`interval_solve` runs for the factor ``a`` (a float64 CPU tensor, the kernel and torch's
    LAPACK available)."""
    if a.device.type != "cpu" or a.dtype != torch.float64:
        return False
    kernel = _kernel()
    return kernel is not None and kernel.intervals is not None


def interval_solve(a: torch.Tensor, group: torch.Tensor, start: torch.Tensor, stop: torch.Tensor,
                   offset: torch.Tensor, rhs: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    r"""Solve :math:`H_u x = b` for rows whose :math:`u` is uniform over an interval of keys, one Cholesky
    factorisation of :math:`H_u = I/\alpha + S/k - \bar a\bar a^\top` per interval (``probe/solve/intervals.c``;
    :func:`probe.solve.second_order.second_order_point` certifies the answers).

    Args:
        a: the factor's rows :math:`a_i`, ``(g, n, r)`` float64 on a CPU.
        group: each interval's group ``(C,)``; the intervals sorted by group, then start, then stop.
        start: each interval's first key ``(C,)``.
        stop: the key after each interval's last ``(C,)``.
        offset: ``(C + 1,)``: the rows ``offset[c]`` to ``offset[c + 1]`` of ``rhs`` are interval ``c``'s.
        rhs: the right-hand sides :math:`b`, ``(R, r)`` float64, gathered interval by interval.
        alpha: :math:`\alpha`.

    Returns:
        ``(x, solved)``: :math:`\hat x` ``(R, r)`` and whether each interval's rows were solved ``(C,)`` bool
            (its factorisation succeeded); or None where the compiled code does not apply (not a CPU, not
            float64, or no kernel or LAPACK).
    """
    if not intervals_available(a):
        return None
    function, potrf, potrs, threads = _kernel().intervals
    g, n, r = a.shape
    a = a.contiguous()
    group, start, stop, offset = (t.to(torch.int64).contiguous() for t in (group, start, stop, offset))
    x = rhs.to(torch.float64).contiguous().clone()
    info = torch.empty(len(group), dtype=torch.int32)
    counted = (ctypes.c_double * 1)(0.0)
    status = function(g, n, r, a.data_ptr(), len(group), group.data_ptr(), start.data_ptr(), stop.data_ptr(),
                      offset.data_ptr(), x.data_ptr(), float(alpha), info.data_ptr(), counted, potrf, potrs, threads)
    if status != 0:
        return None
    with _lock:
        FLOPS["float64"] += counted[0]
    return x, info == 0
