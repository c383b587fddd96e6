"""What a device uses and how the step talks to it: platform, CPU features, host/device I/O,
CUDA graphs, the CUDA step rehearsed on the CPU."""
