"""DeepEP as built for the machine's Python, on one GPU: what one rank can run of it.

DeepEP 1.2.1's intranode dispatch and combine kernels are instantiated for 2, 4 and 8 ranks only
(``csrc/kernels/intranode.cu``: "Unsupported ranks" otherwise), so one GPU runs the rest: the extension loads
(``deep_ep_cpp``, its version from the distribution metadata), ``Buffer.is_sm90_compiled()``, an intranode
``deep_ep.Buffer`` over a one-rank NCCL group (256 MiB of NVLink buffer), and ``get_dispatch_layout`` on the
recipe's routing shape (8,192 tokens, top-6 over 256 experts; seeded random choices without repeats), whose
per-expert, per-rank and token-in-rank outputs are compared with ``torch.bincount`` of the same indices. The buffer
is made with ``explicitly_destroy=True`` (DeepEP's destructor at interpreter exit aborted on 2026-12-01) and
not destroyed: that runs a barrier kernel of 2, 4 or 8 ranks only; the process ends by ``os._exit``.

Usage (on the GPU machine, DeepEP on PYTHONPATH): python3 bench/deepep_check.py --out FILE.json
Exit 0 when every comparison matches, 1 otherwise; the JSON holds each figure.
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import metadata

import torch
import torch.distributed as dist

TOKENS, TOPK, EXPERTS = 8192, 6, 256  # the recipe's 8,192-token row, moe_router_topk 6, num_experts 256


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    import deep_ep

    result = {
        "deep_ep": deep_ep.__file__,
        "version": metadata.version("deep_ep"),
        "sm90_compiled": bool(deep_ep.Buffer.is_sm90_compiled()),
        "shape": {"tokens": TOKENS, "topk": TOPK, "experts": EXPERTS},
    }
    buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=256 << 20, num_rdma_bytes=0, explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(TOKENS, EXPERTS, device="cuda", generator=gen)
    topk = scores.argsort(dim=1)[:, :TOPK].to(torch.int64).contiguous()  # DeepEP asserts a contiguous topk_idx
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, EXPERTS)
    torch.cuda.synchronize()
    want_expert = torch.bincount(topk.flatten(), minlength=EXPERTS)
    checks = {
        "num_tokens_per_expert == bincount": bool(torch.equal(per_expert.long(), want_expert)),
        "num_tokens_per_rank == tokens": per_rank.tolist() == [TOKENS],
        "num_tokens_per_rdma_rank is None (intranode)": per_rdma_rank is None,
        "is_token_in_rank all true": bool(in_rank.all().item()) and tuple(in_rank.shape) == (TOKENS, 1),
    }
    result["num_tokens_per_expert"] = {
        "sum": int(per_expert.sum().item()),
        "min": int(per_expert.min().item()),
        "max": int(per_expert.max().item()),
    }
    result["checks"] = checks
    result["ok"] = all(checks.values()) and result["sm90_compiled"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1), flush=True)
    # Buffer.destroy() runs the intranode barrier kernel, which also takes 2, 4 or 8 ranks only
    # (csrc/kernels/runtime.cu: "Unsupported ranks" at one rank, seen 2026-12-06); the process ends without it
    # (os._exit: no destructor runs on the half-torn-down buffer)
    dist.destroy_process_group()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    raise SystemExit(main())
