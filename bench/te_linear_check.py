"""TransformerEngine's ``te.Linear`` forward and backward on the GPU, against ``torch.nn.functional.linear``.

    python te_linear_check.py [--standin-only]

Run by bench/native_h200.sh with the debian-full image's Python 3.11, so that the TE torch extension that
``trainer image build`` compiled (``transformer_engine/wheel_lib/transformer_engine_torch.cpython-311-*.so``)
is the one that loads. Prints one JSON line: TE's version, the extension's file, whether triton was real or
the stand-in, the forward's max relative error (bf16 GEMM vs torch's), and whether the gradients are finite.
Exit 0 when the error is below 2e-2 and the gradients are finite, 1 otherwise.

``import transformer_engine.pytorch`` imports TE's triton kernels (cross entropy, permutation, padding,
hyper-connections: ``transformer_engine/common/triton/``), which decorate functions with ``triton.jit`` and
``triton.autotune`` at import. The image's triton for CPython 3.11 (``libtriton.so`` alone is 415 MB) does not
fit the device time, and ``te.Linear`` runs no triton kernel (its GEMM is cuBLAS through the extension). When
triton is not importable, an import-only stand-in answers those decorators; torch's own triton probe
(``torch.utils._triton.has_triton_package``, cached) runs before the stand-in exists and sees no triton, so
torch's compiler never reaches the stand-in. ``--standin-only`` imports just TE's triton kernel files with the
stand-in (no GPU, no TE package import): the check that the stand-in covers what those files use at import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path


class _Anything:
    """Any attribute, call, subscript or decorator use answers another ``_Anything`` (a decorator returns the
    function it decorates). Dunder attributes raise ``AttributeError``, so the import system and ``inspect``
    see a plain object."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __iter__(self):
        return iter(())


def _decorator(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


class _StandinModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in ("jit", "autotune", "heuristics", "constexpr_function"):
            return _decorator
        return _Anything()


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``triton`` and every ``triton.*`` module as a :class:`_StandinModule` package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        if spec.name == "triton":
            module.__version__ = "0.0.0+standin"
        return module

    def exec_module(self, module):
        pass


def install_triton_standin() -> bool:
    """Install the stand-in when triton is not importable; returns whether it did. torch's compiler modules
    are imported first, so their triton probe has answered "no triton" before the stand-in appears."""
    if importlib.util.find_spec("triton") is not None:
        return False
    try:
        import torch._dynamo  # noqa: F401
        import torch._inductor.config  # noqa: F401
        from torch.utils._triton import has_triton_package

        has_triton_package()  # cached: False, so torch's compiler never imports the stand-in
    except Exception as exc:  # the check goes on; the JSON line says what torch's compiler import raised
        print(json.dumps({"torch_compiler_import": repr(exc)[:200]}))
    sys.meta_path.insert(0, _StandinFinder())
    return True


def standin_only() -> int:
    """Exec TE's triton kernel files (found through the ``transformer_engine`` distribution, without importing
    the package) with the stand-in; prints how many ran and exits 0, or raises what a file raised."""
    from importlib.metadata import distribution

    sys.meta_path.insert(0, _StandinFinder())
    dist = distribution("transformer-engine")
    files = [
        f
        for f in dist.files or []
        if "/triton/" in str(f) and str(f).endswith(".py") and str(f).startswith("transformer_engine/common/")
    ]
    for f in files:
        path = Path(str(dist.locate_file(f)))
        code = compile(path.read_text(), str(path), "exec")
        exec(code, {"__name__": f"standin_check.{path.stem}", "__file__": str(path)})
    print(json.dumps({"standin_files": len(files)}))
    return 0 if files else 1


def main(argv) -> int:
    """Run the check (``argv``: ``[]`` or ``["--standin-only"]``); needs a CUDA GPU and TE importable. Prints
    the JSON line of the module docstring; returns 0 when the bf16 forward's max relative error is below 2e-2
    and the input and weight gradients are finite, else 1."""
    if "--standin-only" in argv:
        return standin_only()
    import torch

    standin = install_triton_standin()
    import transformer_engine
    import transformer_engine.pytorch as te

    ext = sorted(
        {
            file
            for n, m in list(sys.modules.items())
            if n.startswith("transformer_engine_torch") and (file := getattr(m, "__file__", None))
        }
    )
    torch.manual_seed(0)
    lin = te.Linear(1024, 1024, bias=True, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    y = lin(x)
    y.float().sum().backward()
    ref = torch.nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    err = ((y.detach() - ref).abs().max() / ref.abs().max()).item()
    finite = x.grad is not None and bool(torch.isfinite(x.grad).all()) and bool(torch.isfinite(lin.weight.grad).all())
    print(
        json.dumps(
            {
                "te": transformer_engine.__version__,
                "torch": torch.__version__,
                "extension": ext,
                "python": sys.version.split()[0],
                "triton": "stand-in" if standin else "real",
                "fwd_max_rel_err": err,
                "grads_finite": finite,
                "grad_w_norm": lin.weight.grad.float().norm().item(),
            }
        )
    )
    return 0 if err < 2e-2 and finite else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
