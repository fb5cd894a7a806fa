#!/usr/bin/env bash
# Prepare, on this machine, what the H200 runs of bench/RESULTS.md carry (the device tool moves at most 64 MiB
# per call and the machine reaches no registry): every wheel hash-checked against the lock, TransformerEngine's
# core wheel unpacked and xz-compressed (245 MB -> about 192 MB; checked there file by file against the wheel's
# RECORD), the image's build outputs with the image's Python (bench/native_h200_kit.py), the locked Megatron-LM
# and miles commits as `git archive` tarballs, the fixed rows. All of it is cut into parts of 60 MiB
# (bench/carry_parts.py), the files TE needs first. Nothing here is committed (bench/.scratch/ is ignored).
#
# Usage: bash bench/h200_carry.sh MEGATRON_LM MILES [FAST_HADAMARD_TRANSFORM_GIT_DIR]
#   MEGATRON_LM, MILES: bare git directories or clones holding the commits that lockfiles/stack.json pins, or
#   `git archive --format=tar.gz` files of those commits (their git trees are checked there by the worker);
#   the third: a git directory of Dao-AILab/fast-hadamard-transform holding the commit miles' Dockerfile
#   installs (its tree checked here), built there by `bash bench/h200_setup.sh fht`.
#   NO_KIT=1 leaves out the image's build outputs (step 3; bench/native_h200.sh then has nothing to run).
# Then carry bench/.scratch/carry/cN, one device call each and back to back (a machine idle 30 s is given back,
# losing /tmp), each call starting with `python3 bench/carry_parts.py stash DIR` (DIR = the carried folder as
# the call's working tree holds it); once the `te` group is complete, `bash bench/h200_setup.sh te` (TE for the
# machine's Python, its torch extension compiled there in about 100 s) and `bash bench/native_h200.sh` (the
# image's TE extension, DeepEP and aws-ofi-nccl, from the kit); once the `run` group is there, `bash
# bench/h200_setup.sh install run` (enough for the proxy models), and with the `v4` group `bash bench/h200_setup.sh
# install v4`; then `bash bench/h200_bench.sh RUN...`.
# The kit is made from the debian-full image's built layers in the content-addressed cache: when the image's build
# steps (transformer-engine-torch, deepep, aws-ofi-nccl) are not built there, this stops before any download with
# one line naming them and the `trainer image build` that makes them (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
megatron_git=${1:?usage: $0 MEGATRON_LM MILES [FAST_HADAMARD_TRANSFORM_GIT_DIR]}
miles_git=${2:?usage: $0 MEGATRON_LM MILES [FAST_HADAMARD_TRANSFORM_GIT_DIR]}
fht_git=${3:-}
# fast-hadamard-transform as miles 78527b91 docker/Dockerfile installs it (pip install git+...@this commit)
fht_commit=e7706faf8d1c3b9f241e36860640ad1dac644ede
fht_tree=0d464b6162be2f0363fb0ad0af1637c1af3ba96d
python=$(bin/python-env)
steps="transformer-engine-torch deepep aws-ofi-nccl"
build="bin/trainer image build --lock lockfiles/debian-full.lock.json --out build/debian-full.oci --jobs 2"
# 0. The image's build outputs that step 3 packs must be built (cached layers of lockfiles/debian-full.lock.json)
missing=""
[ "${NO_KIT:-0}" = 1 ] || missing=$(STEPS="$steps" "$python" -c '
import os
from pathlib import Path
from trainer.image.cas import Cache
from trainer.lock.imagelock import load_lock
from trainer.image.native import step_keys
keys = step_keys(load_lock(Path("lockfiles/debian-full.lock.json")))
cache = Cache()
missing = [s for s in os.environ["STEPS"].split() if cache.layer_record(keys[s]) is None]
print(", ".join(missing) + f" (cache {cache.root})" if missing else "")')
if [ -n "$missing" ]; then
  echo "bench/h200_carry.sh: the debian-full image's build steps are not built: $missing; the kit needs the TE torch extension, DeepEP and aws-ofi-nccl: build them with $build" >&2
  exit 1
fi
dl=bench/.scratch/dl
carry=bench/.scratch/carry
mkdir -p "$dl"
stage=bench/.scratch/stage
rm -rf "$carry" "$stage" && mkdir -p "$stage"

# 1. Wheels and the TE torch sdist, by URL and sha256 from lockfiles/full.lock.json (pip checks the hash).
"$python" - > "$dl/urls.txt" <<'EOF'
import json
lock = json.load(open("lockfiles/full.lock.json"))
names = {"transformer-engine-cu13", "transformer-engine", "transformer-engine-torch", "pydantic", "pydantic-core",
         "annotated-types", "typing-inspection", "nvdlfw-inspect", "tilelang", "apache-tvm-ffi",
         "torch-c-dlpack-ext", "z3-solver", "transformers", "tokenizers", "huggingface-hub", "safetensors"}
found = [f for group in ("wheels", "sdists") for f in lock[group] if f["name"] in names]
assert {f["name"] for f in found} == names, sorted(names - {f["name"] for f in found})
for f in found:
    print(f"{f['url']}#sha256={f['sha256']} {f['filename']} {f['sha256']}")
EOF
# TileKernels (deepseek-ai) is not in the lock: miles 78527b91 docker/Dockerfile installs
# `pip install --no-deps tile_kernels==1.0.0`; its hash pinned here as PyPI served it on 2026-12-01.
echo "https://files.pythonhosted.org/packages/py3/t/tile_kernels/tile_kernels-1.0.0-py3-none-any.whl#sha256=9f1e09c1bccde32f3189d1ff32ba9725f86fc04ac1d0ac93284e16fcab1a5666 tile_kernels-1.0.0-py3-none-any.whl 9f1e09c1bccde32f3189d1ff32ba9725f86fc04ac1d0ac93284e16fcab1a5666" >> "$dl/urls.txt"
cas=$("$python" -c "from trainer.image.cas import default_root; print(default_root())")
while read -r url file sha; do
  # the bundle's content-addressed cache may hold it already (`trainer image build` fetched it); checked below
  if [ ! -f "$dl/$file" ] && [ -f "$cas/sha256/$sha" ]; then cp "$cas/sha256/$sha" "$dl/$file"; fi
  if [ ! -f "$dl/$file" ] || [ "$(sha256sum "$dl/$file" | cut -d' ' -f1)" != "$sha" ]; then
    case "$file" in
      tile_kernels-*) python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$dl" tile_kernels==1.0.0 ;;
      *.tar.gz) curl -fsSL -o "$dl/$file.part" "${url%%#*}" && mv "$dl/$file.part" "$dl/$file" ;;
      *) python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dl" "$url" ;;
    esac
  fi
  echo "$sha  $dl/$file" | sha256sum -c --quiet - || { echo "$file: sha256 differs from the lock" >&2; exit 1; }
