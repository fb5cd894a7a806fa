#!/usr/bin/env bash
# The check on the lent H200 (device tool, nvidia-h200) of the debian-full image's build steps, from the kit
# that bench/native_h200_kit.py packs: the image's Python 3.11 with torch's cp311 ABI files over the machine's
# torch 2.11.0+cu130, the image's TE torch extension (+ the locked TE core wheel), DeepEP and the aws-ofi-nccl
# plugin. Each call carries one kit part (kit.tar.xz.NN) and copies it to /tmp/kit-parts; the last call joins them,
# checks the sha256 and runs:
#   1. NCCL 2.28.9 (the machine's) with NCCL_NET_PLUGIN=ofi, NCCL_DEBUG=INFO: does it load libnccl-net-ofi.so?
#   2. DeepEP: deep_ep.Buffer on 1 GPU (intranode), get_dispatch_layout, dispatch + combine of 1 rank.
#   3. TE: te.Linear forward/backward in bf16, against torch.nn.functional.linear.
# Usage there: bash native_h200.sh PART_DIR [--run KIT_SHA256 [TE_CORE_SHA256]]
set -uo pipefail
part=$1
mkdir -p /tmp/kit-parts && cp "$part"/* /tmp/kit-parts/ && ls -la /tmp/kit-parts
[ "${2:-}" = "--run" ] || exit 0
cat /tmp/kit-parts/kit.tar.xz.* > /tmp/kit.tar.xz
echo "$3  /tmp/kit.tar.xz" | sha256sum -c - || exit 1
rm -rf /tmp/kit && mkdir /tmp/kit && tar -C /tmp/kit -xJf /tmp/kit.tar.xz || exit 1
if [ -n "${4:-}" ]; then
  cat /tmp/kit-parts/te-core.whl.* > /tmp/te-core.whl
  echo "$4  /tmp/te-core.whl" | sha256sum -c - || exit 1
  python3 -m zipfile -e /tmp/te-core.whl /tmp/kit/site/ || exit 1
fi
K=/tmp/kit
dev_site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "machine torch in $dev_site: $(python3 -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())')"
# torch for the image's Python: the machine's torch tree, with the two cp311 ABI files of the locked wheel
mkdir -p $K/site/torch/lib
for e in "$dev_site"/torch/*; do b=$(basename "$e"); [ "$b" = lib ] || ln -sfn "$e" $K/site/torch/$b; done
for e in "$dev_site"/torch/lib/*; do ln -sfn "$e" $K/site/torch/lib/; done
rm -f $K/site/torch/lib/libtorch_python.so
cp $K/torch311/torch/lib/libtorch_python.so $K/site/torch/lib/
cp $K/torch311/torch/_C.cpython-311-x86_64-linux-gnu.so $K/site/torch/
for d in nvidia functorch torchgen; do [ -e "$dev_site/$d" ] && ln -sfn "$dev_site/$d" $K/site/$d; done
libs=$K/image/opt/aws-ofi-nccl/lib:$K/root/usr/lib/x86_64-linux-gnu:$K/root/usr/lib/libpsm1:$dev_site/nvidia/nvshmem/lib:$dev_site/nvidia/cu13/lib
cat > $K/py311 <<SH
#!/bin/sh
exec env PYTHONHOME=$K/root/usr PYTHONPATH=\${PYPATH:-$K/site} LD_LIBRARY_PATH=$libs PYTHONNOUSERSITE=1 $K/root/usr/bin/python3.11 "\$@"
SH
chmod +x $K/py311
py311=$K/py311
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533
echo "=== image python: $($py311 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())' 2>&1 | tail -1)"
echo "=== 1. aws-ofi-nccl plugin into NCCL $(python3 -c 'import torch; print(torch.cuda.nccl.version())')"
ls -la $K/image/opt/aws-ofi-nccl/lib
NCCL_DEBUG=INFO NCCL_NET_PLUGIN=ofi LD_LIBRARY_PATH=$libs timeout 120 python3 -c '
import torch, torch.distributed as dist
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
x = torch.ones(4, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize(); print("allreduce", x.tolist())
dist.destroy_process_group()' 2>&1 | grep -E "NET/|Plugin|plugin|OFI|allreduce|Error|error" | head -40
echo "=== 2. DeepEP"
timeout 180 $py311 - <<'EOF' 2>&1 | tail -25
import torch, torch.distributed as dist
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
import deep_ep
print("deep_ep from", deep_ep.__file__)
buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=256 << 20, num_rdma_bytes=0)
print("Buffer ok, sm90 compiled", deep_ep.Buffer.is_sm90_compiled())
cfg = deep_ep.Config(deep_ep.Buffer.num_sms, 6, 256, 6, 128)  # the 2-8 rank intranode config (none for 1 rank)
T, H, E, K = 128, 2048, 8, 2
x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
topk = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).to(torch.int64)
w = torch.rand(T, K, dtype=torch.float32, device="cuda")
per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
print("layout", per_rank.tolist(), per_expert.tolist())
rx, rtopk, rw, counts, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_tokens_per_rank=per_rank,
                                                 is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, config=cfg)
y, _, _ = buf.combine(rx, handle, config=cfg)
print("dispatch+combine 1 rank: max |combine(dispatch(x)) - x| =", (y.float() - x.float()).abs().max().item())
dist.destroy_process_group()
EOF
echo "=== 3. TE"
# TE imports triton at `import transformer_engine.pytorch` (its triton kernels: cross entropy, permutation);
# the locked cp311 triton (libtriton.so alone is 415 MB) does not fit the device budget, and te.Linear uses no
# triton kernel, so this check (not the image) gives the image's Python an import-only stand-in for triton
mkdir -p $K/shim/triton
cat > $K/shim/triton/__init__.py <<'PY'
"""Import-only stand-in for triton in the H200 check of the image's TE build (no kernel can run)."""
import sys, types
__version__ = "3.6.0"
def _plain(name):
    if name.startswith("__"):  # __path__, __spec__, ...: the import system must not see a package here
        raise AttributeError(name)
class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any()
    def __getattr__(self, name): _plain(name); return _Any()
    def __getitem__(self, key): return _Any()
    def __iter__(self): return iter(())
def _decorator(*a, **k):
    return a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda f: f)
jit = autotune = heuristics = _decorator
Config = _Any
class _Mod(types.ModuleType):
    def __getattr__(self, name): _plain(name); return _Any()
for name in ("language", "language.core", "runtime", "runtime.jit", "compiler", "compiler.compiler", "backends",
             "backends.compiler", "testing"):
    mod = _Mod(f"triton.{name}"); sys.modules[f"triton.{name}"] = mod
    parent, _, child = f"triton.{name}".rpartition(".")
    setattr(sys.modules[parent], child, mod)
PY
PYPATH=$K/site:$K/shim timeout 180 $py311 - <<'EOF' 2>&1 | tail -15
import torch
import transformer_engine, transformer_engine.pytorch as te, sys
ext = [m.__file__ for n, m in sys.modules.items() if n.startswith("transformer_engine_torch") and getattr(m, "__file__", None)]
print("te", transformer_engine.__version__, "torch extension loaded from", ext)
torch.manual_seed(0)
lin = te.Linear(1024, 1024, bias=True, params_dtype=torch.bfloat16).cuda()
x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
y = lin(x); y.float().sum().backward()
ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
print("te.Linear fwd max rel err", ((y - ref).abs().max() / ref.abs().max()).item(),
      "grad x finite", bool(torch.isfinite(x.grad).all()), "grad w norm", lin.weight.grad.float().norm().item())
EOF
