"""The chunk pass on CUDA in one Triton kernel: the pending update and a query's working copies, z drawn
in registers.

On torch ops (`distzo.engine.chunkpass`) a float16 OPT-6.7B step on an H100 spent 0.18 s of its 0.59 s
outside the forward passes (BENCHMARKS.md): z drawn into a float32 scratch buffer, widened, scaled,
added and rounded, one pass over memory per operation, about 50 bytes of traffic per element and a
dozen launches per span of chunks. This kernel reads each master element once, draws z
(`cuda_draws.draw_block`, the one definition's values) for every term of the update and for the query in
registers, and writes the updated master and the query's + and - copies: 8 bytes per float16
element, one launch per span and query.

It performs `chunkpass._torch_ops`'s operations, each rounded once, in the same order, on the z
`cuda_draws` draws (both compiled without FMA contraction, `cuda_draws.UNFUSED`), round() being to
the master's dtype, nearest even, and every product and sum float32:

    x = float32(master); x = x * decay (if any); x = x - z_k * a_k for each term (a_k signed);
    master = round(x)
    float32 copies:  master + z_q * eps,  master - z_q * eps
    narrower copies: d = round(round(z_q) * eps); round(master + d), round(master - d)

so the weights are bitwise those of the torch path (tests/unit/test_cuda_chunk_kernel.py runs this
source under Triton's interpreter against it; tests/gpu on a GPU). What the kernel does not cover
runs on torch ops with the same values: optimizers with state or another rule than sgd's, a magnitude
mask (Sparse MeZO), directions that are not the plain counter stream (LOZO, SubZero, AGZO).

Each variant (dtype, distribution, weight decay or not, which outputs) is verified on its first call
in a process: a trial of up to one chunk of that call (its first elements, cloned) goes through the
kernel and through the torch path, and a variant whose result differs by one bit (a compiler that
rounds otherwise) or that fails to compile is switched off with a warning, the call itself and every
later one running on torch ops. The trial is one chunk, not the call's span, so the check adds no
more than a chunk's float32 scratch to the device's memory.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

import torch

from ..zo import cuda_draws
from ..zo.cuda_draws import split64
from ..zo.optimizers import SGD
from ..zo.streams import as_int64
from .rounding import CODES, as_kernel_arg, dtype_code

if TYPE_CHECKING:
    from ..zo.directions import ChunkRef, Directions
    from ..zo.optimizers import Rule
    from ..zo.params import TrainableParam


class PendingUpdate(Protocol):
    """What the kernel reads of the engine's pending update (`distzo.engine.pending.PendingUpdate`,
    a layer above): the step whose z the update applies, its rule, and its terms (query, a_k)."""

    step: int
    lr: float
    weight_decay: float
    rule: Rule
    terms: Sequence[tuple[int, float]]


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here is used there
    triton = tl = None

log = logging.getLogger("distzo")

_BLOCK = 1024
_MASK64 = (1 << 64) - 1

# query -> [(sign, out)], as chunkpass.Copies
Copies = Mapping[int, Sequence[tuple[int, torch.Tensor]]]
# chunkpass._torch_ops's signature: the reference a variant is verified against
TorchPass = Callable[..., None]


if triton is not None:
    from .rounding import load_f32, round_to, store_as

    @triton.jit(do_not_specialize=["n_terms", "update_hi", "update_lo", "key_hi", "key_lo", "copy_hi", "copy_lo",
                                   "first_chunk", "first_row", "lo", "hi"])
    def _chunk_kernel(master_ptr, plus_ptr, minus_ptr, term_query_ptr, term_scale_ptr, n_terms, update_hi, update_lo,
                      key_hi, key_lo, copy_hi, copy_lo, first_chunk, first_row, n_cols, col_blocks, lo, hi, decay,
                      eps, UPDATE: tl.constexpr, DECAY: tl.constexpr, PLUS: tl.constexpr, MINUS: tl.constexpr,
                      CODE: tl.constexpr, GAUSSIAN: tl.constexpr, BLOCK: tl.constexpr):
        # The span's element e is element e % n_cols of chunk first_chunk + e // n_cols; master and the
        # copies hold elements [lo, hi) of the span (passed by rounding.as_kernel_arg; CODE: their
        # dtype). Program: (row, column block) of the rows that [lo, hi) touches, from first_row.
        # 64-bit hashes come as two i32 halves (cuda_draws.split64: one compiled signature): the update
        # step's hash, the parameter's key and the copies' Directions.key_hash(step, query, key).
        pid = tl.program_id(0).to(tl.int64)
        r = pid // col_blocks
        first_col = (pid - r * col_blocks) * BLOCK  # even: a Gaussian word per two elements (draw_block)
        col = first_col + tl.arange(0, BLOCK)
        row = first_row + r
        flat = row * n_cols + col
        mask = (col < n_cols) & (flat >= lo) & (flat < hi)
        at = flat - lo
        chunk = first_chunk.to(tl.uint64) + row.to(tl.uint64)
        first = first_col.to(tl.uint64)
        key = cuda_draws.join64(key_hi, key_lo)
        m = load_f32(master_ptr, at, mask, CODE)  # the master's value, exactly
        if UPDATE:
            x = m
            if DECAY:
                x = x * decay
            base = cuda_draws.join64(update_hi, update_lo)
            for t in range(n_terms):
                q = tl.load(term_query_ptr + t).to(tl.uint64, bitcast=True)
                a = tl.load(term_scale_ptr + t)
                # Directions.key_hash(step, q, key) from Directions.step_hash(step) (update_base)
                kh = cuda_draws._mix64(cuda_draws._mix64(base ^ q) ^ key)
                x = x - cuda_draws.draw_block(kh, chunk, first, BLOCK, GAUSSIAN) * a
            m = round_to(x, CODE)
            store_as(master_ptr, at, m, mask, CODE)
        if PLUS or MINUS:
            z = cuda_draws.draw_block(cuda_draws.join64(copy_hi, copy_lo), chunk, first, BLOCK, GAUSSIAN)
            if CODE == 0:
                d = z * eps
            else:  # z rounded to the master's dtype, then scaled there (torch: z.to(dtype).mul_(eps))
                d = round_to(round_to(z, CODE) * eps, CODE)
            if PLUS:
                store_as(plus_ptr, at, round_to(m + d, CODE), mask, CODE)
            if MINUS:
                store_as(minus_ptr, at, round_to(m - d, CODE), mask, CODE)


class CudaKernels:
    """The chunk pass's Triton kernel (`engine.native` on CUDA); see the module docstring."""

    path = "Triton chunk kernel (distzo/native/cuda.py)"

    def __init__(self, verify: bool = True):
        self.verify = verify  # compare each variant's first call with the torch path
        self._checked: dict[tuple, bool] = {}  # variant -> its first call agreed with the torch path
        self._terms: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def handles(self, directions: Directions, p: TrainableParam, master: torch.Tensor,
                pending: PendingUpdate | None, copies: Copies, state: Sequence[torch.Tensor]) -> bool:
        """Whether this pass is the kernel's: plain counter z on CUDA, sgd's rule (or none), no mask,
        no state, contiguous tensors of one supported dtype."""
        from ..zo.directions import Directions

        cls = type(directions)
        if not (directions.counter_draws and master.is_contiguous() and not state
                and cls.fill_chunk is Directions.fill_chunk and cls._fill_chunk is Directions._fill_chunk
                and master.dtype in CODES and p.tensor.dtype == master.dtype
                and directions.magnitude_threshold(p.key) is None):
            return False
        if pending is not None and type(pending.rule.optimizer).update is not SGD.update:
            return False
        return all(out.dtype == master.dtype and out.is_contiguous() for outs in copies.values() for _, out in outs)

    def chunk_pass(self, directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
                   pending: PendingUpdate | None, step: int, eps: float, copies: Copies,
                   part: tuple[int, int] | None, decay: float | None, torch_pass: TorchPass) -> None:
        """`chunkpass.chunk_pass` for a pass `handles` accepts: one launch per query (the first also
        applies the update), copies beyond one + and one - per query in launches of their own.
        decay: the update's weight-decay factor for p (None: none), as the torch path takes it."""
        launches = self._launches(pending, copies)
        variant = (master.dtype, directions.distribution, decay is not None,
                   tuple((update, plus is not None, minus is not None) for _, plus, minus, update in launches))
        if self.verify and variant not in self._checked:
            self._checked[variant] = self._agrees(directions, p, ref, master, pending, step, eps, copies, decay,
                                                  torch_pass)
        if not self._checked.get(variant, True):
            torch_pass(directions, p, ref, master, pending, step, eps, copies, part, ())
            return
        self._run(directions, p, ref, master, pending, step, eps, part, decay, launches)

    def _launches(self, pending: PendingUpdate | None, copies: Copies) -> list[tuple]:
        """[(query, + copy or None, - copy or None, whether it applies the update)]: the update in the
        first launch, then each query's copies, one + and one - a launch."""
        update = pending is not None
        out: list[tuple] = []
        for q, outs in copies.items():
            plus = [o for sign, o in outs if sign > 0]
            minus = [o for sign, o in outs if sign < 0]
            while plus or minus:
                a, b = plus.pop(0) if plus else None, minus.pop(0) if minus else None
                out.append((q, a, b, update and not out))
        if update and not out:
            out.append((0, None, None, True))
        return out

    def _run(self, directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
             pending: PendingUpdate | None, step: int, eps: float, part: tuple[int, int] | None,
             decay: float | None, launches: list[tuple]) -> None:
        size = ref.stop - ref.start
        lo, hi = part if part is not None else (0, size)
        n_cols = ref.per_chunk
        first_row, last_row = lo // n_cols, (hi - 1) // n_cols
        col_blocks = triton.cdiv(n_cols, _BLOCK)
        grid = ((last_row - first_row + 1) * col_blocks,)
        queries, scales = self._term_tensors(pending, master.device)
        update_base = split64(directions.step_hash(pending.step) if pending is not None else 0)
        arg, code, gaussian = as_kernel_arg(master), dtype_code(master.dtype), directions.distribution == "gaussian"
        for q, plus, minus, update in launches:
            _chunk_kernel[grid](arg, as_kernel_arg(plus) if plus is not None else arg,
                                as_kernel_arg(minus) if minus is not None else arg,
                                queries, scales, queries.numel(), *update_base, *split64(p.key),
                                *split64(directions.key_hash(step, q, p.key)), ref.index, first_row, n_cols,
                                col_blocks, lo, hi,
                                float(decay) if decay is not None else 1.0, float(eps),
                                UPDATE=update, DECAY=update and decay is not None, PLUS=plus is not None,
                                MINUS=minus is not None, CODE=code, GAUSSIAN=gaussian, BLOCK=_BLOCK,
                                **cuda_draws.UNFUSED)

    def _term_tensors(self, pending: PendingUpdate | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The update's terms on the device: queries (int64, as their 64-bit patterns) and signed
        float32 scales a_k (f32(-|a|) is -f32(|a|): subtracting it adds |a| z, as the torch path does).
        Made once per step (every parameter's pass shares them), a few kept."""
        terms = tuple(pending.terms) if pending is not None else ()
        key = (terms, str(device))
        if key not in self._terms:
            if len(self._terms) > 8:
                self._terms.clear()
            q = [as_int64(k & _MASK64) for k, _ in terms]  # int64 bit patterns
            self._terms[key] = (torch.tensor(q, dtype=torch.int64, device=device),
                                torch.tensor([a for _, a in terms], dtype=torch.float32, device=device))
        return self._terms[key]

    def _agrees(self, directions: Directions, p: TrainableParam, ref: ChunkRef, master: torch.Tensor,
                pending: PendingUpdate | None, step: int, eps: float, copies: Copies, decay: float | None,
                torch_pass: TorchPass) -> bool:
        """Whether the kernel and the torch path agree bitwise on a trial of this pass: up to one chunk
        (this call's first master elements, cloned, as the first elements of chunk ref.index) and its
        copies. A trial and not the call itself: the torch path draws z into float32 scratch of its
        span's size (up to 2^25 elements), which the process would keep, and widens the master to
        float32 beside it. A kernel that fails to compile or launch counts as disagreeing."""
        n = min(master.numel(), ref.per_chunk)
        trial_ref = dataclasses.replace(ref, stop=ref.start + n)

        def trial() -> tuple[torch.Tensor, Copies]:
            m = master.reshape(-1)[:n].clone()
            # copies start as NaN: an element one path leaves unwritten differs from the other's value
            return m, {q: [(sign, torch.full_like(m, float("nan"))) for sign, _ in outs] for q, outs in copies.items()}

        def results(m: torch.Tensor, outs: Copies) -> list[torch.Tensor]:
            return [m] + [out for q_outs in outs.values() for _, out in q_outs]

        m, outs = trial()
        try:
            self._run(directions, p, trial_ref, m, pending, step, eps, None, decay, self._launches(pending, outs))
        except Exception as exc:  # noqa: BLE001 (Triton's compiler raises many kinds; the fallback is exact)
            got, why = None, f"it failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
        else:
            got, why = results(m, outs), "it differs"
        m, outs = trial()
        torch_pass(directions, p, trial_ref, m, pending, step, eps, outs, None, ())
        want = results(m, outs)
        same = got is not None and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
        if not same:
            log.warning("engine.native: the CUDA chunk kernel was checked against torch ops on %s (%s, %s) and %s; "
                        "this variant runs on torch ops (same results, slower). Please report it with your GPU "
                        "and Triton version", p.name, master.dtype, directions.distribution, why)
        return same


def load() -> CudaKernels | None:
    """The CUDA kernel, or None without Triton."""
    return CudaKernels() if triton is not None else None
