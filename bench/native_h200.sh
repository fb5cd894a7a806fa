#!/usr/bin/env bash
# The check on the lent H200 (device tool, nvidia-h200) of the debian-full image's build steps, from the kit
# that bench/native_h200_kit.py packs: the image's Python 3.11 with torch's cp311 ABI files over the machine's
# torch 2.11.0+cu130, the image's TE torch extension (+ the locked TE core wheel), DeepEP and the aws-ofi-nccl
# plugin. bench/h200_carry.sh puts the kit and TE's core into the carry's `te` group; after
# `bash bench/h200_setup.sh te` (which joins and checks them: /tmp/joined/kit.tar.xz, /tmp/te-core) this runs:
#   1. NCCL 2.28.9 (the machine's) with NCCL_NET_PLUGIN=ofi, NCCL_DEBUG=INFO: does it load libnccl-net-ofi.so?
#   2. DeepEP: deep_ep.Buffer on 1 GPU (intranode), get_dispatch_layout, dispatch + combine of 1 rank.
#   3. TE: te.Linear forward/backward in bf16, against torch.nn.functional.linear (bench/te_linear_check.py).
# Usage there: bash bench/native_h200.sh   (output also in $OUT/native.log)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -f /tmp/joined/kit.tar.xz ] && [ -d /tmp/te-core ] || { echo "run bench/h200_setup.sh te first" >&2; exit 1; }
rm -rf /tmp/kit && mkdir /tmp/kit && tar -C /tmp/kit -xJf /tmp/joined/kit.tar.xz || exit 1
cp -rl --remove-destination /tmp/te-core/. /tmp/kit/site/ || exit 1  # as unpacking the core wheel over the py3 one
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
timeout 180 $py311 - <<'EOF' 2>&1 | grep -v '^/' | tail -25  # (a native backtrace's frames start with /)
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
PYPATH=$K/site timeout 180 $py311 "$here/te_linear_check.py" 2>&1 | tail -15
