"""Fused CPU kernels (`kernels.c`): one pass over a chunk applies the owed update and writes every
working copy of the step.

torch runs each elementwise operation as its own pass over a chunk. For a Rademacher step that is
about six passes (hash the stream, expand the signs, scale them, update, two copies), each reading
and writing megabytes, where one pass would do. `kernels.c` does the whole chunk in one pass, and z never
touches memory. It performs the same floating-point operations on every element as the torch path,
so the two agree bitwise (`tests/unit/test_native.py`). The result of a run never depends on
whether the kernels were used.

The library is compiled on first use with the system C compiler ($CC, else cc, gcc or clang) into
the cache (`<cache>/native/`). The file name hashes the source, the flags and the compiler, and
the file lands by atomic rename, so ranks that start together share one build. It is loaded with
ctypes. ctypes releases the GIL during a call, so the noise threads run kernels in parallel. When
it is loaded, a self-check compares it with the torch implementation of the same values.

`engine.native`: `auto` uses the kernels where they apply (CPU, float32 masters) and falls back
to torch ops, with one warning, where no compiler is found. `true` makes that an error. `false`
always uses torch ops (for comparison).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import torch

from ..cache import cache_dir, file_lock
from ..errors import DistzoError

log = logging.getLogger("distzo")

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: no fused multiply-adds (they would round `x * decay - z` once, not twice).
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
MODES = ("auto", "true", "false")


class NativeUnavailable(DistzoError):
    """The fused kernels cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Stream:
    """A chunk's Rademacher z as a counter stream: element e is +scale when bit e % 64 of word e // 64
    of the chunk's SplitMix64 stream is set, else -scale (`zo/directions.py` defines it)."""

    seed: int
    scale: float


# A noise source of one chunk: a counter stream, or the chunk's pre-drawn, pre-scaled values
# (float32, contiguous, indexed by the chunk's elements).
Source = Union[Stream, torch.Tensor]


class _CSource(ctypes.Structure):
    _fields_ = [("values", ctypes.c_void_p), ("seed", ctypes.c_uint64), ("scale", ctypes.c_float)]


def _check_f32(t: torch.Tensor, what: str, min_numel: int) -> None:
    # The kernels see raw pointers: refuse anything that is not exactly what they assume.
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < min_numel:
        raise ValueError(f"{what}: needs a contiguous float32 CPU tensor of >= {min_numel} elements, got "
                         f"{t.dtype} on {t.device}, {t.numel()} elements, contiguous={t.is_contiguous()}")


class Kernels:
    """Typed entry points of the loaded library. Arguments are checked before any pointer is passed."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, f32, i32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
        lib.distzo_rademacher_fill.argtypes = [ptr, i64, ctypes.c_uint64, i64, f32]
        lib.distzo_rademacher_rows.argtypes = [ptr, i64, i64, ptr, ptr, f32]
        lib.distzo_chunk.argtypes = [ptr, i64, i64, i32, f32, i32, ptr, ptr, i32, ptr, i32, ptr, ptr, ptr]
        for fn in (lib.distzo_rademacher_fill, lib.distzo_rademacher_rows, lib.distzo_chunk):
            fn.restype = None
        self._lib = lib

    def rademacher_fill(self, out: torch.Tensor, stream: Stream, offset: int = 0) -> torch.Tensor:
        """out = elements [offset, offset + out.numel()) of the stream."""
        _check_f32(out, "out", 0)
        self._lib.distzo_rademacher_fill(out.data_ptr(), out.numel(), stream.seed, offset, stream.scale)
        return out

    def rademacher_rows(self, out: torch.Tensor, seeds: Sequence[int], offsets: Sequence[int], scale: float) -> torch.Tensor:
        """Row r of out ([rows, row_numel]) = stream seeds[r] (unit magnitude times scale) from element offsets[r]."""
        rows = len(seeds)
        if out.dim() != 2 or out.shape[0] != rows or len(offsets) != rows:
            raise ValueError(f"rademacher_rows: out {tuple(out.shape)} for {rows} seeds and {len(offsets)} offsets")
        _check_f32(out, "out", 0)
        c_seeds = (ctypes.c_uint64 * rows)(*seeds)
        c_offsets = (ctypes.c_int64 * rows)(*offsets)
        self._lib.distzo_rademacher_rows(out.data_ptr(), rows, out.shape[1], c_seeds, c_offsets, scale)
        return out

    def chunk(self, master: torch.Tensor, offset: int = 0, decay: float | None = None,
              terms: Sequence[tuple[Source, bool]] = (), queries: Sequence[Source] = (),
              outs: Sequence[tuple[torch.Tensor, int, int]] = ()) -> None:
        """One pass over `master`, which holds chunk elements [offset, offset + master.numel()).

        Update (when decay is not None or there are terms): x = master * decay, then for each term
        (z, add) in order, x = x + z if add else x - z; master = x. Copies: for each (out, q, sign)
        of outs, out = x + z_q if sign > 0 else x - z_q, with z_q = queries[q]."""
        n = master.numel()
        _check_f32(master, "master", 0)
        keep = []  # tensors whose pointers the call uses

        def c_source(s: Source) -> _CSource:
            if isinstance(s, Stream):
                return _CSource(None, s.seed, s.scale)
            _check_f32(s, "pre-drawn values", offset + n)
            keep.append(s)
            return _CSource(s.data_ptr(), 0, 0.0)

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
        self._lib.distzo_chunk(master.data_ptr(), n, offset, int(decay is not None),
                               1.0 if decay is None else decay, len(terms), c_terms, c_add,
                               len(queries), c_queries, len(outs), c_outs, c_query, c_sign)


def compiler() -> str | None:
    """The C compiler to build with: $CC (a command line, e.g. "ccache gcc"), else the first of cc,
    gcc, clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return cc
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def _compile_error(output: str) -> str:
    """The line of a compiler's output that says what went wrong: its first `error:` line (the last
    line is often just "compilation terminated."), else its last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines[-1:] or ["no output"])[0]


def library_path() -> Path:
    """Where the library built from this source with these flags is cached. The compiler is not
    part of the key: a library built on a login node serves compute nodes without a compiler
    (the self-check at load time vouches for it)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), platform.machine().encode()):
        digest.update(part)
    return cache_dir() / "native" / f"distzo-kernels-{digest.hexdigest()[:16]}.so"


