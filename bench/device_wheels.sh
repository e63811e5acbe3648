#!/usr/bin/env bash
# The wheels the GPU machine (Python 3.12, no network) lacks beyond ../shared/device/wheels:
# llguidance (structured output, issue 42) and jsonschema with its dependencies (tool schemas).
# Run after ../shared/device/prepare.sh, from the repository root; they land in .device/, which
# .device/setup.sh installs from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_31_x86_64 -d .device \
  llguidance==1.9.1 jsonschema==4.26.0 attrs==26.1.0 referencing==0.37.0 rpds-py==0.30.0 \
  jsonschema-specifications==2025.9.1
ls .device/*.whl
