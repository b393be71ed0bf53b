#!/bin/bash
# The wheels a device lease carries (.whl/, ignored by git; `carry: [".whl"]`): the H200 machine has
# torch and Triton but no network. fla-core for every section of bench/gpu_session.sh; the server's
# dependencies (.whl/serve/) and py-spy (.whl/tools/) for its serve48 section. CPython 3.12, x86-64.
set -e
cd "$(dirname "$0")/.."
get() {  # get DIR PACKAGE==VERSION...
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "$@"
}
get .whl fla-core==0.6.0
get .whl/serve fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 opentelemetry-api==1.45.2 prometheus_client==0.26.0 \
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 idna==3.20 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
  httptools==0.9.0 uvloop==0.23.0
get .whl/tools py-spy==0.4.3
du -sh .whl
