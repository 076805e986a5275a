#!/usr/bin/env bash
# The wheels that benchmarks/gpu_checks.sh needs on this workplace's GPU image (Python 3.12, x86_64, its own torch
# with cuda; no network there), at constraints.txt's versions, downloaded here into DIR (default .whl, which
# .git/info/exclude should ignore). Carry DIR with the device call and install it there first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
#
#   benchmarks/gpu_wheels.sh [DIR]
set -euo pipefail
dir=${1:-.whl}
# The envs (gymnasium, ale-py with its ROMs), SEED's wire (grpcio, protobuf for the generated code), the
# metrics writer; mujoco (and glfw, which gymnasium's MuJoCo envs import) for test_presets' MuJoCo env;
# stable-baselines3 for paac-vs-sb3.
names=(gymnasium Farama-Notifications ale-py grpcio protobuf tensorboard mujoco mujoco-core glfw stable_baselines3)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$tag")
done
pins=()
for name in "${names[@]}"; do
    pin=$(grep -i "^${name}==" constraints.txt) \
        || { echo "gpu_wheels.sh: $name is not pinned in constraints.txt" >&2; exit 2; }
    pins+=("$pin")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir" "${pins[@]}"
du -sh "$dir"
