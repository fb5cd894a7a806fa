"""The ``fast_hadamard_transform`` CUDA package against the bundle's torch stand-in, on a GPU.

miles 78527b91 calls ``hadamard_transform(x, scale=x.size(-1) ** -0.5)`` on bf16 tensors
(``miles_plugins/models/deepseek_v4/ops/utils.py`` ``rotate_activation``): the indexer's queries (last dimension
``dsa_indexer_head_dim`` 128) and the compressor's keys (``kv_lora_rank`` 512). For each width, on the recipe's
8,192 tokens: the forward and the backward (the gradient of ``sum(out * g)``) of the package and of
``trainer.models.hadamard``, each against a float64 reference ``(x @ H_n) * scale`` (Sylvester order), as the
maximum absolute error and the maximum error relative to the reference's largest magnitude; the two bf16 outputs
against each other (elements that differ; the largest difference over bf16's epsilon times the reference's
largest magnitude); and the median time per call of each (CUDA events, 20 calls after 3 warm-ups).

Usage (on the GPU machine): python3 bench/hadamard_check.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.models import hadamard  # noqa: E402

# (name, leading shape, width): the indexer's queries [tokens, 64 heads, 128]; the compressor's keys [tokens, 512]
SHAPES = [("indexer q", (8192, 64), 128), ("compressor kv", (8192,), 512)]


def reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x @ H_n) * scale`` in float64 with the Sylvester-ordered Hadamard matrix (width a power of two)."""
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64, device=x.device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (x.double() @ h) * scale


def run(fn, x: torch.Tensor, g: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward output and input gradient of ``fn`` for the output gradient ``g``."""
    xi = x.detach().clone().requires_grad_(True)
    out = fn(xi, scale)
    out.backward(g)
    assert xi.grad is not None
    return out.detach(), xi.grad.detach()


def time_ms(fn, x: torch.Tensor, scale: float) -> float:
    """Median milliseconds of one forward call (CUDA events, 3 warm-ups, 20 timed)."""
    for _ in range(3):
        fn(x, scale)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, scale)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def errors(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Maximum absolute error and that error over the reference's largest magnitude."""
    diff = (got.double() - want).abs().max().item()
    return {"max_abs": diff, "max_rel": diff / want.abs().max().item()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    out_path = parser.parse_args().out
    import fast_hadamard_transform as fht

    real = fht.hadamard_transform
    results = {
        "package": getattr(fht, "__version__", None),
        "package_file": fht.__file__,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": [],
    }
    torch.manual_seed(0)
    for name, lead, width in SHAPES:
        x = torch.randn(*lead, width, device="cuda", dtype=torch.bfloat16)
        g = torch.randn_like(x)
        scale = width**-0.5
        want_out = reference(x.float(), scale)
        want_grad = reference(g.float(), scale)  # H_n is symmetric: the gradient is the same transform of g
        real_out, real_grad = run(real, x, g, scale)
        torch_out, torch_grad = run(hadamard.hadamard_transform, x, g, scale)
        ulp = torch.finfo(torch.bfloat16).eps * want_out.abs().max().item()
        between = (real_out.double() - torch_out.double()).abs()
        results["shapes"].append(
            {
                "name": name,
                "shape": [*lead, width],
                "package_forward": errors(real_out, want_out),
                "package_backward": errors(real_grad, want_grad),
                "stand_in_forward": errors(torch_out, want_out),
                "stand_in_backward": errors(torch_grad, want_grad),
                "outputs_differ": int((between > 0).sum().item()),
                "elements": x.numel(),
                "max_difference_in_bf16_eps": (between / ulp).max().item(),
                "package_ms": time_ms(real, x, scale),
                "stand_in_ms": time_ms(hadamard.hadamard_transform, x, scale),
            }
        )
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
