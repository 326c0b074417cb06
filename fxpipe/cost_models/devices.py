"""Accelerators as datasheet figures: peak FLOP/s, memory, links.

All FLOP/s are dense (no 2:4 structured sparsity): NVIDIA datasheets print the
sparse figure for tensor cores with an asterisk, and the dense figure is half.
Link bandwidths are one direction of one device's link (a point-to-point send
of a pipeline boundary moves bytes one way); datasheets print the sum of both
directions for NVLink, so the figure here is half of it.

Which float32 peak a matmul gets: PyTorch runs float32 matmuls and convolutions
in full fp32 unless ``torch.backends.cuda.matmul.allow_tf32`` (or
``torch.set_float32_matmul_precision("high")``) is set, so ``peak_flops("float32")``
is the plain fp32 (CUDA-core) figure; pass ``allow_tf32=True`` to get the TF32
tensor-core figure instead.

Latencies and launch overheads are not on any datasheet: they are typical
measured orders of magnitude (NCCL point-to-point ≈ a few µs over NVLink,
≈ 10 µs across InfiniBand; an eager PyTorch op ≈ 5 µs of launch/dispatch on a
GPU) and are marked as such. So is ``sac_dispatch``: on an H200's host, torch's SAC gave
each aten op 25–39 µs more host time than plain eager, which the device waits for wherever
its ops are short. An exported Llama layer is 52 graph nodes, which dispatch 93 aten ops
under autocast; at 60 µs a node, what four layers' selective recompute adds is planned
3 % over and 21 % under the H200's at 1024 and 4096 tokens, and 43 % over at 16384, where
the device hides more of it behind long matmuls than a sum node by node sees
(bench/sac_overhead.py, BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

__all__ = ["DEVICES", "Device", "UnknownDeviceError", "get_device"]

GiB = 2**30
GB = 10**9
TFLOPS = 10**12


class UnknownDeviceError(ValueError):
    """The device name is neither in ``DEVICES`` nor one of its aliases."""


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU socket) as the cost models see it; units are SI."""

    name: str
    peak_flops_by_dtype: Mapping[str, float] = field(hash=False)  # FLOP/s, keys: dtype names
    memory_bandwidth: float  # B/s, device memory (HBM / GDDR / DRAM)
    memory_bytes: int  # device memory capacity
    intra_node_bandwidth: float  # B/s one direction, to a peer in the same host (NVLink/PCIe)
    intra_node_latency: float  # s
    inter_node_bandwidth: float  # B/s one direction, to a peer in another host (NIC per device)
    inter_node_latency: float  # s
    launch_overhead: float  # s added to every kernel that does any work
    # Whose fused kernels run attention (fxpipe.kernels): "cuda" or "cpu"; and whether the
    # GPU has FlashAttention (compute capability 8.0 or later) or only memory-efficient.
    kernels: str = "cuda"
    flash_attention: bool = True
    # Host seconds a graph node takes run under torch's SAC in eager mode (selective
    # recompute: a Python dispatch mode asks the policy about every aten op and caches
    # what it keeps), on its first run and again on its run again; a node that keeps the
    # device busy longer hides it. Fitted, not a datasheet figure (the module docstring).
    sac_dispatch: float = 60e-6

    def peak_flops(self, dtype: str, *, allow_tf32: bool = False) -> float:
        """Peak FLOP/s for ``dtype`` (a torch dtype name such as "float32").

        float32 uses the TF32 tensor-core peak only with ``allow_tf32`` (see the
        module docstring). A dtype the device has no figure for (bfloat16 on a
        V100, integers) falls back to the float32 peak: such ops either run
        emulated at about the fp32 rate or do no floating-point work at all.
        """
        peaks = self.peak_flops_by_dtype
        if dtype == "float32" and allow_tf32 and "tf32" in peaks:
            return peaks["tf32"]
        if dtype in peaks:
            return peaks[dtype]
        return peaks["float32"]


# NVLink 4 (H100/H200 SXM): 900 GB/s total = 450 GB/s per direction.
# NDR InfiniBand, one 400 Gb/s NIC per GPU (DGX H100 / HGX reference design) = 50 GB/s.
_NVLINK4 = 450 * GB
_NDR_PER_GPU = 50 * GB
# NVLink 3 (A100 SXM): 600 GB/s total = 300 GB/s per direction.
# HDR InfiniBand, one 200 Gb/s NIC per GPU (DGX A100) = 25 GB/s.
_NVLINK3 = 300 * GB
_HDR_PER_GPU = 25 * GB
_NVLINK_LATENCY = 5e-6  # typical NCCL send/recv latency, not a datasheet figure
_IB_LATENCY = 10e-6  # typical NCCL latency across hosts, not a datasheet figure
_PCIE_LATENCY = 10e-6
_GPU_LAUNCH = 5e-6  # eager PyTorch op: dispatch + kernel launch, not a datasheet figure

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column), dense figures:
# FP64 34 TF, FP64 TC 67 TF, FP32 67 TF, TF32 TC 989/2, BF16/FP16 TC 1979/2;
# 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s.
_H100 = Device(
    name="h100",
    peak_flops_by_dtype={
        "float64": 67 * TFLOPS,  # FP64 tensor core (DGEMM)
        "float32": 67 * TFLOPS,
        "tf32": 494.5 * TFLOPS,
        "bfloat16": 989.5 * TFLOPS,
        "float16": 989.5 * TFLOPS,
    },
    memory_bandwidth=3.35e12,
    memory_bytes=80 * GiB,
    intra_node_bandwidth=_NVLINK4,
    intra_node_latency=_NVLINK_LATENCY,
    inter_node_bandwidth=_NDR_PER_GPU,
    inter_node_latency=_IB_LATENCY,
    launch_overhead=_GPU_LAUNCH,
)

# NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM column), dense figures:
# FP64 TC 19.5 TF, FP32 19.5 TF, TF32 TC 156 TF, BF16/FP16 TC 312 TF;
# 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s.
_A100_40GB = Device(
    name="a100-40gb",
    peak_flops_by_dtype={
        "float64": 19.5 * TFLOPS,
        "float32": 19.5 * TFLOPS,
        "tf32": 156 * TFLOPS,
        "bfloat16": 312 * TFLOPS,
        "float16": 312 * TFLOPS,
    },
    memory_bandwidth=1555 * GB,
    memory_bytes=40 * GiB,
    intra_node_bandwidth=_NVLINK3,
    intra_node_latency=_NVLINK_LATENCY,
    inter_node_bandwidth=_HDR_PER_GPU,
    inter_node_latency=_IB_LATENCY,
    launch_overhead=_GPU_LAUNCH,
)

DEVICES: dict[str, Device] = {
    "h100": _H100,
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): same compute and links as
    # the H100 SXM; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
    "h200": replace(_H100, name="h200", memory_bandwidth=4.8e12, memory_bytes=141 * GiB),
    "a100-40gb": _A100_40GB,
    # Same datasheet, A100 80GB SXM column: same compute; 80 GB HBM2e at 2,039 GB/s.
    "a100-80gb": replace(_A100_40GB, name="a100-80gb", memory_bandwidth=2039 * GB,
                         memory_bytes=80 * GiB),
    # NVIDIA Tesla V100 datasheet (V100 SXM2 32GB column): FP64 7.8 TF, FP32 15.7 TF,
    # tensor (FP16) 125 TF; no TF32 or BF16 (bfloat16 falls back to the fp32 figure);
    # 32 GB HBM2 at 900 GB/s; NVLink 300 GB/s. EDR InfiniBand 100 Gb/s per GPU (DGX-1).
    "v100": Device(
        name="v100",
        peak_flops_by_dtype={
            "float64": 7.8 * TFLOPS,
            "float32": 15.7 * TFLOPS,
            "float16": 125 * TFLOPS,
        },
        memory_bandwidth=900 * GB,
        memory_bytes=32 * GiB,
        intra_node_bandwidth=150 * GB,
        intra_node_latency=_NVLINK_LATENCY,
        inter_node_bandwidth=12.5 * GB,
        inter_node_latency=_IB_LATENCY,
        launch_overhead=_GPU_LAUNCH,
        flash_attention=False,  # Volta (sm70): PyTorch's flash kernels need sm80
    ),
    # NVIDIA L4 Tensor Core GPU datasheet, dense figures: FP32 30.3 TF, TF32 TC 120/2,
    # BF16/FP16 TC 242/2 (FP64 not listed: runs at 1/64 of FP32, left to the fallback
    # would overstate it, so it is given as 30.3/64); 24 GB GDDR6 at 300 GB/s;
    # PCIe Gen4 x16 (64 GB/s both directions), no NVLink. Inter-node: 100 Gb/s
    # Ethernet per GPU assumed (a typical cloud L4 host; not on the datasheet).
    "l4": Device(
        name="l4",
        peak_flops_by_dtype={
            "float64": 30.3 / 64 * TFLOPS,
            "float32": 30.3 * TFLOPS,
            "tf32": 60 * TFLOPS,
            "bfloat16": 121 * TFLOPS,
            "float16": 121 * TFLOPS,
        },
        memory_bandwidth=300 * GB,
        memory_bytes=24 * GiB,
        intra_node_bandwidth=32 * GB,
        intra_node_latency=_PCIE_LATENCY,
        inter_node_bandwidth=12.5 * GB,
        inter_node_latency=_IB_LATENCY,
        launch_overhead=_GPU_LAUNCH,
    ),
    # One socket of an Intel Xeon Platinum 8480+ (ark.intel.com: 56 cores, 2.0 GHz
    # base, two AVX-512 FMA units per core, 8 channels of DDR5-4800):
    # fp32 = 56 × 2.0e9 × 2 FMA × 16 lanes × 2 = 7.17 TF, fp64 half of it, bf16 with
    # AVX512-BF16 twice fp32 (AMX would be far more; not assumed); 8 × 38.4 GB/s =
    # 307 GB/s DRAM. Memory capacity 512 GiB assumed. "Links": a same-host copy runs
    # at DRAM speed (half: read + write); across hosts 100 Gb/s Ethernet.
    "cpu": Device(
        name="cpu",
        peak_flops_by_dtype={
            "float64": 3.58 * TFLOPS,
            "float32": 7.17 * TFLOPS,
            "bfloat16": 14.3 * TFLOPS,
        },
        memory_bandwidth=307 * GB,
        memory_bytes=512 * GiB,
        intra_node_bandwidth=153 * GB,
        intra_node_latency=1e-6,
        inter_node_bandwidth=12.5 * GB,
        inter_node_latency=20e-6,
        launch_overhead=2e-6,  # eager PyTorch dispatch on the CPU, not a datasheet figure
        kernels="cpu",
        # SAC: about 20 µs an aten op on a 2-core Xeon, 1.6 aten ops a node of a float32
        # Llama layer (bench/sac_overhead.py --small); rough, not a datasheet figure
        sac_dispatch=30e-6,
    ),
}

ALIASES: dict[str, str] = {
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h100-sxm-80gb": "h100",
    "h200-sxm": "h200",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "v100-sxm2": "v100",
    "v100-32gb": "v100",
}


def get_device(name: str) -> Device:
    """The ``Device`` called ``name`` (case-insensitive; aliases such as "a100" work)."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        known = ", ".join(sorted(DEVICES))
        raise UnknownDeviceError(f"unknown device {name!r}; known devices: {known}")
    return DEVICES[key]
