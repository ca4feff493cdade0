"""Fused CPU kernels (`kernels.c`): one pass over a chunk applies the pending update and writes every
working copy of the step. (The same library decodes a quantized base's int8 and NF4 weights in one
pass, `decode_int8` / `decode_nf4`, for distzo.models.decode.)

torch runs each elementwise operation as its own pass over a chunk. For a step that is about six
passes (hash the stream, turn its words into z, scale it, update, two copies), each reading and
writing megabytes, where one pass would do. `kernels.c` does the whole chunk in one pass, and z never
touches memory (Gaussian and Rademacher z are counter streams, `distzo.zo.streams`, generated in
the pass). It performs the same floating-point operations on every element as the torch path, so the
two agree bitwise (`tests/unit/test_native.py`). The result of a run never depends on
whether the kernels were used.

The library is built on first use by torch's extension builder (`torch.utils.cpp_extension.load`:
the system compiler, $CXX or c++, driven by ninja) into the cache (`<cache>/native/<hash>/`, the
hash covering the source and the flags); the builder locks the directory, so ranks that start
together build it once. It takes under a second (docs/performance.md). The library is plain C with C
linkage, loaded with ctypes, which releases the GIL during a call, so the noise threads run kernels
in parallel. When it is loaded, a self-check compares it with the torch implementation of the
same values.

`engine.native`: `auto` uses the kernels where they apply (CPU, float32 masters) and falls back
to torch ops, with one warning, where they cannot be built. `true` makes that an error. `false`
always uses torch ops (for comparison). On CUDA the same switch selects the Triton chunk kernel
(`distzo.native.cuda`: sgd's update and a query's copies in one pass, float32, float16 and bfloat16
masters).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from ..cache import cache_dir
from ..config.schema import SWITCH_VALUES, switch
from ..errors import DistzoError
from ..registry import registry  # the optimizers' update rules, which the kernels reproduce (their `kernel` cases)
from ..zo.optimizers import CURVATURE  # the coefficient entry a HiZOO rule's constants read
from ..zo.streams import (  # the streams' definitions, which the kernels reproduce
    Stream,
    stream_values,
)
from . import cuda
from .cuda import CudaKernels

log = logging.getLogger("distzo")

SOURCE = Path(__file__).with_name("kernels.c")
NAME = "distzo_kernels"
# -ffp-contract=off: no fused multiply-adds (they would round `x * decay - z` once, not twice).
# -fno-math-errno: sqrtf need not set errno, so its loops vectorise (the values are the same).
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno")


class NativeUnavailable(DistzoError):
    """The fused kernels cannot be built or loaded here; the message says why."""


# A noise source of one chunk: a counter stream, or the chunk's pre-drawn, pre-scaled values
# (float32, contiguous, indexed by the chunk's elements).
Source = Stream | torch.Tensor


class _CSource(ctypes.Structure):
    _fields_ = [("values", ctypes.c_void_p), ("seed", ctypes.c_uint64), ("scale", ctypes.c_float),
                ("gaussian", ctypes.c_int32)]


def _check_f32(t: torch.Tensor, what: str, min_numel: int) -> None:
    # The kernels see raw pointers: refuse anything that is not exactly what they assume.
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < min_numel:
        raise ValueError(f"{what}: needs a contiguous float32 CPU tensor of >= {min_numel} elements, got "
                         f"{t.dtype} on {t.device}, {t.numel()} elements, contiguous={t.is_contiguous()}")


def _check(t: torch.Tensor, dtype: torch.dtype, numel: int, what: str) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"{what}: needs a contiguous {dtype} CPU tensor of {numel} elements, got {t.dtype} on "
                         f"{t.device}, {t.numel()} elements, contiguous={t.is_contiguous()}")


DECODED_DTYPES = (torch.float32, torch.bfloat16)  # what the decode kernels write


def _check_decoded(out: torch.Tensor) -> None:
    if out.dtype not in DECODED_DTYPES or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out: needs a contiguous float32 or bfloat16 CPU tensor, got {out.dtype} on {out.device}, "
                         f"contiguous={out.is_contiguous()}")


class Kernels:
    """Typed entry points of the loaded library. Arguments are checked before any pointer is passed."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, f32, i32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
        lib.distzo_stream_fill.argtypes = [ptr, i64, ctypes.c_uint64, i64, f32, i32]
        lib.distzo_stream_rows.argtypes = [ptr, i64, i64, ptr, ptr, f32, i32]
        lib.distzo_chunk_rule.argtypes = [ptr, i64, i64, i32, ptr, ptr, ptr, i32, f32, i32, ptr, ptr, i32, ptr, i32,
                                          ptr, ptr, ptr, i32, f32]
        lib.distzo_decode_int8.argtypes = [ptr, ptr, i64, i64, ptr, i32]
        lib.distzo_decode_nf4.argtypes = [ptr, ptr, ptr, ptr, f32, i64, i64, i64, ptr, i32]
        for fn in (lib.distzo_stream_fill, lib.distzo_stream_rows, lib.distzo_chunk_rule, lib.distzo_decode_int8,
                   lib.distzo_decode_nf4):
            fn.restype = None
        self._lib = lib

    def decode_int8(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[r, c] = q[r, c] * scale[r] in float32 (a symmetric per-row int8 weight's dequantization),
        rounded to bfloat16 for a bfloat16 `out`: q int8 [rows, cols], scale float32 with one value a
        row, out float32 or bfloat16 of q's elements."""
        _check_decoded(out)
        rows = scale.numel()
        _check(q, torch.int8, out.numel(), "int8 values")
        _check(scale, torch.float32, rows, "int8 scales")
        if rows == 0 or q.numel() % rows:
            raise ValueError(f"decode_int8: {q.numel()} values do not make {rows} rows")
        self._lib.distzo_decode_int8(q.data_ptr(), scale.data_ptr(), rows, q.numel() // rows, out.data_ptr(),
                                     int(out.dtype == torch.bfloat16))
        return out

    def decode_nf4(self, packed: torch.Tensor, lut: torch.Tensor, qscaler: torch.Tensor, factor: torch.Tensor,
                   mean: float, group: int, scaler_group: int, out: torch.Tensor) -> torch.Tensor:
        """An NF4 weight in float32 (torchao's get_original_weight): block b of `group` weights has the
        scaler qscaler[b] / factor[b // scaler_group] + mean, and its element 2j is lut[high nibble of
        byte j] times it, element 2j + 1 lut[low nibble] times it; float32, or rounded to bfloat16 for a
        bfloat16 `out`."""
        _check_decoded(out)
        n = out.numel()
        if group <= 0 or group % 2 or n % group or scaler_group <= 0 or (n // group) % scaler_group:
            raise ValueError(f"decode_nf4: {n} weights in blocks of {group}, scalers in groups of {scaler_group}")
        _check(packed, torch.uint8, n // 2, "NF4 codes")
        _check(lut, torch.float32, 16, "NF4 table")
        _check(qscaler, torch.int8, n // group, "NF4 quantized scalers")
        _check(factor, torch.float32, n // group // scaler_group, "NF4 scaler factors")
        self._lib.distzo_decode_nf4(packed.data_ptr(), lut.data_ptr(), qscaler.data_ptr(), factor.data_ptr(), mean,
                                    n, group, scaler_group, out.data_ptr(), int(out.dtype == torch.bfloat16))
        return out

    def stream_fill(self, out: torch.Tensor, stream: Stream, offset: int = 0) -> torch.Tensor:
        """out = elements [offset, offset + out.numel()) of the stream, times its scale."""
        _check_f32(out, "out", 0)
        self._lib.distzo_stream_fill(out.data_ptr(), out.numel(), stream.seed, offset, stream.scale,
                                     int(stream.gaussian))
        return out

    def stream_rows(self, out: torch.Tensor, seeds: Sequence[int], offsets: Sequence[int], scale: float,
                    gaussian: bool = False) -> torch.Tensor:
        """Row r of out ([rows, row_numel]) = the stream of seed seeds[r] (of unit scale, times `scale`)
        from element offsets[r]."""
        rows = len(seeds)
        if out.dim() != 2 or out.shape[0] != rows or len(offsets) != rows:
            raise ValueError(f"stream_rows: out {tuple(out.shape)} for {rows} seeds and {len(offsets)} offsets")
        _check_f32(out, "out", 0)
        c_seeds = (ctypes.c_uint64 * rows)(*seeds)
        c_offsets = (ctypes.c_int64 * rows)(*offsets)
        self._lib.distzo_stream_rows(out.data_ptr(), rows, out.shape[1], c_seeds, c_offsets, scale, int(gaussian))
        return out

    def chunk(self, master: torch.Tensor, rule: int, constants: Sequence[float], state: Sequence[torch.Tensor] = (),
              offset: int = 0, decay: float | None = None, terms: Sequence[tuple[Source, bool]] = (),
              queries: Sequence[Source] = (), outs: Sequence[tuple[torch.Tensor, int, int]] = (),
              mask_threshold: float | None = None) -> None:
        """One pass over `master`, which holds chunk elements [offset, offset + master.numel()): an
        optimizer's update (its kernel case `rule`, its float32 `constants`, its `state` tensors over
        the same elements), then the copies: for each (out, q, sign) of outs, out = x + z_q if
        sign > 0 else x - z_q, with z_q = queries[q] and x the updated values. Terms are (z, add):
        a_k z_k enters as +z when add, -z otherwise. A rule that is not separable needs every term
        of its update in this one call; sgd's (rule 0) with no decay and no terms writes copies only.
        mask_threshold: z reaches only elements with |x| <= it (the master's value before the update
        for a term, the updated value for a copy; Sparse MeZO), None: every element."""
        n = master.numel()
        for t in state:
            _check_f32(t, "optimizer state", n)
            if t.numel() != n:
                raise ValueError(f"optimizer state of {t.numel()} elements for a master of {n}")
        expected = kernel_signature(rule)  # (constants, state tensors)
        if expected is None or (len(constants), len(state)) != expected:
            raise ValueError(f"rule {rule} with {len(constants)} constants and {len(state)} state tensors")
        a = self._arguments(master, offset, terms, queries, outs)
        c_consts = (ctypes.c_float * max(1, len(constants)))(*constants)
        ptrs = [t.data_ptr() for t in state] + [None] * (2 - len(state))
        self._lib.distzo_chunk_rule(master.data_ptr(), n, offset, rule, c_consts, ptrs[0], ptrs[1],
                                    int(decay is not None), 1.0 if decay is None else decay, *a.terms, *a.copies,
                                    int(mask_threshold is not None),
                                    0.0 if mask_threshold is None else float(mask_threshold))

    def _arguments(self, master: torch.Tensor, offset: int, terms: Sequence[tuple[Source, bool]],
                   queries: Sequence[Source], outs: Sequence[tuple[torch.Tensor, int, int]]) -> _Arguments:
        """The ctypes arguments of a chunk call's terms and copies, every tensor checked first."""
        n = master.numel()
        _check_f32(master, "master", 0)
        keep = []  # tensors whose pointers the call uses

        def c_source(s: Source) -> _CSource:
            if isinstance(s, Stream):
                return _CSource(None, s.seed, s.scale, int(s.gaussian))
            _check_f32(s, "pre-drawn values", offset + n)
            keep.append(s)
            return _CSource(s.data_ptr(), 0, 0.0, 0)

        c_terms = (_CSource * max(1, len(terms)))(*[c_source(s) for s, _ in terms])
        c_add = (ctypes.c_int * max(1, len(terms)))(*[int(add) for _, add in terms])
        c_queries = (_CSource * max(1, len(queries)))(*[c_source(s) for s in queries])
        for out, q, _ in outs:
            _check_f32(out, "working copy", n)
            if out.numel() != n or not 0 <= q < len(queries):
                raise ValueError(f"working copy of {out.numel()} elements for query {q}: expected {n} elements "
                                 f"and a query below {len(queries)}")
        c_outs = (ctypes.c_void_p * max(1, len(outs)))(*[out.data_ptr() for out, _, _ in outs])
        c_query = (ctypes.c_int * max(1, len(outs)))(*[q for _, q, _ in outs])
        c_sign = (ctypes.c_int * max(1, len(outs)))(*[1 if sign > 0 else -1 for _, _, sign in outs])
        return _Arguments((len(terms), c_terms, c_add), (len(queries), c_queries, len(outs), c_outs, c_query, c_sign),
                          keep)


@functools.cache  # called for every chunk; the kernel cases are fixed by kernels.c
def kernel_signature(rule: int) -> tuple[int, int] | None:
    """(constants, state tensors) of the optimizer whose kernel case is `rule` (None: no such case)."""
    for _, cls in registry("optimizer").items():
        if cls.kernel == rule:
            return len(cls().rule(0, 1.0, 0.0).constants), len(cls.slots)
    return None


class _Arguments(NamedTuple):
    terms: tuple
    copies: tuple
    keep: list  # the tensors whose pointers the call passes, alive until it returns


def compiler() -> str:
    """The compiler torch's extension builder runs: $CXX, else c++."""
    return os.environ.get("CXX", "").strip() or "c++"


def _build_error(output: str) -> str:
    """The line of a failed build's output that says what went wrong: its first line with `error:`
    or `not found` (the last line is often just "compilation terminated."), else its last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line or "not found" in line]
    return (errors or lines[-1:] or ["no output"])[0]


def build_dir() -> Path:
    """Where the library built from this source with these flags is cached: the directory name hashes
    the source, the flags and the machine, so a changed source builds anew and never loads a stale
    library. The compiler is not part of the key: a library built on a login node serves compute
    nodes without one (the self-check at load time vouches for it)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), platform.machine().encode()):
        digest.update(part)
    return cache_dir() / "native" / digest.hexdigest()[:16]


def _built_library() -> Path:
    """The cached library for this source, built first if missing. torch's extension builder
    (`torch.utils.cpp_extension.load`, with ninja) compiles it, skips the build when the cached one is
    current, and holds a lock in the build directory, so ranks starting together build it once."""
    import io
    from contextlib import redirect_stdout

    try:
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        library = directory / f"{NAME}.so"
        if library.is_file():
            return library  # built before (possibly on another machine of the same kind)
        from torch.utils import cpp_extension

        if len(compiler().split()) > 1:  # the builder quotes $CXX as one program name
            raise NativeUnavailable(f"CXX={compiler()!r} is a command line, but torch's extension builder runs CXX "
                                    "as a single program; set CXX to the compiler's path (for ccache, use its "
                                    "compiler symlinks)")
        log.info("Compiling the fused kernels with %s (once, into %s)", compiler(), directory)
        # The builder remembers, per process, the name it last built and bumps the library's file name
        # (NAME_v1.so, ...) when the same name is built again with other inputs (another cache
        # directory); forget the earlier build so the library keeps the one name this module loads.
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(NAME, None)
        output = io.StringIO()
        with redirect_stdout(output):  # the builder prints its progress
            cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=list(FLAGS),
                               build_directory=str(directory), is_python_module=False, is_standalone=False,
                               verbose=False)
    except PermissionError as exc:
        raise _cache_error(exc) from exc
    except OSError as exc:  # read-only cache, no home directory, ...
        raise _cache_error(exc) from exc
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        detail = _build_error(f"{getattr(exc, 'output', '') or ''}\n{exc}")
        if "Ninja is required" in str(exc):
            raise NativeUnavailable("the ninja build tool is missing; pip install ninja") from exc
        raise NativeUnavailable(f"building {SOURCE.name} with {compiler()} failed: {detail}; install a C/C++ "
                                "compiler or set CXX") from exc
    if not library.is_file():
        raise NativeUnavailable(f"building {SOURCE.name} left no {library}")
    return library


def self_check(kernels: Kernels) -> None:
    """Compare the library with the torch implementation on a few awkward ranges, and its decode of a
    quantized base with the torch formula (a miscompiled or stale library must not silently change a
    run's directions or weights)."""
    for seed, offset, n, scale in ((7, 0, 1000, 1.0), (2**64 - 5, 61, 300, 3.7e-4), (12345, 8, 77, 0.5)):
        for gaussian in (False, True):
            stream = Stream(seed, scale, gaussian)
            if not torch.equal(kernels.stream_fill(torch.empty(n), stream, offset), stream_values(stream, offset, n)):
                raise NativeUnavailable(f"{kernels.path} disagrees with the torch reference; delete it to rebuild")
    master = torch.linspace(-1, 1, 513)
    values = torch.linspace(0.5, -0.25, 520)
    plus = torch.empty(513)
    first_of_case = {}  # every kernel case once, with the first optimizer that has it (fzoo has sgd's)
    for _, c in registry("optimizer").items():
        if c.kernel is not None:
            first_of_case.setdefault(c.kernel, c)
    for cls in first_of_case.values():
        opt = cls()
        rule = opt.rule(2, 1e-3, 0.0, ((0, 0.5), (1, -0.25), (CURVATURE, 3.0)))  # HiZOO's reads the curvature
        state = [torch.linspace(0.5, 1.5, 513) for _ in range(rule.slots)]
        got, got_state = master.clone(), [t.clone() for t in state]
        terms = [(Stream(5, 2e-3, True), False), (values, False), (Stream(3, 1e-3), True)][:opt.max_terms]
        kernels.chunk(got, rule.kernel, rule.constants, got_state, offset=7, decay=0.75, terms=terms,
                      queries=[Stream(9, 0.25, True)], outs=[(plus, 0, 1)])
        want = master.clone()
        rule.apply(want, state, [(stream_values(Stream(5, 2e-3, True), 7, 513), False), (values[7:520], False),
                                 (stream_values(Stream(3, 1e-3), 7, 513), True)][:opt.max_terms], 0.75)
        z = stream_values(Stream(9, 0.25, True), 7, 513)
        if opt.shapes_directions:
            z = opt.perturbation(z, state)
        if not (torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_state, state))
                and torch.equal(plus, want + z)):
            raise NativeUnavailable(f"{kernels.path} disagrees with the torch reference; delete it to rebuild")
    q = (torch.arange(768) % 256 - 128).to(torch.int8).view(3, 256)  # a quantized base's decode
    scale = torch.tensor([1e-3, 0.37, 2.5])
    packed = torch.arange(256, dtype=torch.uint8).repeat(2)  # 1,024 NF4 weights: 16 blocks of 64
    lut, qscaler = torch.linspace(-1, 1, 16), (torch.arange(16) * 13 - 100).to(torch.int8)
    factor, mean = torch.tensor([3.3, 0.7, 12.0, 0.01]), 0.015625  # 4 scalers a factor
    codes = torch.stack([packed >> 4, packed & 15], dim=1).view(-1).long()
    scaler = (qscaler.float().view(4, 4) / factor[:, None]).view(-1) + mean
    int8_want, nf4_want = (q.float() * scale[:, None]).view(-1), (lut[codes].view(16, 64) * scaler[:, None]).view(-1)
    for dtype in (torch.float32, torch.bfloat16):
        if not (torch.equal(kernels.decode_int8(q, scale, torch.empty(768, dtype=dtype)), int8_want.to(dtype))
                and torch.equal(kernels.decode_nf4(packed, lut, qscaler, factor, mean, 64, 4,
                                                   torch.empty(1024, dtype=dtype)), nf4_want.to(dtype))):
            raise NativeUnavailable(f"{kernels.path} disagrees with the torch reference; delete it to rebuild")


_loaded: dict[str, Kernels | NativeUnavailable] = {}  # "kernels": this process's outcome of loading them
_warned: list[NativeUnavailable] = []


def _cache_error(exc: Exception) -> NativeUnavailable:
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if getattr(exc, "filename", None):
        detail += f": {exc.filename}"
    return NativeUnavailable(f"the kernel cache is unusable ({detail}); set DISTZO_CACHE to a writable directory")


def _load() -> Kernels:
    if "kernels" not in _loaded:
        try:
            path = _built_library()
            try:
                kernels = Kernels(path)
            except OSError as exc:
                raise NativeUnavailable(f"cannot load {path} ({exc}); delete it to rebuild") from exc
            self_check(kernels)
            _loaded["kernels"] = kernels
        except NativeUnavailable as exc:
            _loaded["kernels"] = exc
    found = _loaded["kernels"]
    if isinstance(found, NativeUnavailable):
        raise found
    return found


def load(mode: str = "auto", device: torch.device | str = "cpu") -> Kernels | CudaKernels | None:
    """The fused kernels for engine.native=`mode` on `device`: the C library on CPU, the Triton chunk
    kernel on CUDA (`distzo.native.cuda`), or None where torch ops run instead (`false`, another
    device, or `auto` without a compiler). `true` raises NativeUnavailable when they cannot load."""
    mode = switch(mode)
    if mode not in SWITCH_VALUES:
        raise ValueError(f"engine.native={mode}: expected one of {', '.join(SWITCH_VALUES)}")
    if mode == "false":
        return None
    if torch.device(device).type == "cuda":
        found = cuda.load()
        if found is None and mode == "true":
            raise NativeUnavailable("engine.native=true on CUDA needs Triton (torch's CUDA wheels bring it); or use "
                                    "engine.native=auto to run on torch ops instead")
        return found
    if torch.device(device).type != "cpu":
        if mode == "true":
            raise NativeUnavailable(f"engine.native=true, but the fused kernels run on CPU and CUDA only, not "
                                    f"{torch.device(device).type}; use engine.native=auto")
        return None
    try:
        return _load()
    except NativeUnavailable as exc:
        if mode == "true":
            raise NativeUnavailable(f"engine.native=true, but the fused kernels are unavailable: {exc}; or use "
                                    "engine.native=auto to run on torch ops instead") from exc
        if not _warned:
            _warned.append(exc)
            log.warning("engine.native=auto: the fused kernels are unavailable (%s); the step runs on torch ops "
                        "(same results, slower): drawing Gaussian z there costs more than the forward passes on a "
                        "CPU, so install a C++ compiler, or use estimator.distribution=rademacher", exc)
        return None