done < "$dl/urls.txt"
# the bundle's own needs there (the machine has yaml, pyarrow, rich): hydra-core, omegaconf, antlr4 (an sdist),
# hash-pinned by lockfiles/launcher.lock
for name in antlr4-python3-runtime hydra-core omegaconf; do
  awk -v n="$name" '$0 ~ "^"n"==" {on=1; print; next} on && /^ +--hash/ {print; next} {on=0}' lockfiles/launcher.lock
done > "$dl/launcher-reqs.txt"
python3 -m pip download -q --no-deps --require-hashes -d "$dl" -r "$dl/launcher-reqs.txt"

# 2. TransformerEngine's core wheel (hash-checked above), unpacked and recompressed: xz of the files is 21%
#    smaller than the wheel's deflate; the wheel's RECORD travels inside and is checked there
te=transformer_engine_cu13-2.17.0-py3-none-manylinux_2_28_x86_64.whl
if [ ! -f "$dl/te-core.tar.xz" ] || [ "$dl/te-core.tar.xz" -ot "$dl/$te" ]; then
  rm -rf "$dl/te-core" && mkdir "$dl/te-core" && python3 -m zipfile -e "$dl/$te" "$dl/te-core"
  python3 bench/carry_parts.py check-record "$dl/te-core"
  tar -C "$dl/te-core" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -6 -T2 > "$dl/te-core.tar.xz.tmp"
  mv "$dl/te-core.tar.xz.tmp" "$dl/te-core.tar.xz" && rm -rf "$dl/te-core"
fi

# 3. The image's build outputs with the image's Python 3.11 (all from the content-addressed cache)
if [ "${NO_KIT:-0}" != 1 ]; then
kit=$("$python" bench/native_h200_kit.py --out "$stage/kit" --no-te-core --parts 1000 | tail -n 1)
STEPS="$steps" KIT="$kit" BUILD="$build" "$python" -c '
import json, os, sys
missing = [s for s in os.environ["STEPS"].split() if s not in json.loads(os.environ["KIT"])["built"]]
if missing:
    sys.exit(f"bench/h200_carry.sh: the kit lacks the build step(s) {chr(44).join(missing)}; build them with: " + os.environ["BUILD"])' || exit 1
cat "$stage"/kit/part-00/kit.tar.xz.* > "$stage/kit.tar.xz" && rm -rf "$stage/kit"
fi

