#!/usr/bin/env bash
# On the lent H200 (device tool): gather what bench/h200_carry.sh prepared, then install it.
#   bash bench/h200_setup.sh stash DIR  copy the carried part DIR (bench/.scratch/carry/cN) into /tmp/carry
#                                       (/tmp is kept while the machine stays warm)
#   bash bench/h200_setup.sh te         once the carry's `te` group is complete: join and check its files,
#                                       unpack TE's core (each file checked against the wheel's RECORD) into
#                                       /tmp/te-core, install TE for the machine's Python into /tmp/site and
#                                       compile transformer-engine-torch against the machine's torch
#                                       (NVTE_CUDA_ARCHS=90; packed into $OUT/te-torch-build.tgz)
#   bash bench/h200_setup.sh install run   once the `run` group is there: hydra and omegaconf into /tmp/site,
#                                       sources into /tmp/src, rows into /tmp/rows (enough for the proxy models)
#   bash bench/h200_setup.sh install v4    once the `v4` group is there: tilelang, TileKernels, z3, tvm-ffi
#   bash bench/h200_setup.sh deepep     after `te`: build DeepEP (the carried source archive of the stack's
#                                       commit) for sm_90 against the machine's torch into /tmp/site, then
#                                       bench/deepep_check.py ($OUT/deepep.json)
#   bash bench/h200_setup.sh fht        after `te`: build fast-hadamard-transform (the carried git archive of the
#                                       commit miles' Dockerfile installs) for sm_90 against the machine's torch
#                                       into /tmp/site, then bench/hadamard_check.py ($OUT/hadamard.json)
# Afterwards: export PYTHONPATH=/tmp/site MEGATRON_LM_PATH=/tmp/src/Megatron-LM MILES_PATH=/tmp/src/miles
set -euo pipefail
carry=/tmp/carry
joined=/tmp/joined
site=/tmp/site
here=$(cd "$(dirname "$0")" && pwd)
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$@"; }
case "${1:-}" in
  stash)
    python3 "$here/carry_parts.py" stash "${2:?which carried part}" --to "$carry"
    ;;
  te)
    python3 "$here/carry_parts.py" join te --stash "$carry" --to "$joined"
    rm -rf /tmp/te-core && mkdir /tmp/te-core && tar -C /tmp/te-core -xJf "$joined/te-core.tar.xz"
    python3 "$here/carry_parts.py" check-record /tmp/te-core
    cd "$joined"
    pip_target transformer_engine-2.17.0-py3-none-any.whl pydantic-*.whl pydantic_core-*.whl annotated_types-*.whl \
      typing_inspection-*.whl nvdlfw_inspect-*.whl
    cp -rl --remove-destination /tmp/te-core/. "$site/"  # as unpacking the core wheel over the py3 one
    start=$(date +%s)
    rm -rf /tmp/te-torch-src /tmp/te-torch && mkdir -p /tmp/te-torch-src /tmp/te-torch
    if [ -f te-torch-build.tgz ]; then
      # an extension this script built earlier on such a machine (carried back from its $OUT)
      tar -xzf te-torch-build.tgz -C /tmp/te-torch
      echo "transformer-engine-torch: prebuilt $(sha256sum te-torch-build.tgz | cut -c1-16)"
    else
      tar -xzf transformer_engine_torch-2.17.0.tar.gz -C /tmp/te-torch-src --strip-components=1
      (cd /tmp/te-torch-src && PYTHONPATH=$site NVTE_CUDA_ARCHS=90 MAX_JOBS=16 NVTE_FRAMEWORK=pytorch \
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/te-torch . )
      echo "transformer-engine-torch compiled in $(( $(date +%s) - start )) s"
      if [ -n "${OUT:-}" ]; then tar -C /tmp/te-torch -czf "$OUT/te-torch-build.tgz" .; fi
    fi
    # the extension's .so must sit in the core wheel's transformer_engine/ tree
    cp -r /tmp/te-torch/. "$site/"
    LD_LIBRARY_PATH=$(bash "$here/h200_setup.sh" cudnn-dir):${LD_LIBRARY_PATH:-} PYTHONPATH=$site python3 -c "