def build(cc: str, target: Path) -> None:
    """Compile the source into `target` (atomically: a temporary file, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # unique across hosts too: nodes sharing a cache over NFS may not honour the lock
    tmp = target.with_name(f"{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        try:
            r = subprocess.run([*shlex.split(cc), *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True,
                               text=True, timeout=300)
        except (OSError, ValueError) as exc:  # ValueError: shlex on an unbalanced quote, or an empty $CC
            raise NativeUnavailable(f"the C compiler {cc!r} cannot run ({getattr(exc, 'strerror', None) or exc}); "
                                    "install gcc or clang, or set CC") from exc
        except subprocess.TimeoutExpired as exc:
            raise NativeUnavailable(f"compiling {SOURCE.name} with {cc} took over {exc.timeout:.0f} s") from exc
        if r.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCE.name} with {cc} failed: {_compile_error(r.stderr or r.stdout)}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def self_check(kernels: Kernels) -> None:
    """Compare the library with the torch implementation on a few awkward ranges (a miscompiled or
    stale library must not silently change a run's directions)."""
    from ..zo.directions import stream_signs  # the definition of the stream, in torch ops

    for seed, offset, n, scale in ((7, 0, 1000, 1.0), (2**64 - 5, 61, 300, 3.7e-4), (12345, 8, 77, 0.5)):
        got = kernels.rademacher_fill(torch.empty(n), Stream(seed, scale), offset)
        if not torch.equal(got, stream_signs(seed, offset, n, scale)):
            raise NativeUnavailable(f"{kernels.path} disagrees with the torch reference; delete it to rebuild")
    master = torch.linspace(-1, 1, 513)
    values = torch.linspace(0.5, -0.25, 520)
    expect = master.clone().mul_(0.75).sub_(values[7:520]).add_(stream_signs(3, 7, 513, 1e-3))
    plus = torch.empty(513)
    got = master.clone()
    kernels.chunk(got, offset=7, decay=0.75, terms=[(values, False), (Stream(3, 1e-3), True)],
                  queries=[Stream(9, 0.25)], outs=[(plus, 0, 1)])
    if not (torch.equal(got, expect) and torch.equal(plus, expect + stream_signs(9, 7, 513, 0.25))):
        raise NativeUnavailable(f"{kernels.path} disagrees with the torch reference; delete it to rebuild")


_loaded: dict[str, Kernels | NativeUnavailable] = {}  # "kernels": this process's outcome of loading them
_warned: list[NativeUnavailable] = []


def _cache_error(exc: Exception) -> NativeUnavailable:
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if getattr(exc, "filename", None):
        detail += f": {exc.filename}"
    return NativeUnavailable(f"the kernel cache is unusable ({detail}); set DISTZO_CACHE to a writable directory")


def _built_library() -> Path:
    """The cached library for this source, compiled first if missing (by one rank: the others wait
    on the lock and find it built)."""
    try:
        path = library_path()
        if not path.is_file():
            cc = compiler()
            if cc is None:
                raise NativeUnavailable("no C compiler was found to build them; install gcc or clang, or set CC")
            with file_lock(path.with_name(path.name + ".lock")):
                if not path.is_file():  # another rank may have built it while we waited
                    log.info("Compiling the fused kernels with %s (once, into %s)", cc, path.parent)
                    build(cc, path)
    except (OSError, RuntimeError) as exc:  # read-only cache, no locks (NFS), no home directory, ...
        raise _cache_error(exc) from exc
    return path


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


def load(mode: str = "auto", device: torch.device | str = "cpu") -> Kernels | None:
    """The fused kernels for engine.native=`mode` on `device`: None where torch ops run instead
    (CUDA, `false`, or `auto` without a compiler). `true` raises NativeUnavailable when they cannot load."""
    mode = str(mode).lower()
    if mode not in MODES:
        raise ValueError(f"engine.native={mode}: expected one of {', '.join(MODES)}")
    if mode == "false":
        return None
    if torch.device(device).type != "cpu":
        if mode == "true":
            raise NativeUnavailable("engine.native=true, but the fused kernels run on CPU only (on CUDA the step "
                                    "runs torch's kernels); use engine.native=auto")
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
                        "(same results, slower)", exc)
        return None