# 4. The locked sources (git archive of the pinned commits; the worker checks their git trees again there).
read -r megatron_commit miles_commit < <("$python" -c "
import json; c = json.load(open('lockfiles/stack.json'))['components']; print(c['megatron_lm']['commit'], c['miles']['commit'])")
archive() {  # archive SOURCE PREFIX COMMIT OUT: a git directory's commit, or an archive file as it is
  if [ -f "$1" ]; then cp "$1" "$4"; else git --git-dir="$1" archive --format=tar.gz --prefix="$2/" "$3" > "$4"; fi
}
archive "$megatron_git" Megatron-LM "$megatron_commit" "$stage/Megatron-LM.tar.gz"
archive "$miles_git" miles "$miles_commit" "$stage/miles.tar.gz"
if [ -n "$fht_git" ]; then
  got=$(git --git-dir="$fht_git" rev-parse "$fht_commit^{tree}")
  [ "$got" = "$fht_tree" ] || { echo "$fht_git: commit $fht_commit has tree $got, expected $fht_tree" >&2; exit 1; }
  git --git-dir="$fht_git" archive --format=tar.gz --prefix=fast-hadamard-transform/ "$fht_commit" > "$stage/fast-hadamard-transform.tar.gz"
fi

# DeepEP at the commit the stack pins, as the debian-full image builds it: its source archive from the
# content-addressed cache (hash-checked against the lock), built there for the machine's Python by
# `bash bench/h200_setup.sh deepep`
read -r deepep_sha deepep_file < <("$python" -c "
import json; s = [s for s in json.load(open('lockfiles/debian-full.lock.json'))['sources'] if s['name'] == 'deepep'][0]
print(s['archive']['sha256'], s['archive']['filename'])")
[ -f "$cas/sha256/$deepep_sha" ] || { echo "DeepEP: source archive $deepep_sha not in the cache $cas; $build fetches it" >&2; exit 1; }
cp "$cas/sha256/$deepep_sha" "$stage/$deepep_file"
echo "$deepep_sha  $stage/$deepep_file" | sha256sum -c --quiet - || { echo "$deepep_file: sha256 differs from the lock" >&2; exit 1; }

# 5. The fixed rows: 4,096-token (proxy) and 8,192-token (dsv4-tiny) builds of the same generated conversations.
if [ ! -f bench/.scratch/rows-8192/manifest.json ]; then
  "$python" -m trainer data example --out bench/.scratch/conv-2400.jsonl --conversations 2400 --seed 1
  "$python" -m trainer data build --input bench/.scratch/conv-2400.jsonl --out bench/.scratch/rows-4096 --row-tokens 4096 --data synthetic-4096
  "$python" -m trainer data build --input bench/.scratch/conv-2400.jsonl --out bench/.scratch/rows-8192 --row-tokens 8192 --data synthetic-8192
fi
tar -C bench/.scratch -cf "$stage/rows.tar" rows-4096 rows-8192

# 6. The parts: TE's files first (the calls that bring them can already run the TE checks), then the rest
te_files="$dl/te-core.tar.xz"
[ -f "$stage/kit.tar.xz" ] && te_files="$te_files,$stage/kit.tar.xz"
[ -f "$stage/fast-hadamard-transform.tar.gz" ] && te_files="$te_files,$stage/fast-hadamard-transform.tar.gz"
te_files="$te_files,$stage/$deepep_file"
for f in transformer_engine-2.17.0-py3-none-any.whl transformer_engine_torch-2.17.0.tar.gz pydantic-2.14.4-py3-none-any.whl \
         pydantic_core-2.50.5-*.whl annotated_types-*.whl typing_inspection-*.whl nvdlfw_inspect-*.whl; do
  te_files="$te_files,$(ls "$dl"/$f)"
done
# transformer-engine-torch built there by an earlier `h200_setup.sh te` (its $OUT/te-torch-build.tgz), if kept in
# bench/.scratch/: the setup then skips the 100-s compile
if [ -f bench/.scratch/te-torch-build.tgz ]; then te_files="$te_files,bench/.scratch/te-torch-build.tgz"; fi
# what every run needs (the bundle's own packages, the sources, the rows), then what only the V4 model needs
run_files="$stage/Megatron-LM.tar.gz,$stage/miles.tar.gz,$stage/rows.tar"
for f in hydra_core-1.3.8-py3-none-any.whl omegaconf-2.3.1-py3-none-any.whl antlr4-python3-runtime-4.9.3.tar.gz \
         transformers-*.whl tokenizers-*.whl huggingface_hub-*.whl safetensors-*.whl; do
  run_files="$run_files,$(ls "$dl"/$f)"
done
v4_files=""
for f in apache_tvm_ffi-*.whl torch_c_dlpack_ext-*.whl tile_kernels-1.0.0-py3-none-any.whl z3_solver-4.15.4.0-*.whl \
         tilelang-0.1.15-*.whl; do
  v4_files="$v4_files${v4_files:+,}$(ls "$dl"/$f)"
done
# a part and the working tree travel together under the device's 64 MiB
python3 bench/carry_parts.py pack --out "$carry" --part-mib "${PART_MIB:-56}" "te=$te_files" "run=$run_files" "v4=$v4_files"
du -sh "$carry"/c*