import torch, transformer_engine.pytorch
from importlib.metadata import version
print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'TE', version('transformer-engine'))"
    ;;
  install)
    group=${2:-run}
    python3 "$here/carry_parts.py" join "$group" --stash "$carry" --to "$joined"
    cd "$joined"
    if [ "$group" = run ]; then
      pip_target hydra_core-*.whl omegaconf-*.whl transformers-*.whl tokenizers-*.whl huggingface_hub-*.whl \
        safetensors-*.whl
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" \
        antlr4-python3-runtime-4.9.3.tar.gz
      rm -rf /tmp/src /tmp/rows && mkdir -p /tmp/src /tmp/rows
      tar -xzf Megatron-LM.tar.gz -C /tmp/src && tar -xzf miles.tar.gz -C /tmp/src && tar -xf rows.tar -C /tmp/rows
      check="import hydra, omegaconf, transformers, tokenizers; print('transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
    else
      pip_target tilelang-*.whl apache_tvm_ffi-*.whl torch_c_dlpack_ext-*.whl tile_kernels-*.whl z3_solver-*.whl
      # as the worker imports them: TileKernels 1.0.0 under tilelang 0.1.15 needs the worker's module alias
      check="import sys; sys.path.insert(0, '$here/..'); from trainer.launch.megatron_worker import tilelang_compat; \
tilelang_compat(); import tilelang, tile_kernels; print('tilelang', tilelang.__version__)"
    fi
    LD_LIBRARY_PATH=$(bash "$here/h200_setup.sh" cudnn-dir):${LD_LIBRARY_PATH:-} PYTHONPATH=$site python3 -c "$check"
    ;;
  fht)
    # The package's setup.py compiles for every architecture its nvcc knows (sm_75 ... sm_121 with CUDA 13);
    # the copy built here keeps only the pair for sm_90 (H200), as NVTE_CUDA_ARCHS=90 does for TE. The build is
    # the package's own (`pip install --no-build-isolation`, FAST_HADAMARD_TRANSFORM_FORCE_BUILD so that no
    # prebuilt wheel is fetched).
    rm -rf /tmp/fht-src && mkdir -p /tmp/fht-src
    tar -xzf "$joined/fast-hadamard-transform.tar.gz" -C /tmp/fht-src --strip-components=1
    python3 - /tmp/fht-src/setup.py <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
pair = r'cc_flag\.append\("-gencode"\)\s*cc_flag\.append\("arch=compute_(\d+),code=sm_\d+"\)'
kept = re.sub(pair, lambda m: m.group(0) if m.group(1) == "90" else "pass", text)
assert kept.count("compute_90") == 1 and kept.count("-gencode") == 1, "setup.py: its gencode list changed"
open(path, "w").write(kept)
PY
    start=$(date +%s)
    (cd /tmp/fht-src && FAST_HADAMARD_TRANSFORM_FORCE_BUILD=TRUE NVCC_THREADS=4 MAX_JOBS=16 \
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" . )
    echo "fast-hadamard-transform compiled in $(( $(date +%s) - start )) s"
    sha256sum "$site"/fast_hadamard_transform_cuda*.so
    PYTHONPATH=$site python3 "$here/hadamard_check.py" --out "${OUT:-/tmp}/hadamard.json"
    ;;
  deepep)
    # DeepEP at the stack's commit (the archive the debian-full image builds from, carried in the `te` group),
    # built for the machine's Python 3.12 and torch as the image's build step does (TORCH_CUDA_ARCH_LIST=9.0,
    # NVSHMEM from torch's nvidia-nvshmem-cu13), then one rank's dispatch and combine through deep_ep.Buffer.
    # The recipe installs it and its alltoall dispatcher does not use it (the card's stack); Megatron's flex
    # dispatcher, which would, needs TP x EP > 1 (token_dispatcher.py), more than one GPU.
    rm -rf /tmp/deepep-src && mkdir -p /tmp/deepep-src
    tar -xf "$joined"/DeepEP-*.tar -C /tmp/deepep-src
    src=$(dirname "$(ls /tmp/deepep-src/*/setup.py /tmp/deepep-src/setup.py 2>/dev/null | head -n 1)")
    start=$(date +%s)
    # nvshmem.h (torch's nvidia-nvshmem-cu13) includes <cuda/std/tuple>, which CUDA 13 keeps under include/cccl:
    # without it the host compiler stops on deep_ep.cpp (2026-12-06, CUDA 13.0.88)
    (cd "$src" && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
      CPLUS_INCLUDE_PATH="/usr/local/cuda/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
      python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" . )
    echo "DeepEP compiled in $(( $(date +%s) - start )) s"
    sha256sum "$site"/deep_ep_cpp*.so
    PYTHONPATH=$site NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29534 \
      timeout 180 python3 "$here/deepep_check.py" --out "${OUT:-/tmp}/deepep.json"
    ;;
  cudnn-dir)
    # the directory of the pip cuDNN that torch was built against (the lock's nvidia-cudnn-cu13). The machine
    # also has an apt libcudnn9-cuda-13 (9.14) in the loader's cache, which otherwise shadows it (miles'
    # docker/Dockerfile removes the apt copy for that reason: "the loader interleaves the two").
    python3 -c "import pathlib, torch; sp = pathlib.Path(torch.__file__).parents[1]; print(sorted(sp.glob('nvidia/**/libcudnn.so.9'))[0].parent)"
    ;;
  *) echo "usage: $0 stash DIR | te | install run|v4 | fht | deepep | cudnn-dir" >&2; exit 2 ;;
esac
