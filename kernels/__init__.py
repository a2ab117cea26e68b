"""The C++ kernels: every `.cpp`/`.h` source kvserve compiles, the handle that loads each as
`torch.ops.<name>` (ops.py) and the build helper that compiles them at first use or ahead of time
(build.py). It owns what a kernel is and how it is built, not when one is worth calling: the
layers, attention backends and sampler that call an op decide that and keep the PyTorch
fallback. The bottom room: imports nothing of this project (torch and the standard library only);
`models/` and `engine/` import it, and an op that calls another op declares it (`needs`).
"""
