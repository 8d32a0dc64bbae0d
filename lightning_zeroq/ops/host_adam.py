"""The host Adam/AdamW kernel of optimizer offload (``csrc/host_adam.c``): built, checked, called.

``host_adam()`` returns the kernel, or ``None`` with the reason logged once. On first use it compiles
the C source with the system C compiler (``$CC``, default ``cc``) into the cache directory of
``ops/_build.py`` (which holds its flags, lock and messages), keyed by the source, the compiler and this
machine's CPU (the build targets it: ``-march=native``), loads it with ``ctypes`` and checks it against
torch. The kernel follows torch's fused CPU Adam/AdamW element for element; the details the source
cannot know (where the compiler that built torch fused a product and a sum into one rounding, and
torch's vector width, whose remainder takes torch's scalar path) are found by stepping random data with
every variant of a probe build beside ``torch._fused_adam(w)_`` and keeping the one that matches
bitwise in every case; the library is then built again with that variant fixed, and checked once more.
If no variant matches, or no compiler is found, there is no kernel and offload steps with torch's
kernel as before (only what the kernel adds is lost).

What it adds over torch's kernel, in the same pass over memory: bf16 gradients read as they crossed
PCIe, the gradient multiplier applied on the fly, the updated parameter also written in bf16, and the
updated values written to other arrays than the inputs, which stay as they were (see the C file).

Muon's elementwise parts run there too (``muon_blend``, ``muon_apply``, ``run_muon``): one fused
multiply-add per element, as torch's lerp and ``add_(alpha=)`` compute on the CPU and on CUDA; checked
against torch's ops once the kernel loads (``HostAdam.muon``: where they differ, offloaded Muon steps with
torch's ops).

Both builds take a few seconds, once per machine. ``ZEROQ_HOST_KERNEL=0`` disables the kernel.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zeroq.ops import _build
from lightning_zeroq.ops._build import HOST_ADAM

log = logging.getLogger("lightning_zeroq")

DECOUPLED, L2_FMA, V_FMA_A, V_FMA_B, TAIL_FMA, WEIGHT_DECAY, TAIL_V_FMA_A, TAIL_V_FMA_B = 1, 2, 4, 8, 16, 32, 64, 128
_F = ctypes.POINTER(ctypes.c_float)


_H = ctypes.POINTER(ctypes.c_uint16)


class _Job(ctypes.Structure):
    _fields_ = [
        ("p", _F),
        ("m", _F),
        ("v", _F),
        ("g", _F),
        ("gh", _H),
        ("wh", _H),
        ("op", _F),
        ("om", _F),
        ("ov", _F),
        ("n", ctypes.c_int64),
        ("vec_end", ctypes.c_int64),
        ("gmul", ctypes.c_float),
        ("gsign", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("wd", ctypes.c_float),
        ("w", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("c2", ctypes.c_float),
        ("bc2s", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step", ctypes.c_float),
        ("step", ctypes.c_float),
        ("flags", ctypes.c_int),
    ]


class _MuonBlend(ctypes.Structure):
    _fields_ = [
        ("buf", _F),
        ("g", _F),
        ("gh", _H),
        ("out", _F),
        ("out_h", _H),
        ("n", ctypes.c_int64),
        ("gmul", ctypes.c_float),
        ("w", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("nesterov", ctypes.c_int),
    ]


class _MuonApply(ctypes.Structure):
    _fields_ = [
        ("p", _F),
        ("u", _F),
        ("uh", _H),
        ("wh", _H),
        ("n", ctypes.c_int64),
        ("decay", ctypes.c_float),
        ("neg_lr", ctypes.c_float),
    ]


def _pointer(t: Optional[Tensor], kind=_F):
    return None if t is None else ctypes.cast(t.data_ptr(), kind)


class HostAdam:
    """The loaded kernel with the variant that matches torch here (``flags``, ``width``)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        lib.zq_adam_steps.argtypes = [ctypes.POINTER(_Job), ctypes.c_int, ctypes.c_int]
        lib.zq_adam_steps.restype = ctypes.c_int
        lib.zq_bind.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.zq_bind.restype = ctypes.c_int
        lib.zq_set_chunk.argtypes = [ctypes.c_int64]
        lib.zq_set_chunk.restype = ctypes.c_int
        lib.zq_set_stream_half.argtypes = [ctypes.c_int]
        lib.zq_set_stream_half.restype = ctypes.c_int
        lib.zq_triad.argtypes = [_F, _F, _F, ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        lib.zq_triad.restype = ctypes.c_int
        lib.zq_muon_blends.argtypes = [ctypes.POINTER(_MuonBlend), ctypes.c_int, ctypes.c_int]
        lib.zq_muon_blends.restype = ctypes.c_int
        lib.zq_muon_applies.argtypes = [ctypes.POINTER(_MuonApply), ctypes.c_int, ctypes.c_int]
        lib.zq_muon_applies.restype = ctypes.c_int
        self.flags, self.width = 0, 16
        self.muon = False
        """Whether Muon's parts step bitwise as torch's ops do here (checked at load: ``_load``)."""

    def step(
        self,
        param: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        *,
        threads: Optional[int] = None,
        **hyper: Any,
    ) -> None:
        """One Adam (``decoupled``: AdamW) step of ``param`` in place; see ``job`` for the arguments."""
        self.run([self.job(param, grad, exp_avg, exp_avg_sq, **hyper)], threads)

    def job(
        self,
        param: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        *,
        step: float,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        decoupled: bool,
        maximize: bool = False,
        gmul: float = 1.0,
        working: Optional[Tensor] = None,
        out: Optional[Sequence[Tensor]] = None,
    ) -> _Job:
        """The step of one tensor, for ``run``: as ``torch._fused_adam(w)_`` with state step ``step`` (already
        advanced) would take it after ``grad.float().mul_(gmul)``; ``grad`` (float32 or bfloat16) is not
        written. ``working``: a bfloat16 tensor that receives the updated parameter rounded to nearest
        even (``param.to(torch.bfloat16)``). ``out``: three float32 tensors that receive the updated
        param, exp_avg, exp_avg_sq instead (those three are then only read). No two of the tensors may
        overlap, and they must outlive ``run``."""
        n = param.numel()
        for t, dtypes in [
            (param, (torch.float32,)),
            (grad, (torch.float32, torch.bfloat16)),
            (exp_avg, (torch.float32,)),
            (exp_avg_sq, (torch.float32,)),
            *((t, (torch.float32,)) for t in out or ()),
            *([(working, (torch.bfloat16,))] if working is not None else []),
        ]:
            if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
                raise ValueError(
                    "host_adam.step needs contiguous CPU tensors of one size (float32; the gradient "
                    "float32 or bfloat16, the working copy bfloat16)"
                )
        if out is not None and len(out) != 3:
            raise ValueError(f"host_adam.step: out= takes (param, exp_avg, exp_avg_sq), got {len(out)} tensors")
        _disjoint([param, grad, exp_avg, exp_avg_sq, *(out or ()), *([working] if working is not None else [])])
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        flags = self.flags | (DECOUPLED if decoupled else 0) | (WEIGHT_DECAY if weight_decay != 0 else 0)
        half = grad.dtype == torch.bfloat16
        op, om, ov = (_pointer(t) for t in out) if out is not None else (None, None, None)
        return _Job(
            _pointer(param),
            _pointer(exp_avg),
            _pointer(exp_avg_sq),
            None if half else _pointer(grad),
            _pointer(grad, _H) if half else None,
            _pointer(working, _H),
            op,
            om,
            ov,
            n,
            n - n % self.width,
            gmul,
            -1.0 if maximize else 1.0,
            1 - lr * weight_decay,
            weight_decay,
            1 - beta1,
            beta2,
            1 - beta2,
            math.sqrt(bias_correction2),
            eps,
            -step_size,
            step_size,
            flags,
        )

    def muon_blend(
        self,
        buf: Tensor,
        grad: Tensor,
        out: Tensor,
        *,
        momentum: float,
        nesterov: bool,
        gmul: float = 1.0,
    ) -> _MuonBlend:
        """Muon's momentum blend of one tensor, for ``run_muon``: as
        ``out.copy_(muon_blend_reference(buf, grad.float().mul_(gmul), momentum, nesterov))`` (``out``:
        float32, or bfloat16 to receive the update rounded as a cast rounds). ``grad`` (float32
        or bfloat16) is not written. Contiguous CPU tensors of one size, not overlapping, kept until the run."""
        n = buf.numel()
        _check_job(
            "muon_blend",
            [(buf, (torch.float32,)), (grad, (torch.float32, torch.bfloat16)), (out, (torch.float32, torch.bfloat16))],
            n,
        )
        half_in, half_out = grad.dtype == torch.bfloat16, out.dtype == torch.bfloat16
        return _MuonBlend(
            _pointer(buf),
            None if half_in else _pointer(grad),
            _pointer(grad, _H) if half_in else None,
            None if half_out else _pointer(out),
            _pointer(out, _H) if half_out else None,
            n,
            gmul,
            1 - momentum,
            momentum,
            int(nesterov),
        )

    def muon_apply(
        self, param: Tensor, update: Tensor, *, decay: float, lr: float, working: Optional[Tensor] = None
    ) -> _MuonApply:
        """Muon's apply of one tensor's orthogonalized ``update`` (float32 or bfloat16), for ``run_muon``:
        as ``muon_apply_reference(param, update, decay, lr)``; ``working`` (bfloat16) receives the updated
        parameter rounded as a cast rounds."""
        n = param.numel()
        _check_job(
            "muon_apply",
            [
                (param, (torch.float32,)),
                (update, (torch.float32, torch.bfloat16)),
                *([(working, (torch.bfloat16,))] if working is not None else []),
            ],
            n,
        )
        half = update.dtype == torch.bfloat16
        return _MuonApply(
            _pointer(param),
            None if half else _pointer(update),
            _pointer(update, _H) if half else None,
            _pointer(working, _H),
            n,
            decay,
            -lr,
        )

    def run_muon(self, jobs: Sequence[Any], threads: Optional[int] = None) -> None:
        """Run Muon blend or apply ``jobs`` (all of one kind) as ``run`` runs Adam's."""
        if not jobs:
            return
        kind = type(jobs[0])
        if any(type(job) is not kind for job in jobs):
            raise ValueError("host_adam.run_muon: blends and applies go in separate calls")
        call = self.lib.zq_muon_blends if kind is _MuonBlend else self.lib.zq_muon_applies
        if call((kind * len(jobs))(*jobs), len(jobs), threads or torch.get_num_threads()) != 0:
            raise RuntimeError("host_adam: a thread of the host step could not be started")

    def set_chunk(self, elements: int) -> None:
        """How the threads share a call's elements: chunks of ``elements`` (a positive multiple of 16)
        taken one after another (the default, 262144), or ``0``: one fixed part per thread. Results
        are the same either way."""
        if not isinstance(elements, int) or isinstance(elements, bool) or self.lib.zq_set_chunk(elements) != 0:
            raise ValueError(
                f"host_adam.set_chunk({elements!r}): use 0 (one part per thread) or a positive "
                "multiple of 16, e.g. 262144"
            )

    def set_stream_half(self, on: bool) -> None:
        """Whether a step in place writes its bf16 copy with streaming stores, past the caches (the
        default), or with plain stores, which read each line of the copy first. Results are the same
        either way."""
        if not isinstance(on, bool):
            raise ValueError(f"host_adam.set_stream_half({on!r}): use True (streaming stores) or False (plain)")
        self.lib.zq_set_stream_half(int(on))

    def run(self, jobs: Sequence[_Job], threads: Optional[int] = None) -> None:
        """Run ``jobs`` with ``threads`` threads (default: torch's intra-op threads), one wake-up of the
        kernel's pool for all of them; the GIL is released meanwhile."""
        if not jobs:
            return
        array = (_Job * len(jobs))(*jobs)
        if self.lib.zq_adam_steps(array, len(jobs), threads or torch.get_num_threads()) != 0:
            raise RuntimeError("host_adam: a thread of the host step could not be started")

    def triad(self, a: Tensor, b: Tensor, c: Tensor, scalar: float, threads: int, streaming: bool = True) -> None:
        """STREAM's triad, ``a = b + scalar * c``, with ``threads`` threads bound as the step's are
        (``bind``); ``streaming``: ``a``'s stores bypass the caches. The host's memory bandwidth, which
        the step is measured against (``benchmarks/kernels.py host-adam --triad``)."""
        n = a.numel()
        if any(
            t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n
            for t in (a, b, c)
        ):
            raise ValueError("host_adam.triad needs three contiguous float32 CPU tensors of one size")
        _disjoint([a, b, c])
        if self.lib.zq_triad(_pointer(a), _pointer(b), _pointer(c), scalar, n, threads, int(streaming)) != 0:
            raise RuntimeError("host_adam.triad: a thread could not be started")

    def bind(self, cpus: Sequence[int]) -> None:
        """Pin part i of every later step to ``cpus[i]`` (empty: no binding)."""
        array = (ctypes.c_int * max(1, len(cpus)))(*cpus)
        if self.lib.zq_bind(array, len(cpus)) != 0:
            raise ValueError(f"host_adam.bind: {len(cpus)} cpus, at most 256")


def muon_blend_reference(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Muon's momentum blend with torch's ops, as ``torch.optim.Muon`` takes it: ``buf`` updated in place,
    the update returned (a new tensor); what ``muon_blend`` computes."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf.clone()


def muon_apply_reference(param: Tensor, update: Tensor, decay: float, lr: float) -> None:
    """Muon's apply with torch's ops: the decoupled weight decay's factor, then the update at the learning
    rate adjusted to the matrix; what ``muon_apply`` computes."""
    param.mul_(decay).add_(update, alpha=-lr)


def _check_job(what: str, tensors: Sequence[tuple[Tensor, tuple[torch.dtype, ...]]], n: int) -> None:
    for tensor, dtypes in tensors:
        if (
            tensor.dtype not in dtypes
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.numel() != n
        ):
            raise ValueError(
                f"host_adam.{what} needs contiguous CPU tensors of one size ({n} elements); got one of "
                f"{tensor.dtype} with {tensor.numel()} elements on {tensor.device} (dtypes here: "
                f"{', '.join(str(d) for d in dtypes)})"
            )
    _disjoint([t for t, _ in tensors])


def _disjoint(tensors: Sequence[Tensor]) -> None:
    """The kernel's loops assume that no two arrays of a job overlap (``ZQ_NO_ALIAS``)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
        raise ValueError(
            "host_adam.step: the parameter, gradient, moments, working copy and outputs must not overlap in memory"
        )


def _fused(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fn(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [torch.tensor(float(step))],
        amsgrad=False,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=None,
        found_inf=None,
    )


_HYPER: list[dict[str, Any]] = [
    {
        "lr": lr,
        "beta1": b1,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": wd,
        "decoupled": dec,
        "maximize": mx,
        "step": s,
    }
    for (dec, wd, b1, mx), (lr, s) in zip(
        itertools.product([True, False], [0.0, 0.1], [0.9, 0.3], [False, True]),
        itertools.cycle([(1e-3, 1.0), (3e-4, 7.0), (1.0, 2.0)]),
    )
]


def _sample(n: int, gen: torch.Generator) -> list[Tensor]:
    scale = 10.0 ** torch.randint(-8, 3, (n,), generator=gen)
    return [
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen) * scale,
        torch.randn(n, generator=gen) * 1e-2,
        torch.rand(n, generator=gen) * scale * 1e-3,
    ]


def _matches(kernel: HostAdam, sizes: Sequence[int], gen: torch.Generator) -> bool:
    for hyper, n in itertools.product(_HYPER, sizes):
        p, g, m, v = _sample(n, gen)
        ours, theirs = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, g, m, v)]
        kernel.step(ours[0], g, ours[1], ours[2], threads=1, **hyper)
        _fused(*theirs, **hyper)
        outs = [torch.empty_like(t) for t in (p, m, v)]  # and out of place, the inputs left as they were
        kernel.run([kernel.job(p, g, m, v, out=outs, **hyper)], threads=1)
        expected = (theirs[0], theirs[2], theirs[3])
        if not all(torch.equal(a, b) and torch.equal(c, b) for a, b, c in zip(ours, expected, outs)):
            return False
    return True


def _muon_matches(kernel: HostAdam, gen: torch.Generator) -> bool:
    """Whether the kernel's Muon parts give torch's ops' bits here (every input and output dtype, both
    weights of the lerp, with and without Nesterov, decay and a multiplier; sizes with torch's tails)."""
    for n, (momentum, nesterov, gmul, wd, half_in, half_out) in itertools.product(
        (4096, 4096 + 37, 5),
        [(0.95, True, 1.0, 0.1, True, True), (0.3, False, 0.5, 0.0, False, False), (0.6, True, 3.0, 0.2, True, False)],
    ):
        buf, grad, param = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        grad = grad.bfloat16() if half_in else grad
        out = torch.empty(n, dtype=torch.bfloat16 if half_out else torch.float32)
        ours = buf.clone()
        kernel.run_muon([kernel.muon_blend(ours, grad, out, momentum=momentum, nesterov=nesterov, gmul=gmul)], 1)
        expected = muon_blend_reference(buf, grad.float().mul_(gmul), momentum, nesterov).to(out.dtype)
        if not (torch.equal(ours, buf) and torch.equal(out, expected)):
            return False
        decay, lr = 1 - 0.02 * wd, 0.02 * 1.7
        working = torch.empty(n, dtype=torch.bfloat16)
        mine = param.clone()
        kernel.run_muon([kernel.muon_apply(mine, out, decay=decay, lr=lr, working=working)], 1)
        muon_apply_reference(param, out, decay, lr)
        if not (torch.equal(mine, param) and torch.equal(working, param.bfloat16())):
            return False
    return True


def _calibrate(kernel: HostAdam) -> Optional[tuple[int, int]]:
    """The variant (flags, torch's vector width) that steps bitwise as torch does here (``kernel``: the
    probe build), or None."""
    gen = torch.Generator().manual_seed(0)
    kernel.width = 1  # every element through the body
    for v_flag, l2 in itertools.product((0, V_FMA_A, V_FMA_B), (0, L2_FMA)):
        kernel.flags = v_flag | l2
        if _matches(kernel, (4096,), gen):  # torch: no tail for any vector width dividing 4096
            break
    else:
        return None
    for width, tail_v, tail in itertools.product((16, 8, 32, 4), (0, TAIL_V_FMA_A, TAIL_V_FMA_B), (0, TAIL_FMA)):
        kernel.width = width
        kernel.flags = v_flag | l2 | tail_v | tail
        if _matches(kernel, (width + width - 1, 64 + width // 2 + 1, 3), gen):
            return kernel.flags, width
    return None


_lock = threading.Lock()
_kernel: Optional[HostAdam] = None
_tried = False
_reason = ""


def host_adam() -> Optional[HostAdam]:
    """The kernel, built, loaded and checked on first call; None (logged once) where it cannot be."""
    global _kernel, _tried, _reason
    with _lock:
        if not _tried:
            _tried = True
            _kernel, reason = _load()
            _reason = reason
            if _kernel is None:
                log.info(
                    f"lightning_zeroq: the host Adam kernel is not used ({reason}); optimizer offload steps "
                    "with torch's fused CPU kernel"
                )
        return _kernel


def unavailable_reason() -> str:
    """Why ``host_adam()`` returned None ("" before the first call, or when it loaded)."""
    return _reason


NO_MATCH = "no variant of it steps bitwise as torch's fused kernel does on this machine"


def _load() -> tuple[Optional[HostAdam], str]:
    if os.environ.get("ZEROQ_HOST_KERNEL", "").strip().lower() in ("0", "false", "no", "off"):
        return None, "ZEROQ_HOST_KERNEL=0"
    reason = _build.missing(HOST_ADAM, jit=True)
    if reason is not None:
        return None, reason
    compiler = _build.c_compiler()
    assert compiler is not None  # missing() found it
    try:
        probe = _build_and_load(compiler, ("-DZQ_PROBE",))
        variant = _calibrate(probe)
        if variant is None:
            return None, NO_MATCH
        flags, width = variant
        kernel = _build_and_load(compiler, (f"-DZQ_BODY={flags}",))
    except (OSError, subprocess.CalledProcessError) as error:
        return None, _build.failed(HOST_ADAM, error)
    kernel.flags, kernel.width = flags, width
    if not _matches(kernel, (4096, width + width - 1, 3), torch.Generator().manual_seed(1)):
        return None, "its build with the variant fixed does not step as torch's fused kernel does"
    kernel.muon = _muon_matches(kernel, torch.Generator().manual_seed(2))
    if not kernel.muon:
        log.info(
            "lightning_zeroq: the host kernel's Muon parts do not match torch's ops here; offloaded Muon steps with torch's ops"
        )
    return kernel, ""


def _build_and_load(compiler: str, defines: tuple[str, ...]) -> HostAdam:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = _build.build_key(HOST_ADAM, compiler, version, _build.cpu_key(), *defines)
    return _build.build(
        HOST_ADAM,
        key,
        _build.compile_c(HOST_ADAM, compiler, defines),
        lambda library: HostAdam(ctypes.CDLL(str(library)), library),
    )
