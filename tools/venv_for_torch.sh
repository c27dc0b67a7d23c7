#!/usr/bin/env bash
# A venv for another supported torch release, with this package and its test
# extra, and from torch 2.14 on the vision extra (torchvision, timm):
#
#     bash tools/venv_for_torch.sh 2.15.0            # -> .venv-torch2.15.0
#     .venv-torch2.15.0/bin/python -m pytest -q -p no:cacheprovider
#
# torch 2.14/2.15 come from the package registry as CUDA builds (~6 GB; they
# run on the CPU). The machine's pip settings may cap torch at an older
# release: they are bypassed here (PIP_CONFIG_FILE=/dev/null). Every other
# package is pinned by constraints.txt, whose torch line (the CPU wheel the
# README's commands use) gives way to the release asked for.
set -euo pipefail
cd "$(dirname "$0")/.."
release="${1:?usage: tools/venv_for_torch.sh TORCH_VERSION (e.g. 2.15.0)}"
extras="test,vision"  # torchvision's compiled ops need torch >= 2.14: 2.13 goes without
case "$release" in 2.13.*) extras="test" ;; esac
venv=".venv-torch${release}"
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$venv"
grep -v '^torch==' constraints.txt > "$venv/constraints.txt"
"$venv/bin/pip" install -q "torch==${release}"
if [ "${2:-}" != "--torch-only" ]; then
    "$venv/bin/pip" install -q -c "$venv/constraints.txt" "torch==${release}" -e ".[$extras]"
fi
