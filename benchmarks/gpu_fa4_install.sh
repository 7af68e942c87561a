# Sourced by the one-GPU run scripts (docs/testing.md): the collective switches, $out, the wheels
# installed under /tmp/site (the cuDNN frontend at the first call, FA4 at the second), the
# PYTHONPATH FA4's DSL needs, and this checkout installed.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-bench_out}; mkdir -p "$out"
# The first call carries .whl/p1 (the small wheels, the cuDNN frontend, the first part of the cu13
# wheel): copied to /root/parts, the frontend installed, so that call can run what needs no FA4.
# The second carries .whl/p2 (the cu13 wheel's second part): joined and everything installed.
if [ -d .whl/p1 ]; then mkdir -p /root/parts && cp .whl/p1/* /root/parts/; fi
if [ ! -e /tmp/site/.full ]; then
  if [ -f .whl/p2/cu13.part.ab ]; then
    cat /root/parts/cu13.part.aa .whl/p2/cu13.part.ab > /root/parts/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/parts/*.whl 2>&1 | tail -2 && touch /tmp/site/.full
  elif [ ! -e /tmp/site/.first ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/parts/nvidia_cudnn_frontend-*.whl \
      /root/parts/expecttest-*.whl 2>&1 | tail -2 && touch /tmp/site/.first
  fi
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
# (a run that calls itself for a second mode sets CP_INSTALLED: one install, no two at once)
[ -n "${CP_INSTALLED:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
export CP_INSTALLED=1
