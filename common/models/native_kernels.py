"""C kernels built on the machine that runs them and called through ctypes
(`cpu_kernels.c`): the text model's CPU operations that torch runs as many small calls,
each with microseconds of overhead for little arithmetic, in float32 and bfloat16 (the
latter computed in float32 and rounded where torch's bfloat16 ops round).

- Decode attention, one query row per sequence and query head over that sequence's K/V
  rows. torch's CPU flash kernel runs it as two small GEMM calls (scores, then values) per
  sequence and key head: at batch 32 over 131 positions (the `small` checkpoint, one thread)
  a layer's attention took about twice what reading its K and V from memory takes, and the
  decode step spent about 40% of its time there. The C kernel reads each sequence's K and V
  once per key head for the whole group of query heads that share it, with the softmax in
  between, near memory speed.
- RMSNorm: torch's is five ops (square, mean, add, rsqrt, two products), 25 us on a row of
  256 where the C call takes 11 us; a decode step of the `small` checkpoint runs 13. The
  q/k norm is fused with the rotate-half RoPE after it (four more ops), and the MLP's
  `silu(gate) * up` is one pass (two ops, each a pass over the activations).

Figures: docs/performance.md ("Text-model CPU kernels").

Building: on first use (a text model loading on a CPU asks), with the system's C compiler
(`$CC`, else `cc`, else `gcc`), for this CPU (`-march=native`), into
`$EPD_CACHE_DIR/kernels/` (default `~/.cache/epd`) under a name that hashes the sources
(`cpu_kernels.c` and the body it includes once per element type), the flags, the compiler's
version and the CPU's flags, so a cache shared between machines never hands one CPU
another's build. The compiler writes a temporary file that is renamed into place, so
concurrent first uses are safe. About 0.3 s. Nothing is built or loaded with
`EPD_NATIVE_KERNELS=0`, without a compiler, or when the build or load fails: callers then
use torch's kernels (logged once, at warning when a build failed).

Arithmetic: `-fassociative-math` and its companions let the compiler vectorize the dot
products and sums; their order then depends on the head dimension and on the sequence's own
length, never on the rest of the batch, so a sequence's outputs are the same bits whatever
else is in the step. No `-ffinite-math-only`. The exponential is the kernel's own (about 2
ulp), so its results differ from torch's kernel by rounding (both are within a few 1e-6 of a
float64 computation in the tests).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from common.cpu import cpu_info

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")  # compiled; includes INCLUDES
INCLUDES = (Path(__file__).with_name("cpu_kernels_body.h"),)
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
    "-shared",
    "-fPIC",
)
MAX_GROUP = 16  # query heads per key head the kernel takes (its per-row accumulators)
# With more than one torch thread, a call whose batch x key heads x positions x head dim is
# at least this splits its batch across that many threads (about 0.1 ms of work: less would
# not pay for the handoff).
PARALLEL_WORK = 1 << 18

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # element types, symbol suffixes

_I64 = ctypes.c_int64
_INT = ctypes.c_int
_FLOAT = ctypes.c_float
_PTR = ctypes.c_void_p


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(source: Path, cache: Path, includes: tuple[Path, ...] = INCLUDES) -> Path | None:
    """The shared library of `source` (which includes `includes`) for this machine, built
    unless already in `cache`; None (logged) if there is no compiler, or a source, the cache
    or the build fails."""
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found: the text model uses torch's kernels only")
        return None
    tmp = None
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        key = hashlib.sha256()
        sources = [path.read_bytes() for path in (source, *includes)]
        for part in (*sources, " ".join(FLAGS).encode(), version.encode()):
            key.update(part)
            key.update(b"\0")
        key.update(" ".join(sorted(cpu_info()[1])).encode())
        target = cache / f"{source.stem}-{key.hexdigest()[:24]}.so"
        if target.is_file():
            return target
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=cache)
        os.close(fd)
        folders = sorted({f"-I{path.parent}" for path in includes})
        command = [cc, *FLAGS, *folders, str(source), "-o", tmp, "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            logger.warning(
                "building %s failed: torch's kernels are used\n%s", source.name, done.stderr[-2000:]
            )
            return None
        os.replace(tmp, target)  # atomic: a concurrent build's rename of the same bytes wins
        return target
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("building %s failed (%s): torch's kernels are used", source.name, e)
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def cache_dir() -> Path:
    """Where built kernels are kept: `$EPD_CACHE_DIR/kernels` (default `~/.cache/epd`)."""
    root = Path(os.environ.get("EPD_CACHE_DIR") or Path.home() / ".cache" / "epd")
    return root / "kernels"


class NativeKernels:
    """`cpu_kernels.c` loaded. Each call takes only what its `*_takes` check accepts."""

    def __init__(self, library: Path) -> None:
        self.library = library
        lib = ctypes.CDLL(str(library))  # ctypes drops the GIL during each call
        self._attention: dict[torch.dtype, Any] = {}
        self._norm: dict[torch.dtype, Any] = {}
        self._norm_rotate: dict[torch.dtype, Any] = {}
        self._silu_mul: dict[torch.dtype, Any] = {}
        for dtype, suffix in DTYPES.items():
            attention = getattr(lib, f"epd_decode_attention_{suffix}")
            attention.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64]
            attention.argtypes += [_I64, _PTR, _INT, _INT, _INT, _INT, _INT, _FLOAT, _PTR]
            attention.restype = _INT
            norm = getattr(lib, f"epd_rms_norm_{suffix}")
            norm.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _FLOAT, _PTR]
            norm.restype = None
            norm_rotate = getattr(lib, f"epd_rms_norm_rotate_{suffix}")
            norm_rotate.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _FLOAT]
            norm_rotate.argtypes += [_PTR, _PTR, _I64, _PTR]
            norm_rotate.restype = _INT
            silu_mul = getattr(lib, f"epd_silu_mul_{suffix}")
            silu_mul.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
            silu_mul.restype = None
            self._attention[dtype], self._norm[dtype] = attention, norm
            self._norm_rotate[dtype], self._silu_mul[dtype] = norm_rotate, silu_mul

    def decode_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor | None,
    ) -> torch.Tensor:
        """`[B, H * D]`: each sequence's query heads `q [B, H, D]` over its first
        `lengths[b]` positions (all of them when None) of `keys`, `values [B, KV, T, D]`.

        The caller has checked what the C code relies on (`attention_takes`, and `lengths` int64,
        contiguous, in `1 .. T`). With more than one torch thread a large call splits the
        batch across that many threads (`PARALLEL_WORK`)."""
        batch, heads, dim = q.shape
        out = torch.empty((batch, heads * dim), dtype=q.dtype)
        parts = min(torch.get_num_threads(), batch)
        if parts == 1 or batch * keys.shape[1] * keys.shape[2] * dim < PARALLEL_WORK:
            self._attend(q, keys, values, lengths, out)
            return out
        # Sequences are independent and each one's arithmetic is the same whichever call
        # computes it, so a split batch gives the same bits; ctypes drops the GIL in calls.
        cuts = [batch * i // parts for i in range(parts + 1)]
        pieces = [
            (q[a:b], keys[a:b], values[a:b], None if lengths is None else lengths[a:b], out[a:b])
            for a, b in itertools.pairwise(cuts)
        ]
        others = [_pool(parts - 1).submit(self._attend, *piece) for piece in pieces[1:]]
        self._attend(*pieces[0])
        for done in others:
            done.result()
        return out

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """One C call over `q`'s sequences into `out [B, H * D]` (rows contiguous)."""
        batch, heads, dim = q.shape
        qs, ks, vs = q.stride(), keys.stride(), values.stride()
        status = self._attention[q.dtype](
            q.data_ptr(),
            qs[0],
            qs[1],
            keys.data_ptr(),
            ks[0],
            ks[1],
            ks[2],
            values.data_ptr(),
            vs[0],
            vs[1],
            vs[2],
            None if lengths is None else lengths.data_ptr(),
            batch,
            heads,
            keys.shape[1],
            keys.shape[2],
            dim,
            dim**-0.5,
            out.data_ptr(),
        )
        if status == -2:
            raise ValueError(f"decode attention takes at most {MAX_GROUP} query heads per key head")
        if status != 0:
            raise MemoryError("decode attention could not allocate its work buffer")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`x * (1 / sqrt(mean(x^2) + eps)) * weight` over the last dimension, as a new
        contiguous tensor, for `x` and `weight` that `rms_norm_takes`."""
        out = torch.empty(x.shape, dtype=x.dtype)
        if x.dim() == 2:
            rows, heads, dim = x.shape[0], 1, x.shape[1]
            row_stride, head_stride = x.stride(0), 0
        else:
            rows, heads, dim = x.shape
            row_stride, head_stride = x.stride(0), x.stride(1)
        weight_stride = dim if weight.dim() == 2 else 0
        self._norm[x.dtype](
            x.data_ptr(),
            rows,
            heads,
            dim,
            row_stride,
            head_stride,
            weight.data_ptr(),
            weight_stride,
            eps,
            out.data_ptr(),
        )
        return out

    def rms_norm_rotate(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        """`text_ops.rotate(self.rms_norm(x, weight, eps), cos, signed_sin)` in one pass, for
        tensors that `rms_norm_rotate_takes`."""
        rows, heads, dim = x.shape
        out = torch.empty(x.shape, dtype=x.dtype)
        status = self._norm_rotate[x.dtype](
            x.data_ptr(),
            rows,
            heads,
            dim,
            x.stride(0),
            x.stride(1),
            weight.data_ptr(),
            dim if weight.dim() == 2 else 0,
            eps,
            cos.data_ptr(),
            signed_sin.data_ptr(),
            cos.stride(0),
            out.data_ptr(),
        )
        if status != 0:
            raise ValueError(f"RMSNorm with rotation takes an even head dim up to 1024, not {dim}")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `gate_up [n, 2f]` (gate its first f columns), `[n, f]`,
        for a tensor that `silu_mul_takes`."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        silu_mul = self._silu_mul[gate_up.dtype]
        silu_mul(gate_up.data_ptr(), rows, width // 2, gate_up.stride(0), out.data_ptr())
        return out

    @staticmethod
    def rms_norm_rotate_takes(
        x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> bool:
        """Whether `rms_norm_rotate` takes these: what `rms_norm_takes` for a 3-D `x [n, m,
        d]` (d even, at most 1024), and CPU tables `cos`, `signed_sin` of `x`'s dtype,
        `[n, 1, d]` or `[n, d]`, with contiguous rows at one stride."""
        n, _, dim = x.shape if x.dim() == 3 else (0, 0, 0)
        tables = (cos, signed_sin)
        return (
            x.dim() == 3
            and dim % 2 == 0
            and dim <= 1024
            and NativeKernels.rms_norm_takes(x, weight)
            and all(t.dtype == x.dtype and t.device.type == "cpu" for t in tables)
            and all(t.shape in ((n, 1, dim), (n, dim)) and t.stride(-1) == 1 for t in tables)
            and cos.stride(0) == signed_sin.stride(0)
        )

    @staticmethod
    def silu_mul_takes(gate_up: torch.Tensor) -> bool:
        """Whether `silu_mul` takes `gate_up`: a float32 or bfloat16 CPU `[n, 2f]` with
        contiguous rows."""
        return (
            gate_up.dtype in DTYPES
            and gate_up.device.type == "cpu"
            and gate_up.dim() == 2
            and gate_up.shape[1] % 2 == 0
            and gate_up.stride(-1) == 1
        )

    @staticmethod
    def rms_norm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` takes these: CPU tensors of one dtype (float32 or bfloat16),
        `x [n, d]` or `[n, m, d]` with its last dimension contiguous, `weight [d]` or (for
        3-D `x`) `[m, d]`, contiguous."""
        return (
            x.dtype == weight.dtype
            and x.dtype in DTYPES
            and x.device.type == weight.device.type == "cpu"
            and x.dim() in (2, 3)
            and x.stride(-1) == 1
            and weight.is_contiguous()
            and (weight.shape == x.shape[-1:] or (x.dim() == 3 and weight.shape == x.shape[1:]))
        )

    @staticmethod
    def attention_takes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether `decode_attention` takes these tensors."""
        tensors = (q, keys, values)
        return (
            all(t.device.type == "cpu" and t.dtype == q.dtype for t in tensors)
            and q.dtype in DTYPES
            and all(t.stride(-1) == 1 for t in tensors)
            and q.dim() == 3
            and keys.dim() == values.dim() == 4
            and keys.shape == values.shape
            and keys.shape[0] == q.shape[0]
            and keys.shape[3] == q.shape[2]
            and q.shape[1] % keys.shape[1] == 0
            and q.shape[1] // keys.shape[1] <= MAX_GROUP
        )


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of `workers` threads for split kernel calls (made on first use)."""
    with _pool_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="epd-kernel")
        return _pools[workers]


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The kernels for this process (built on first call), or None where there are none
    (see the module docstring)."""
    if os.environ.get("EPD_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("EPD_NATIVE_KERNELS=0: the text model uses torch's kernels only")
        return None
    library = _build(SOURCE, cache_dir())
    if library is None:
        return None
    try:
        return NativeKernels(library)
    except (OSError, AttributeError) as e:
        logger.warning("loading %s failed (%s): torch's kernels are used", library, e)
        return None
