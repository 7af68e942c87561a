# Sourced by the one-H200 run scripts, second call of two (docs/testing.md): the collective
# switches, $out, FA4's wheels joined and installed under /tmp/site (once per machine), the
# PYTHONPATH FA4's DSL needs, and this checkout installed.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-bench_out}; mkdir -p "$out"
if [ ! -d /tmp/site/flash_attn ]; then
  cat /root/parts/cu13.part.aa .whl/p2/cu13.part.ab > /root/parts/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /root/parts/*.whl .whl/p2/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
# (a run that calls itself for a second mode sets CP_INSTALLED: one install, no two at once)
[ -n "${CP_INSTALLED:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
export CP_INSTALLED=1
