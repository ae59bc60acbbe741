"""Copy backends: `base` (the types, and the CPU thread backend), `cuda` (batched DMA, SM kernel,
"auto"; `cuda_driver`: the driver's batched memcpy through ctypes), `factory` (`make_backend`)."""
