# Sourced by the scripts that run on a GPU machine (device-run.sh, device-profile.sh).
# Safety: NVLink multicast stays off. The three disabling variables are forced on and
# SYMMALLOC_ENABLE_MULTICAST is removed, so nothing started from here can create a multicast
# object. Also sets D (the prebuilt artifacts in .device/) and OUT (where logs go).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset SYMMALLOC_ENABLE_MULTICAST
D=$PWD/.device
OUT=${OUT:-/tmp/symm-out}
mkdir -p "$OUT"
