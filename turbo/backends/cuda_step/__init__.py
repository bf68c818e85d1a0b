"""The CUDA step of its own (issue #55): the trunk's layers as a few fused launches each
(kernels_ptx/step.cu and bgemv.cu), matrices resident as stored, every buffer allocated at open
through the driver API (cuda_kernels.Kernels), no torch CUDA tensors. kernels.py: the launches; step.py: CudaTrunkStep
(dense and MoE layers; TURBO_CUDA_STEP=1 selects it in turbo/load/loader.py). DEVICE-UNVERIFIED."""
